"""Measuring one call, as the benchmarks in scripts/ do: the median time (triton's do_bench on
CUDA, wall clock on the CPU) and the workspace memory, and the helpers around it."""
import statistics
import time

import torch
import triton.testing

CPU_REPS = 3


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, warmup_ms, rep_ms):
    """Median ms and workspace memory (MB, 1e6 bytes: the peak allocated during fn() beyond
    the memory before it and the tensors it returns) of fn(); its first call (compiles,
    autotuning) is timed apart. On CPU: a median of a few wall-clock calls, no memory."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    first_call_s = time.perf_counter() - start
    if device.type != "cuda":
        times = []
        for _ in range(CPU_REPS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return {"ms": statistics.median(times) * 1e3, "workspace_mb": None, "first_call_s": first_call_s}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result_bytes = sum(t.numel() * t.element_size() for t in returned_tensors(fn()))
    torch.cuda.synchronize()
    workspace_mb = (torch.cuda.max_memory_allocated() - base - result_bytes) / 1e6
    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return {"ms": ms, "workspace_mb": workspace_mb, "first_call_s": first_call_s}


def returned_tensors(result):
    """The distinct tensors in fn()'s result (None, an output, or a tuple of them)."""
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    tensors = [t for part in result for t in returned_tensors(part)]
    return list({id(t): t for t in tensors}.values())


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
