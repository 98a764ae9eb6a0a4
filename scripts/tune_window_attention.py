#!/usr/bin/env python3
"""Tile sizes of the window-attention kernels, measured: each kernel alone, for each candidate
Tiles (BLOCK_M, BLOCK_N, num_warps), on the dense scene of bench_sparse_attention.py (268,720
voxels, head_dim 16, G = 24), with and without relative position. The fastest per kernel go
into lowconv.kernels.window_attention_triton.tile_config by hand.

Compiling every candidate takes minutes, so worker processes compile them in parallel first
(into Triton's cache, with the same shapes as the timed run); the timing is then one process.
--baseline FILE also times another copy of the module (e.g. the committed one, copied out of the
tree) at its own tile_config, in the same run: the host is noisy, so only peers of one run compare.

    python3 scripts/tune_window_attention.py --out DIR [--heads 1,4] [--dtypes fp16,fp32] [--rel on]
        [--baseline FILE]
"""
import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv.kernels.window_attention_triton as wa  # noqa: E402
from lowconv.kernels.window_attention import pack_coords  # noqa: E402
from scripts.bench_sparse_attention import DTYPES, FULL_POINTS, build_scene, make_inputs  # noqa: E402

KERNELS = {"forward": "_forward_kernel", "backward query": "_backward_query_kernel",
           "backward key": "_backward_key_kernel"}
PLAIN_TILES = [(32, 32, 4), (64, 32, 4), (64, 64, 4), (128, 32, 4), (128, 64, 8), (64, 16, 4)]
# (BLOCK_M, BLOCK_N, num_warps[, maxnreg[, num_stages]]); the key kernel's tile is BLOCK_N keys.
QUERY_TILES = [(32, 16, 4), (32, 16, 4, 168), (32, 16, 4, None, 1), (32, 16, 4, 168, 1), (64, 16, 8, 128),
               (32, 32, 8), (16, 16, 4)]
KEY_TILES = [(16, 32, 4), (16, 32, 4, 168), (16, 32, 4, None, 1), (16, 32, 4, 168, 1), (16, 64, 8, 128),
             (32, 32, 8), (16, 16, 4)]
CANDIDATES = {
    (False, kernel): [wa.Tiles(*t) for t in PLAIN_TILES] for kernel in KERNELS
} | {
    (True, kernel): [wa.Tiles(*t) for t in (KEY_TILES if kernel == "backward key" else QUERY_TILES)]
    for kernel in KERNELS
}
BASELINE = "baseline"  # the module name of --baseline; the jobs of this tree's module say None


