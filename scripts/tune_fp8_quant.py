#!/usr/bin/env python3
"""Tile sizes of the Triton FP8 quantizers (lowconv/kernels/fp8_quant.py), by measurement on the GPU.

For each (BLOCK, MAX_PROGRAMS) the per-tensor, given-scale and per-row quantizers of a bf16 x
are timed (median of triton.testing.do_bench, L2 flushed) next to a copy of x, at the activation
shapes of the ViT-L MLP (13008 x 1024 fits the H100's 50 MB L2, 13008 x 4096 does not).

    PYTHONPATH=. python3 scripts/tune_fp8_quant.py
"""
import itertools

import torch
import triton
from tabulate import tabulate

from lowconv.kernels import fp8_quant
from lowconv.kernels.fp8 import E4M3

SHAPES = [(13008, 1024), (13008, 4096), (8192, 8192)]
BLOCKS = [1024, 2048]
MAX_PROGRAMS = [132, 264, 528, 1024, 1056, 2048]


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    rows = []
    for rows_, cols in SHAPES:
        x = torch.randn(rows_, cols, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        scale = fp8_quant.quantize_tensorwise(x, E4M3)[1]
        clipped = torch.zeros((), dtype=torch.int64, device="cuda")
        copy_ms = median_ms(lambda: y.copy_(x))
        for block, programs in itertools.product(BLOCKS, MAX_PROGRAMS):
            fp8_quant.BLOCK, fp8_quant.MAX_PROGRAMS = block, programs
            times = [median_ms(lambda: fp8_quant.quantize_tensorwise(x, E4M3)),
                     median_ms(lambda: fp8_quant.quantize_with_scale(x, scale, E4M3, clipped)),
                     median_ms(lambda: fp8_quant.quantize_rowwise(x, E4M3))]
            # Share of copy bandwidth, counting x read once and x_fp8 written once (3/4 of a copy's bytes).
            rows.append([f"{rows_}x{cols}", block, programs, f"{copy_ms:.4f}",
                         *(f"{t:.4f} ({0.75 * copy_ms / t:.0%})" for t in times)])
    print(tabulate(rows, headers=["x", "BLOCK", "MAX_PROGRAMS", "copy ms", "tensorwise ms", "with scale ms",
                                  "rowwise ms"], tablefmt="github"))


if __name__ == "__main__":
    main()
