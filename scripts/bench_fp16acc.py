#!/usr/bin/env python3
"""fp16-accumulation GEMMs with split-K error control (issue 6): lowconv's fp16acc kernel against
cuBLAS, error and time side by side, in one run.

y = x W^T (no bias), fp16 x (M, K) and W (N, K), both N(0, 1), fixed seed, at gpu_poor's decode
shape (M=1, N=4096, K=14336) and the squares 1024, 2048, 4096, 8192. Peers, per shape:
  cuBLAS fp32-acc        F.linear (cuBLAS fp16 GEMM, fp32 accumulation: the baseline)
  cuBLAS fp16-acc        F.linear with torch.backends.cuda.matmul.allow_fp16_accumulation on
  lowconv auto           lowconv.kernels.fp16acc's kernel (on the H100 the Gluon wgmma kernel where the output
                         has a 128 x 256 tile per SM, else the Triton kernel), splits = auto_splits(K, M), fp32 combine
  lowconv S=1 .. S=32    the same with S chunks of K, each its own fp16 accumulator
  lowconv auto, fp16 combine   gpu_poor v0.2's combine
  lowconv cublas auto    the op's backend = "cublas": one cuBLAS fp16-acc matmul per chunk
Error vs float64 (computed on the device from the same fp16 inputs): the relative error
||y - exact|| / ||exact|| (the bar the targets use, as in the anchors), and the median and max
over output elements of |y - exact| / rms(exact) (relative to the output's scale: dividing by
each |exact| would make the max a measure of cancellation, not of accumulation).
CPU emulation: lowconv's torch reference, run on the CPU on the first EMULATED_ROWS rows of x,
against the GPU kernel's error on the same rows (the issue: within 2x).
Times are medians of --rounds do_bench medians (L2 flushed between calls), the peers of a shape
interleaved round by round, so that drifts of the clocks and of the host hit them alike; all after
the first call (compile, autotuning), which is timed apart. The autotuner's pick is recorded per
result.
Writes DIR/bench_fp16acc.md and .json, rewritten after every measurement, so a run cut short still
leaves its results; measurements past --budget-s are marked "skipped (time budget)".

    PYTHONPATH=. python3 scripts/bench_fp16acc.py --out DIR [--quick] [--budget-s 200] [--rounds 3]
    python3 scripts/bench_fp16acc.py --out DIR --device cpu --quick --tiny   # plumbing only
"""
import argparse
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv.kernels.fp16acc as fa  # noqa: E402
import lowconv.kernels.fp16acc_triton as ft  # noqa: E402
import lowconv.kernels.fp16acc_wgmma as fw  # noqa: E402
from lowconv.kernels.fp16acc import auto_splits, cublas_fp16_accumulation, fp16acc_matmul  # noqa: E402
from scripts.bench_common import (BudgetedRun, Shape, add_rounds_argument, add_run_arguments,  # noqa: E402
                                  run_device, run_header, status_cell, write_outputs)


# The targets' shapes first, so a run cut short by its budget still decides them.
SHAPES = [Shape("square", 4096, 4096, 4096), Shape("square", 8192, 8192, 8192),
          Shape("gpu_poor decode", 1, 14336, 4096), Shape("square", 1024, 1024, 1024),
          Shape("square", 2048, 2048, 2048)]
QUICK_SHAPES = SHAPES[:3]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
EMULATED_ROWS = 16
TINY_DIVISOR = 16  # --tiny divides every size but M = 1 by this
BASELINE, FP16_CUBLAS, AUTO = "cuBLAS fp32-acc", "cuBLAS fp16-acc", "lowconv auto"
SPEED_TARGET_SHAPES, SPEED_TARGET = ((4096, 4096, 4096), (8192, 8192, 8192)), 1.1
DECODE_TARGET = 1.2
ERROR_TARGET = 0.25  # lowconv auto's relative error over cuBLAS fp16-acc's
EMULATION_TARGET = 2.0


@dataclass(frozen=True)
class Peer:
    name: str
    splits: int | str | None = None  # None: plain cuBLAS; "auto": auto_splits(K)
    combine: str = "fp32"
    backend: str = "triton"  # lowconv's backend; for plain cuBLAS, whether fp16 accumulation is on
    fp16_accumulation: bool = False

    @property
    def lowconv(self):
        return self.splits is not None

    @property
    def emulated(self):
        """The CPU reference emulates lowconv's kernel (not cuBLAS's internals)."""
        return self.lowconv and self.backend == "triton"


PEERS = [Peer(BASELINE), Peer(FP16_CUBLAS, fp16_accumulation=True), Peer(AUTO, "auto"),
         *(Peer(f"lowconv S={s}", s) for s in SPLITS),
         Peer("lowconv auto, fp16 combine", "auto", combine="fp16"),
         Peer("lowconv cublas auto", "auto", backend="cublas")]


