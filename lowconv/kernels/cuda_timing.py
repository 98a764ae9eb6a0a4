"""Timing a call on the GPU with CUDA events: what the ops measure when they choose a backend."""
import torch


def cuda_ms_per_call(call, samples: int, calls: int) -> list[float]:
    """ms per call of `call`: `samples` samples of `calls` back-to-back calls each (host time shows
    where the calls are host-bound), after a warm-up call."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times
