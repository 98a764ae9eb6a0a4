"""Tune kernels/fp8_small_m.py: its configurations against cuBLAS bf16 and torch._scaled_mm at a
decode step's row counts and Llama-3-8B's linear shapes, each timed as a CUDA graph replay
(cuda_timing.graph_ms: GPU time, as never-slower measures), after a check against the reference.

    PYTHONPATH=. python3 scripts/tune_fp8_small_m.py --out DIR
"""
import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from lowconv.kernels import fp8_small_m
from lowconv.kernels.fp8 import fp8_linear_reference, quantize, quantize_weight, scaled_mm_linear
from lowconv.kernels.cuda_timing import graph_ms

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
# (BLOCK_N, STAGES) with the module's BLOCK_K, WARPS and MIN_K_STEPS; the earlier sweep of those
# (BLOCK_K 128 or 256, MIN_K_STEPS 2 or 4) chose 256 and, mostly, 2
CONFIGS = list(itertools.product((32, 64, 128), (3, 4, 5)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16,64")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results = []
    for (layer, (n, k)), m in itertools.product(SHAPES.items(), map(int, args.rows.split(","))):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x_fp8, x_scale = quantize(x, "row")
        w_fp8, w_scale = quantize_weight(w, "row", torch.bfloat16)
        gemm = (x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16, True)
        ref = fp8_linear_reference(*gemm[:-1]).float()
        row = {"layer": layer, "M": m, "N": n, "K": k,
               "bf16_us": graph_ms(lambda: F.linear(x, w)) * 1e3,
               "scaled_mm_us": graph_ms(lambda: scaled_mm_linear(*gemm[:-1], True, True)) * 1e3,
               "rule_us": graph_ms(lambda: fp8_small_m.fp8_gemm_rows(*gemm)) * 1e3,
               "rule": fp8_small_m.tiles(m, n, k)}
        best = None
        for config in CONFIGS:
            try:
                got = fp8_small_m.fp8_gemm_rows(*gemm, config).float()
            except OutOfResources:  # too many stages of too large tiles for shared memory
                continue
            err = float((got - ref).norm() / ref.norm())
            assert err < 1e-2, (config, err)
            us = graph_ms(lambda: fp8_small_m.fp8_gemm_rows(*gemm, config)) * 1e3
            if best is None or us < best[0]:
                best = (us, config, err)
        row.update(triton_us=best[0], config=best[1], rel_err=best[2])
        print(json.dumps(row), flush=True)
        results.append(row)
    (args.out / "tune_fp8_small_m.json").write_text(json.dumps(results, indent=1))
    print(f"{'layer':8} {'M':>4} {'bf16 us':>8} {'scaled_mm':>10} {'tiles()':>8} {'best':>8}  best (BLOCK_N, STAGES)")
    for r in results:
        print(f"{r['layer']:8} {r['M']:4} {r['bf16_us']:8.1f} {r['scaled_mm_us']:10.1f} {r['rule_us']:8.1f} "
              f"{r['triton_us']:8.1f}  {r['config']} (tiles(): {r['rule']})")


if __name__ == "__main__":
    main()