@dataclass
class Result:
    shape: str
    dims: tuple
    peer: str
    splits: int | None = None  # the S run (auto resolved)
    status: str = "ok"  # ok | fails | skipped
    error: str = ""
    rel_error: float | None = None  # ||y - exact|| / ||exact||
    median_error: float | None = None  # median of |y - exact| / rms(exact)
    max_error: float | None = None
    emulated_rel_error: float | None = None  # the CPU reference on the first EMULATED_ROWS rows
    kernel_rows_rel_error: float | None = None  # the kernel on the same rows
    ms: float | None = None  # the median of rounds_ms
    rounds_ms: list = field(default_factory=list)  # each do_bench median, the peers interleaved by round
    workspace_mb: float | None = None
    first_call_s: float | None = None
    config: str = ""  # the autotuner's pick
    config_ms: dict = field(default_factory=dict)  # every config's median from the last tuning


def size(d, tiny):
    return max(16, d // TINY_DIVISOR) if tiny and d > 1 else d


def scaled(shape, tiny):
    return Shape(shape.name, *(size(d, tiny) for d in shape.dims))


def random_operands(shape, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.m, shape.k, generator=gen, device=device).half()
    w = torch.randn(shape.n, shape.k, generator=gen, device=device).half()
    return x, w


def errors(y, exact):
    """(relative error, median and max of |y - exact| / rms(exact)); NaN anywhere gives NaN."""
    diff = (y.double() - exact).abs()
    rms = exact.pow(2).mean().sqrt()
    elementwise = (diff / rms).flatten()
    return ((diff.norm() / exact.norm()).item(), elementwise.median().item(), elementwise.max().item())


def rel_error(y, exact):
    return ((y.double() - exact).norm() / exact.norm()).item()


def peer_call(peer, x, w, device):
    """The peer's forward as a no-argument call (cuBLAS fp16-acc's switches the flag on inside
    each call: a few microseconds of host time on a GPU-bound call)."""
    if peer.fp16_accumulation:
        def linear_with_fp16_accumulation():
            with cublas_fp16_accumulation():
                return F.linear(x, w)
        return linear_with_fp16_accumulation
    if not peer.lowconv:
        return lambda: F.linear(x, w)
    splits = auto_splits(x.shape[1], x.shape[0], peer.combine) if peer.splits == "auto" else peer.splits
    backend = peer.backend if device.type == "cuda" else "reference"
    return lambda: fp16acc_matmul(x, w, None, splits, peer.combine, backend)


def kernel_pick(x, w):
    """Which kernel ran y = x w^T (the wgmma kernel's fixed tiles, or the Triton kernel's autotuner
    pick), and every config's median time from the autotuner's last tuning."""
    if x.shape[0] > ft.SMALL_M and ft.wgmma_runs(x, w, ft.multiprocessors(x.device)):
        return f"wgmma {fw.BLOCK_M}x{fw.BLOCK_N}, a ring of {fw.RING_K} k-columns", {}
    return tuning(ft._tuned_for_large_m if x.shape[0] > ft.SMALL_M else ft._tuned_for_small_m)


def tuning(tuner):
    """The autotuner's last pick and every config's median time from its last tuning."""
    best = getattr(tuner, "best_config", None)
    timings = getattr(tuner, "configs_timings", None) or {}
    return str(best or ""), {str(config): ms[0] if isinstance(ms, list) else ms for config, ms in timings.items()}


class Run(BudgetedRun):
    def __init__(self, args, device, header, shapes):
        super().__init__(args, device)
        self.header, self.shapes = header, shapes
        self.results: list[Result] = []

    def log(self, message):
        print(f"[{self.elapsed():6.1f} s] {message}", file=sys.stderr, flush=True)

    def shape(self, shape):
        x, w = random_operands(shape, self.device, self.args.seed)
        exact = None if self.blocked() else x.double() @ w.double().t()
        rows = min(EMULATED_ROWS, shape.m)
        exact_rows_cpu = None if exact is None else exact[:rows].cpu()
        queued = []  # the timed calls, for interleaved_rounds
        for peer in PEERS:
            result = Result(shape.label(), shape.dims, peer.name,
                            auto_splits(shape.k, shape.m, peer.combine) if peer.splits == "auto" else peer.splits)
            blocked = self.blocked()
            if blocked:
                result.status, result.error = "skipped", blocked
            elif peer.backend == "cublas" and self.device.type != "cuda":
                result.status, result.error = "skipped", "needs CUDA"
            else:
                try:
                    self.measure(result, peer, x, w, exact, exact_rows_cpu, queued)
                except Exception as error:  # noqa: BLE001 - a peer's failure is a result
                    result.status, result.error = "fails", self.failed(error)
            self.results.append(result)
            self.log(f"{result.shape} {result.peer}: {result_line(result)}")
            self.write()
        self.interleaved_rounds(queued)

    def measure(self, result, peer, x, w, exact, exact_rows_cpu, queued):
        call = peer_call(peer, x, w, self.device)
        start = time.perf_counter()
        y = call()  # compiles and autotunes lowconv's kernel for this shape
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        first_call_s = time.perf_counter() - start
        result.rel_error, result.median_error, result.max_error = errors(y, exact)
        if peer.emulated:
            rows = exact_rows_cpu.shape[0]
            emulated = fa.fp16acc_matmul_reference(x[:rows].cpu(), w.cpu(), None, result.splits, peer.combine)
            result.emulated_rel_error = rel_error(emulated, exact_rows_cpu)
            result.kernel_rows_rel_error = rel_error(y[:rows].cpu(), exact_rows_cpu)
        del y
        timed = self.first_round(call, result, queued)
        result.ms, result.rounds_ms, result.workspace_mb = timed["ms"], timed["rounds_ms"], timed["workspace_mb"]
        result.first_call_s = first_call_s
        if peer.lowconv and peer.backend == "triton" and self.device.type == "cuda":
            result.config, result.config_ms = kernel_pick(x, w)

    def write(self, final=False):
        header = {**self.header, "elapsed": f"{self.elapsed():.0f} s" + ("" if final else " (still running)")}
        text = markdown_report(self, header)
        write_outputs(self.args.out, "bench_fp16acc", text, {
            "header": header, "shapes": [asdict(s) for s in self.shapes], "splits": list(SPLITS),
            "emulated_rows": EMULATED_ROWS, "results": [asdict(r) for r in self.results]})
        return text


def result_line(result):
    if result.status != "ok":
        return f"{result.status}: {result.error}"
    line = f"{format_ms(result.ms)}, rel. error {result.rel_error:.2e}"
    if result.emulated_rel_error is not None:
        line += f", CPU emulation {result.emulated_rel_error:.2e} vs kernel {result.kernel_rows_rel_error:.2e}"
    return line + (f", {result.config}" if result.config else "")


def format_ms(ms):
    return f"{ms:.3g} ms"


def find(run, dims, peer):
    return next((r for r in run.results if r.dims == dims and r.peer == peer), None)


def both_ok(*results):
    return all(r is not None and r.status == "ok" for r in results)


def speed_verdict(run, dims, bound):
    label = "M=1 decode " if dims[0] == 1 else ""
    target = f"{label}{'x'.join(map(str, dims))}: lowconv auto time <= {bound}x cuBLAS fp32-acc"
    ours, baseline = find(run, dims, AUTO), find(run, dims, BASELINE)
    if not both_ok(ours, baseline):
        return target, "", "not measured"
    ratio = ours.ms / baseline.ms
    measured = f"{format_ms(ours.ms)} vs {format_ms(baseline.ms)}: {ratio:.2f}x"
    return target, measured, "met" if ratio <= bound else "NOT met"


def error_verdict(run, shape):
    target = f"{'x'.join(map(str, shape.dims))}: lowconv auto rel. error <= {ERROR_TARGET:g}x cuBLAS fp16-acc's"
    ours, cublas16 = find(run, shape.dims, AUTO), find(run, shape.dims, FP16_CUBLAS)
    if not both_ok(ours, cublas16):
        return target, "", "not measured"
    ratio = ours.rel_error / cublas16.rel_error
    measured = f"{ours.rel_error:.2e} vs {cublas16.rel_error:.2e}: {ratio:.2f}x"
    return target, measured, "met" if ratio <= ERROR_TARGET else "NOT met"


def emulation_verdict(run):
    target = f"CPU emulation's error within {EMULATION_TARGET:g}x of the GPU kernel's (every lowconv Triton result)"
    ratios = [r.emulated_rel_error / r.kernel_rows_rel_error for r in run.results
              if r.status == "ok" and r.emulated_rel_error is not None]
    if not ratios:
        return target, "", "not measured"
    measured = f"CPU / GPU from {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} results"
    inside = all(1 / EMULATION_TARGET <= ratio <= EMULATION_TARGET for ratio in ratios)
    return target, measured, "met" if inside else "NOT met"


def verdicts(run):
    shapes = {s.dims: s for s in run.shapes}
    rows = [speed_verdict(run, dims, SPEED_TARGET) for dims in SPEED_TARGET_SHAPES if dims in shapes]
    rows += [speed_verdict(run, s.dims, DECODE_TARGET) for s in run.shapes if s.m == 1]
    rows += [error_verdict(run, s) for s in run.shapes]
    return rows + [emulation_verdict(run)]


def cell(result, notes, value):
    """value(result) for an ok result; otherwise its status (failures numbered in notes)."""
    status = status_cell(result, notes)
    return value(result) if status is None else status


def table(run, notes, value):
    headers = ["peer (S)"] + [s.label() for s in run.shapes]
    rows = []
    for peer in PEERS:
        results = [find(run, s.dims, peer.name) for s in run.shapes]
        splits = sorted({r.splits for r in results if r is not None and peer.splits == "auto"})
        name = peer.name + (f" ({', '.join(map(str, splits))})" if splits else "")
        rows.append([name] + [cell(r, notes, value) for r in results])
    return tabulate(rows, headers=headers, tablefmt="github")


def markdown_report(run, header):
    notes = {}
    baselines = {s.dims: find(run, s.dims, BASELINE) for s in run.shapes}

    def timed(r):
        baseline = baselines[r.dims]
        if r.peer == BASELINE or not both_ok(baseline):
            return format_ms(r.ms)
        return f"{format_ms(r.ms)} ({r.ms / baseline.ms:.2f}x)"

    def emulated(r):
        if r.emulated_rel_error is None:
            return "-"
        return f"{r.emulated_rel_error:.2e} / {r.kernel_rows_rel_error:.2e} " \
               f"({r.emulated_rel_error / r.kernel_rows_rel_error:.2f})"

    lines = ["# fp16 accumulation with split-K error control (issue 6): lowconv vs cuBLAS", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    lines += ["", "## Targets (issue 6)", "",
              tabulate([[f"[{'x' if v == 'met' else ' '}] {t}", m, v] for t, m, v in verdicts(run)],
                       headers=["target", "measured", "verdict"], tablefmt="github"), ""]
    if run.args.tiny or run.device.type != "cuda":
        lines += ["The targets are H100 numbers at the issue's shapes; this run tests the plumbing only "
                  "(lowconv runs its CPU reference, cuBLAS fp16-acc is torch's CPU matmul).", ""]
    lines += ["## Relative error vs float64 (||y - exact|| / ||exact||)", "",
              "x and W N(0, 1) fp16, no bias; the exact product in float64 from the same fp16 inputs. "
              "S: chunks of K, each summed in its own fp16 accumulator; auto = auto_splits(K, M) (in "
              "parentheses, per shape); combine fp32 unless named.", "",
              table(run, notes, lambda r: f"{r.rel_error:.2e}"), "",
              "## Median / max over output elements of |y - exact| / rms(exact)", "",
              table(run, notes, lambda r: f"{r.median_error:.1e} / {r.max_error:.1e}"), "",
              "## Time (median; in parentheses: over cuBLAS fp32-acc)", "",
              table(run, notes, timed), "",
              f"## CPU emulation vs GPU kernel: rel. error on the first {EMULATED_ROWS} rows "
              "(CPU reference / kernel (ratio))", "",
              table(run, notes, emulated), ""]
    picks = [(r.shape, r.peer, r.config) for r in run.results if r.config]
    if picks:
        lines += ["## Autotuner picks (every config's time is in the json)", "",
                  tabulate(picks, headers=["shape", "peer", "config"], tablefmt="github"), ""]
    if notes:
        lines += ["Failures:", ""] + [f"[{n}] {message}" for message, n in notes.items()] + [""]
    return "\n".join(lines)


def parse_args():
    parser = argparse.ArgumentParser(description="Error and time of fp16-accumulating GEMMs (issue 6): lowconv's "
                                     "split-K fp16acc kernel for S = 1..32 and auto, beside cuBLAS fp32-acc and "
                                     "fp16-acc, in one run.")
    add_run_arguments(parser, name="bench_fp16acc", quick_help="the target shapes only (4096^3, 8192^3, decode)",
                      tiny_help=f"every size but M = 1 divided by {TINY_DIVISOR}",
                      cpu_help="lowconv's CPU reference and torch's CPU matmul", budget_s=200.0,
                      warmup_ms=10.0, rep_ms=50.0)
    add_rounds_argument(parser, "time")
    return parser.parse_args()


def main():
    args = parse_args()
    device = run_device(args, "bench_fp16acc")
    shapes = [scaled(s, args.tiny) for s in (QUICK_SHAPES if args.quick else SHAPES)]
    run = Run(args, device, run_header(args, device), shapes)
    for shape in shapes:
        run.shape(shape)
    print(run.write(final=True))


if __name__ == "__main__":
    main()