def load_baseline(path):
    spec = importlib.util.spec_from_file_location(BASELINE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def jobs(dtypes, rels, baseline):
    """Every (dtype name, rel, kernel name, config, module name) to measure: this tree's module at
    each candidate, the baseline module (if any) at its own tiles."""
    return [(dtype, rel, kernel, config, None) for dtype in dtypes for rel in rels
            for kernel in KERNELS for config in CANDIDATES[rel, kernel]] + [
        (dtype, rel, kernel, baseline.tile_config(getattr(baseline, KERNELS[kernel]), rel), BASELINE)
        for dtype in dtypes for rel in rels for kernel in KERNELS if baseline is not None]


class Problem:
    """The dense scene's inputs at h heads in one dtype, and every buffer the kernels write."""

    def __init__(self, scene, heads, dtype, module):
        self.module = module
        x = make_inputs(scene.n, heads, dtype, torch.device("cuda"), seed=0)
        self.q, self.k, self.v = (t.detach() for t in (x.q, x.k, x.v))
        self.tables = tuple(t.detach() for t in x.tables)
        self.do = x.grad_out
        self.start, self.end = scene.row_windows
        self.coords = pack_coords(scene.coords)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(self.q.shape[:2], dtype=torch.float32, device="cuda")
        self.delta = torch.empty_like(self.lse)
        self.grads = [torch.empty_like(self.q) for _ in range(3)]
        self.table_grads = [torch.zeros(t.shape, dtype=torch.float32, device="cuda")
                            for t in self.tables]

    def call(self, kernel, rel):
        """A function launching `kernel` once on these inputs, with the tile_config in force."""
        tq, tk, tv = self.tables if rel else (None, None, None)
        dtq, dtk, dtv = self.table_grads if rel else (None, None, None)
        dq, dk, dv = self.grads
        launch = self.module.Launch(self.q, tq, self.start, self.end, self.coords if rel else None, 1.0)
        args = {
            "forward": (self.q, self.k, self.v, self.out, self.lse, tq, tk, tv),
            "backward query": (self.q, self.k, self.v, self.out, self.do, self.lse, self.delta, dq,
                               tq, tk, tv, dtq, dtv),
            "backward key": (self.q, self.k, self.v, self.do, self.lse, self.delta, dk, dv,
                             tq, tk, tv, dtk),
        }[kernel]
        return lambda: launch.run(getattr(self.module, KERNELS[kernel]), *args)


def use_config(module, config):
    module.tile_config = lambda kernel, rel, split=False: config


def run_jobs(selected, heads, measure, baseline):
    """Run each job (compile, and time it if `measure`), forward first so lse and delta exist."""
    scene = build_scene("dense", FULL_POINTS, torch.device("cuda"))
    modules = {None: wa, BASELINE: baseline}
    problems = {}
    results = []
    for dtype, rel, kernel, config, name in selected:
        module = modules[name]
        for h in heads:
            key = (dtype, h, name)
            if key not in problems:
                problems[key] = Problem(scene, h, DTYPES[dtype], module)
                use_config(module, module.Tiles(32, 16, 4))
                problems[key].call("forward", True)()
                problems[key].call("backward query", True)()  # writes delta
            use_config(module, config)
            fn = problems[key].call(kernel, rel)
            row = {"dtype": dtype, "h": h, "rel": rel, "kernel": kernel, "config": list(config),
                   "module": name}
            try:
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") if measure else None
                results.append(row | {"ms": ms})
            except Exception as error:  # e.g. out of shared memory: the candidate is out
                results.append(row | {"error": f"{type(error).__name__}: {error}"[:200]})
    return results


def compile_in_parallel(all_jobs, heads, rel, workers, baseline_path):
    """Fill Triton's cache: `workers` processes each compile a share of the jobs (at every h:
    h = 1 compiles apart, Triton specializes integer arguments equal to 1)."""
    dtypes = ",".join(sorted({job[0] for job in all_jobs}))
    extra = ["--baseline", str(baseline_path)] if baseline_path else []
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-part", f"{i}/{workers}",
                               "--heads", heads, "--dtypes", dtypes, "--rel", rel, *extra])
             for i in range(workers)]
    for p in procs:
        p.wait()


def report(results, out):
    rows = []
    def label(r):
        config = tuple(r["config"])
        return f"{r['module']} {config}" if r["module"] else str(config)

    for (dtype, rel, kernel), group in itertools.groupby(
            sorted(results, key=lambda r: (r["dtype"], r["rel"], r["kernel"], r["h"])),
            key=lambda r: (r["dtype"], r["rel"], r["kernel"])):
        group = list(group)
        for h in sorted({r["h"] for r in group}):
            timed = [r for r in group if r["h"] == h and r.get("ms") is not None]
            timed.sort(key=lambda r: r["ms"])
            cells = [f"{label(r)}: {r['ms']:.3f}" for r in timed]
            failed = [label(r) for r in group if r["h"] == h and "error" in r]
            rows.append([dtype, h, "on" if rel else "off", kernel, "; ".join(cells),
                         ", ".join(map(str, failed))])
    text = tabulate(rows, headers=["dtype", "h", "rel pos", "kernel", "ms per config, fastest first",
                                   "failed"], tablefmt="github")
    (out / "tune_window_attention.md").write_text(text + "\n")
    (out / "tune_window_attention.json").write_text(json.dumps(results, indent=1))
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--heads", default="1,4")
    parser.add_argument("--dtypes", default="fp16")
    parser.add_argument("--rel", choices=("off", "on", "both"), default="both",
                        help="candidates without relative position, with it, or both")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--baseline", type=Path, help="another copy of window_attention.py to time")
    parser.add_argument("--compile-part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    heads = [int(h) for h in args.heads.split(",")]
    baseline = load_baseline(args.baseline) if args.baseline else None
    all_jobs = jobs(args.dtypes.split(","), {"off": (False,), "on": (True,), "both": (False, True)}[args.rel],
                    baseline)
    if args.compile_part:
        part, parts = map(int, args.compile_part.split("/"))
        run_jobs(all_jobs[part::parts], heads, measure=False, baseline=baseline)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    compile_in_parallel(all_jobs, args.heads, args.rel, args.workers, args.baseline)
    print(f"compiled in {time.time() - start:.0f} s", flush=True)
    results = run_jobs(all_jobs, heads, measure=True, baseline=baseline)
    print(f"total {time.time() - start:.0f} s")
    report(results, args.out)


if __name__ == "__main__":
    main()
