"""Never slower: an op module timed against the linear it replaces, at the site's traced shape.

Both run eagerly first (Triton compiles, cuBLASLt picks its kernel), then captured in a CUDA graph
and replayed: what is compared is the GPU time of the eager module (host time is what torch.compile
and CUDA graphs remove, and would make every small GEMM look slower). An FP8 layer is timed with its
quantization of x: timing its GEMM alone (as if inductor fused the quantization away) converted all
48 of ViT-B/16's sites and made the compiled model slower (0.98x bf16 compiled, against 1.14x with
them kept; H100, bench_models.py). Layers of one op and options that read the same input (q, k and
v; gate and up) share it: under torch.compile their quantizations of x are one kernel, so each is
charged its share of it (the op module's `input_step`). Eagerly each layer quantizes x itself.
Modules that need calibration (static and delayed FP8 scales) are not timed: their scale is not
set before calibration, which runs after the rewrite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from lowconv.kernels.cuda_timing import graph_ms
from lowconv.ops.registry import Calibrated, SharesInputStep
from lowconv.passes.linear import linear_input
from lowconv.site import Site

SLOWER_BY = 1.03  # the op is kept only beyond this ratio: closer than that is the timing's noise


@dataclass
class SiteTiming:
    op_ms: float
    original_ms: float
    shape: str  # "M x K x N" of the site's GEMM
    shared_by: int = 1  # sites whose op modules quantize the same input (its time shared among them)

    def describe(self, op: str) -> str:
        shared = f", x's quantization shared by {self.shared_by} sites" if self.shared_by > 1 else ""
        return (f"{op} {self.op_ms * 1e3:.1f} us vs the original's {self.original_ms * 1e3:.1f} us at {self.shape} "
                f"(CUDA graph replay{shared}, {self.original_ms / self.op_ms:.2f}x)")


def time_linear_site(site: Site, module: nn.Module, params: dict[str, torch.Tensor],
                     shared_by: int = 1) -> SiteTiming | None:
    """The op module and F.linear with the site's original weight and bias, on a random input of
    the site's traced shape, the module's `input_step` (if it has one) counted 1 / shared_by times;
    None where it is not timed (not on CUDA, no traced input, training modules, modules that wait
    for calibration)."""
    weight, bias = params["weight"], params.get("bias")
    if (not weight.is_cuda or site.input is None or (isinstance(module, Calibrated) and module.needs_calibration)
            or getattr(getattr(module, "options", None), "training", False)):
        return None
    x = torch.randn(site.input.shape, dtype=getattr(torch, site.input.dtype), device=weight.device)
    with torch.no_grad():
        op_ms = graph_ms(lambda: module(x))
        if shared_by > 1 and isinstance(module, SharesInputStep):
            op_ms -= graph_ms(lambda: module.input_step(x)) * (1 - 1 / shared_by)
        else:
            shared_by = 1
        original_ms = graph_ms(lambda: F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)))
    rows = math.prod(site.input.shape[:-1])
    return SiteTiming(op_ms, original_ms, f"{rows} x {weight.shape[1]} x {weight.shape[0]}", shared_by)


def input_groups(sites: list[Site], options: dict[str, str]) -> dict[str, tuple]:
    """fqn -> its group: linear sites of one op and options (`options`: fqn -> their repr) that read
    the same input node share one; any other site is a group of its own."""
    def key(site):
        x = input_node(site)
        return (site.region, x.name, options[site.fqn]) if isinstance(x, fx.Node) else (site.fqn,)
    return {site.fqn: key(site) for site in sites}


def input_node(site: Site):
    """The graph node a linear site reads as x (None: not a linear, or no graph)."""
    if site.kind != "linear":
        return None
    if site.module_backed:
        return linear_input(site.output_node) if isinstance(site.output_node, fx.Node) else None
    return site.args[0] if site.args else None


def slower_sites(timings: dict[str, SiteTiming | None], groups: dict[str, tuple]) -> set[str]:
    """The timed sites never-slower keeps: those of a group (input_groups) whose op times add up to
    more than their originals' (beyond SLOWER_BY); a group's layers are kept or converted together,
    as the share of the input's quantization each was charged assumes."""
    totals: dict[tuple, list[float]] = {}
    for fqn, timing in timings.items():
        if timing is not None:
            total = totals.setdefault(groups[fqn], [0.0, 0.0])
            total[0] += timing.op_ms
            total[1] += timing.original_ms
    return {fqn for fqn, timing in timings.items()
            if timing is not None and totals[groups[fqn]][0] > totals[groups[fqn]][1] * SLOWER_BY}
