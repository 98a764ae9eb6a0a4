#!/usr/bin/env python3
"""The FP8 row quantization of an activation's output (kernels/fp8.py quantize_rows_after), three ways,
on the GPU: whether the kernel an FP8 layer after an MLP's activation runs beats what inductor
makes of the same torch ops.

- kernel: fp8_quant's kernel, a program per row that never writes the activation (a row of up to
  ONE_PASS_ROWS_MAX values held in registers, a longer one computed twice: amax, then the cast);
- activation, then rows: the activation in torch ops under torch.compile (one inductor kernel, as
  in a compiled model), then fp8_quant's per-row kernel;
- inductor: torch.compile of the torch reference (activation and quantization in torch ops).
Each is checked against the torch reference first (scales within two bf16 steps; the share of
equal e4m3 values is reported). Times: medians of interleaved rounds (one
triton.testing.do_bench median per way per round), the spread in brackets; "of copy" is the share
of a copy's bandwidth, counting x (and up) read once and the e4m3 rows written once.

    PYTHONPATH=. python3 scripts/bench_rows_after.py [--out DIR] [--rounds 3]
"""
import argparse
import random
import statistics
from pathlib import Path

import torch
import triton
from tabulate import tabulate

from lowconv.kernels import fp8, fp8_quant

# (rows, row length, activation, gated): Llama-8B's MLP at 8 x 2048 tokens and at a decode step of
# 64, the 2048-wide Llama's at 4 x 1024, ViT-L/16's at batch 64.
CASES = [(16384, 14336, "silu", True), (64, 14336, "silu", True), (4096, 8192, "silu", True),
         (12608, 4096, "gelu", False)]


def kernel(x, activation, up):
    return fp8_quant.quantize_rows_after(x, activation, up, fp8.E4M3)


activate = torch.compile(fp8.activate, fullgraph=True, dynamic=False)


def activation_then_rows(x, activation, up):
    return fp8_quant.quantize_rowwise(activate(x, activation, up), fp8.E4M3)


def reference(x, activation, up):
    return fp8.quantize_rowwise(fp8.activate(x, activation, up), fp8.E4M3)


WAYS = {"kernel": kernel, "activation, then rows": activation_then_rows,
        "inductor": torch.compile(reference, fullgraph=True, dynamic=False)}


def equal_share(got, want) -> float:
    """The share of the way's e4m3 values equal to the torch reference's; its scales must be within
    two bf16 steps of the reference's (the activation's fp32 math may differ in the last bits)."""
    torch.testing.assert_close(got[1], want[1], rtol=2 ** -6, atol=0)
    return (got[0].float() == want[0].float()).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write bench_rows_after.md here")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for m, k, activation, gated in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        up = torch.randn_like(x) if gated else None
        copy_in = torch.cat([x, up]) if gated else x.clone()
        copy_out = torch.empty_like(copy_in)
        copy_ms = triton.testing.do_bench(lambda: copy_out.copy_(copy_in), return_mode="median")
        want = reference(x, activation, up)
        equal = {name: equal_share(way(x, activation, up), want) for name, way in WAYS.items()}
        times = {name: [] for name in WAYS}
        for _ in range(args.rounds):
            order = list(WAYS.items())
            random.shuffle(order)
            for name, way in order:
                times[name].append(triton.testing.do_bench(lambda: way(x, activation, up), return_mode="median"))
        # A copy moves 2 x the bytes of its input; the quantizer reads x (and up) and writes a byte a value.
        bytes_moved = x.numel() * (2 * (2 if gated else 1) + 1)
        copy_gbps = 2 * copy_in.numel() * 2 / copy_ms / 1e6
        for name, ts in times.items():
            median = statistics.median(ts)
            rows.append([f"{m}x{k} {activation}{' * up' if gated else ''}", name,
                         f"{median * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})",
                         f"{bytes_moved / median / 1e6 / copy_gbps:.0%}", f"{equal[name]:.2%}"])
    table = tabulate(rows, headers=["x", "way", "us (spread)", "of copy", "e4m3 equal to torch's"],
                     tablefmt="github")
    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{args.rounds} interleaved rounds")
    print(header, table, sep="\n\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_rows_after.md").write_text(f"{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
