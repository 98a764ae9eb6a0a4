"""Timing a call on the GPU with CUDA events: what the ops measure when they choose a backend, and
what never-slower measures (GPU time of CUDA-graph replays, without the host's)."""
import functools
import statistics

import torch

REPLAYS, SAMPLES = 20, 5  # calls per graph, graph replays timed


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


def captured(fn, calls: int = 1):
    """(a CUDA graph of `calls` calls of fn, the last call's outputs), after warm-up calls on a side
    stream (which compile Triton kernels, pick cuBLASLt's and make cuSPARSELt's plans)."""
    stream = warm_up_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outputs = fn()
    return graph, outputs


@functools.cache
def warm_up_stream(device: int) -> torch.cuda.Stream:
    """One side stream per device for every warm-up: cuBLAS keeps a workspace for each stream it
    has run on, for the life of the process (a new stream per timing held 265 MiB after one convert)."""
    return torch.cuda.Stream(device)


def graph_ms(fn) -> float:
    """Median ms of one fn() replayed from a CUDA graph."""
    graph, _ = captured(fn, REPLAYS)
    times = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    return statistics.median(times)
