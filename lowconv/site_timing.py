"""Never slower: an op module timed against the linear it replaces, at the site's traced shape.

Both run eagerly first (Triton compiles, cuBLASLt picks its kernel), then captured in a CUDA graph
and replayed: what is compared is the GPU time of the eager module (host time is what torch.compile
and CUDA graphs remove, and would make every small GEMM look slower). An FP8 layer is timed with its
quantization of x: timing its GEMM alone (as if inductor fused the quantization away) converted all
48 of ViT-B/16's sites and made the compiled model slower (0.98x bf16 compiled, against 1.14x with
them kept; H100, bench_models.py).
Modules that need calibration (static and delayed FP8 scales) are not timed: their scale is not
set before calibration, which runs after the rewrite.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.site import Site

SLOWER_BY = 1.03  # the op is kept only beyond this ratio: closer than that is the timing's noise
REPLAYS, SAMPLES = 20, 5  # calls per graph, graph replays timed


@dataclass
class SiteTiming:
    op_ms: float
    original_ms: float
    shape: str  # "M x K x N" of the site's GEMM

    @property
    def slower(self) -> bool:
        return self.op_ms > self.original_ms * SLOWER_BY

    def describe(self, op: str) -> str:
        return (f"{op} {self.op_ms * 1e3:.1f} us vs the original's {self.original_ms * 1e3:.1f} us at {self.shape} "
                f"(CUDA graph replay, {self.original_ms / self.op_ms:.2f}x)")


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


def time_linear_site(site: Site, module: nn.Module, params: dict[str, torch.Tensor]) -> SiteTiming | None:
    """The op module and F.linear with the site's original weight and bias, on a random input of
    the site's traced shape; None where it is not timed (not on CUDA, no traced input, training
    modules, modules that wait for calibration)."""
    weight, bias = params["weight"], params.get("bias")
    if (not weight.is_cuda or site.input is None or getattr(module, "needs_calibration", False)
            or getattr(getattr(module, "options", None), "training", False)):
        return None
    x = torch.randn(site.input.shape, dtype=getattr(torch, site.input.dtype), device=weight.device)
    with torch.no_grad():
        op_ms = graph_ms(lambda: module(x))
        original_ms = graph_ms(lambda: F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)))
    rows = math.prod(site.input.shape[:-1])
    return SiteTiming(op_ms, original_ms, f"{rows} x {weight.shape[1]} x {weight.shape[0]}")
