#!/usr/bin/env python3
"""Tile sizes of the block-attention kernels on a band alone (BAND_TILES), measured: each kernel
alone, for each candidate Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), at batch 8 x heads 16,
causal and local (W = 256) bands, by head_dim. Each candidate's output (or gradients) on batch 0,
head 0 is checked against the float64 reference first. The fastest per kernel and head_dim go
into lowconv.kernels.block_attention_triton.BAND_TILES by hand.

Compiling every candidate takes minutes, so worker processes compile them in parallel first
(into Triton's cache, with the same shapes as the timed run); the timing is then one process.

    python3 scripts/tune_block_attention.py --out DIR [--seq 4096] [--head-dims 64 128] [--dtype fp16]
"""
import argparse
import concurrent.futures
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv.kernels.block_attention as ba  # noqa: E402
import lowconv.kernels.block_attention_triton as bat  # noqa: E402

Tiles = bat.Tiles
CANDIDATES = {
    "_forward_kernel": [Tiles(64, 64, 4), Tiles(128, 64, 4), Tiles(128, 64, 8), Tiles(128, 128, 8),
                        Tiles(128, 128, 4), Tiles(128, 32, 4), Tiles(128, 64, 4, 4), Tiles(128, 64, 8, 2)],
    "_backward_query_kernel": [Tiles(64, 64, 4), Tiles(128, 32, 4), Tiles(128, 64, 8), Tiles(128, 32, 8),
                               Tiles(64, 32, 4), Tiles(128, 64, 4, 2), Tiles(64, 64, 4, 2)],
    "_backward_key_kernel": [Tiles(64, 64, 4), Tiles(32, 128, 4), Tiles(64, 128, 8), Tiles(32, 128, 8),
                             Tiles(32, 64, 4), Tiles(64, 128, 4, 2), Tiles(64, 64, 4, 2)],
}
BANDS = {"causal": ("causal", None), "local-256": ("causal_local", 256)}  # one compiled kernel
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BATCH, HEADS = 8, 16
GRADS = {"_forward_kernel": ("out",), "_backward_query_kernel": ("dq",), "_backward_key_kernel": ("dk", "dv")}


class Problem:
    """Inputs, the forward's statistics and every buffer the kernels write, for one band."""

    def __init__(self, seq, d, dtype, band):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.q, self.k, self.v, self.do = (torch.randn(BATCH, HEADS, seq, d, generator=gen, device="cuda",
                                                       dtype=dtype) for _ in range(4))
        layout, window = BANDS[band]
        self.layout, self.window = layout, window
        lower, upper = ba.band(layout, window, seq, seq)
        self.launch = bat.Launch(self.q, self.k, None, None, None, None, None, None, lower, upper, True, d ** -0.5)
        self.out = torch.empty_like(self.q)
        self.stats = torch.empty((bat.STATS, *self.q.shape[:3]), device="cuda")
        self.delta = torch.empty(self.q.shape[:3], device="cuda")
        self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(3))
        self.call("_forward_kernel")()
        self.call("_backward_query_kernel")()  # writes delta, which the key kernel reads

    def call(self, kernel_name):
        kernel = getattr(ba, kernel_name)
        args = {"_forward_kernel": (self.q, self.k, self.v, self.out, self.stats),
                "_backward_query_kernel": (self.q, self.k, self.v, self.do, self.out, self.stats, self.delta,
                                           self.dq),
                "_backward_key_kernel": (self.q, self.k, self.v, self.do, self.stats, self.delta, self.dk,
                                         self.dv)}[kernel_name]
        return lambda: self.launch.run(kernel, *args, transposed=kernel_name == "_backward_key_kernel")

    def reference(self):
        """float64 out, dq, dk, dv of batch 0, head 0."""
        q, k, v = (t[:1, :1].double().requires_grad_() for t in (self.q, self.k, self.v))
        out = ba.block_attention_reference(q, k, v, layout=self.layout, window=self.window)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), self.do[:1, :1].double())
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def use(kernel_name, d, tiles):
    bat.BAND_TILES[kernel_name] = {**bat.BAND_TILES[kernel_name], d: tiles}


def compile_jobs(jobs, seq, dtype_name):
    """In a worker: run each (d, kernel, tiles) once, filling Triton's cache."""
    failures = {}
    for d, kernel_name, tiles in jobs:
        problem = Problem(seq, d, DTYPES[dtype_name], "causal")
        use(kernel_name, d, tiles)
        try:
            problem.call(kernel_name)()
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile is a result
            failures[(d, kernel_name, tiles)] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return failures


def flops(kernel_name, d, seq, window):
    pairs = seq * (seq + 1) // 2 if window is None else window * (window + 1) // 2 + (seq - window) * window
    per_pair = {"_forward_kernel": 4, "_backward_query_kernel": 6, "_backward_key_kernel": 8}[kernel_name]
    return per_pair * d * pairs * BATCH * HEADS


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    jobs = [(d, kernel_name, tiles) for d in args.head_dims for kernel_name, candidates in CANDIDATES.items()
            for tiles in candidates]
    chunks = [jobs[i::args.workers] for i in range(args.workers)]
    failures = {}
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for result in pool.map(compile_jobs, chunks, [args.seq] * len(chunks), [args.dtype] * len(chunks)):
            failures.update(result)
    print(f"compiled {len(jobs)} candidates, {len(failures)} failed", flush=True)

    rows, best = [], {}
    for d in args.head_dims:
        for band, (_, window) in BANDS.items():
            problem = Problem(args.seq, d, DTYPES[args.dtype], band)
            reference = problem.reference()
            for kernel_name, candidates in CANDIDATES.items():
                for tiles in candidates:
                    key = (d, kernel_name, tiles)
                    if key in failures:
                        rows.append([d, band, kernel_name, tuple(tiles), "fails", "", failures[key]])
                        continue
                    use(kernel_name, d, tiles)
                    call = problem.call(kernel_name)
                    got = {"out": problem.out, "dq": problem.dq, "dk": problem.dk, "dv": problem.dv}
                    for name in GRADS[kernel_name]:
                        got[name].fill_(float("nan"))  # every element must be written again
                    call()
                    error = max(((got[n][:1, :1].double() - reference[n]).norm() / reference[n].norm()).item()
                                for n in GRADS[kernel_name])
                    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                    tflops = flops(kernel_name, d, args.seq, window) / ms / 1e9
                    rows.append([d, band, kernel_name, tuple(tiles), f"{ms:.3f}", f"{tflops:.0f}", f"{error:.1e}"])
                    ok = error < 3e-2
                    if ok and ms < best.get((d, band, kernel_name), (float("inf"),))[0]:
                        best[(d, band, kernel_name)] = (ms, tuple(tiles))
                    print(rows[-1], flush=True)
            del problem
    text = tabulate(rows, ["d", "band", "kernel", "tiles (m, n, warps, stages)", "ms", "TFLOP/s", "rel L2"],
                    tablefmt="github")
    text += "\n\nBest:\n\n" + tabulate([[*key, ms, tiles] for key, (ms, tiles) in best.items()],
                                       ["d", "band", "kernel", "ms", "tiles"], tablefmt="github")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune_block_attention.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
