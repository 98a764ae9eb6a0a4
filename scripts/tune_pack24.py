#!/usr/bin/env python3
"""Tile sizes of the fixed-mask 2:4 kernels (lowconv/kernels/pack24.py), by measurement on the GPU.

For each (rows, groups of 4, warps) tile: pack_kept of a dense bf16 dW (the training step's weight
gradient, packed to its kept values) and transpose_kept of a transposable mask's kept values (W^T
for dX's 2:4 GEMM), at llama-2048's MLP shapes (gate/up 8192 x 2048, down 2048 x 8192), timed
(median of triton.testing.do_bench) next to a copy of the same bytes, so each reads as a share of
the copy's bandwidth.

    PYTHONPATH=. python3 scripts/tune_pack24.py
"""
import itertools

import torch
import triton
from tabulate import tabulate

from lowconv.kernels import pack24
from lowconv.kernels.pack24 import kept_codes, pack_kept, pack_kept_reference, transpose_kept
from lowconv.kernels.sparse24 import mask_24_transposable

SHAPES = [(8192, 2048), (2048, 8192)]
TILES = [(rows, groups, warps) for rows, groups in itertools.product((16, 32, 64, 128), (16, 32, 64, 128))
         if rows * groups <= 4096 for warps in (4, 8)]


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    table = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        mask = mask_24_transposable(w)
        codes, codes_t = kept_codes(mask), kept_codes(mask.t())
        kept = pack_kept_reference(w, codes)
        packed, transposed = torch.empty_like(kept), torch.empty(k, n // 2, dtype=w.dtype, device="cuda")
        copy = torch.empty_like(w)
        copy_ms = median_ms(lambda: copy.copy_(w))  # 2 x the weight's bytes, as pack reads 1 and writes 1/2
        half_ms = median_ms(lambda: packed.copy_(kept))  # what transpose reads and writes
        for tile in TILES:
            pack24.PACK_TILE = pack24.TRANSPOSE_TILE = tile
            pack_ms = median_ms(lambda: pack_kept(w, codes, packed))
            transpose_ms = median_ms(lambda: transpose_kept(kept, codes, codes_t, transposed))
            table.append([f"{n}x{k}", *tile, f"{pack_ms * 1e3:.1f} ({0.75 * copy_ms / pack_ms:.0%})",
                          f"{transpose_ms * 1e3:.1f} ({half_ms / transpose_ms:.0%})"])
    print(tabulate(table, headers=["W", "rows", "groups", "warps", "pack us (of copy bw)",
                                   "transpose us (of copy bw)"], tablefmt="github"))


if __name__ == "__main__":
    main()
