#!/usr/bin/env python3
"""Block-sparse attention for ordinary transformers (issue 7): lowconv's block_attention against
its peers, side by side in one process and run.

batch x heads x seq = 8 x 16 x {1k, 4k, 16k}, head_dim 64 and 128, fp16 and bf16, q, k, v drawn
from N(0, 1), layouts dense, causal and local W = 256, 1024 (local here is the sliding window of
decoders: the query and the W - 1 keys before it, lowconv's "causal_local"), forward (no grad) and
forward+backward (the gradients of q, k, v for a random output gradient). Peers:
  sdpa-flash      torch SDPA, flash backend (dense, is_causal; it takes no mask: no local rows)
  sdpa-efficient  torch SDPA, memory-efficient backend (local: a bool (seq, seq) mask)
  flex            torch.compile'd FlexAttention with the layout's BlockMask (create_block_mask)
  lowconv         lowconv.kernels.block_attention (Triton on CUDA)
Before timing, each peer's output (and, forward+backward, its gradients) on batch 0, head 0 is
checked against block_attention_reference in float64; a peer over the tolerance is marked wrong
and not timed. Then median times (triton.testing.do_bench) and workspace memory, within a time
budget. Writes DIR/bench_block_attention.md and .json, rewritten after every measurement.

    PYTHONPATH=. python3 scripts/bench_block_attention.py --out DIR [--seqs 16384 --layouts causal local-256]
    python3 scripts/bench_block_attention.py --out DIR --device cpu --quick --tiny   # plumbing only
"""
import argparse
import concurrent.futures
import functools
import inspect
import multiprocessing
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from scripts.bench_common import (BudgetedRun, add_rounds_argument, add_run_arguments, first_line,  # noqa: E402
                                  no_grad_call, run_device, run_header, status_cell, write_outputs)
from lowconv.kernels.block_attention import block_attention, block_attention_reference  # noqa: E402
from lowconv.kernels.block_attention_triton import BAND_TILES  # noqa: E402

BATCH, HEADS = 8, 16
SEQS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# name -> (lowconv's layout, window)
LAYOUTS = {"dense": ("dense", None), "causal": ("causal", None),
           "local-256": ("causal_local", 256), "local-1024": ("causal_local", 1024)}
MODES = ("fwd", "fwd+bwd")
PEERS = ("sdpa-flash", "sdpa-efficient", "flex", "lowconv")
TINY = dict(batch=1, heads=2, seqs=(256, 512), windows={"local-256": 64, "local-1024": 128})
# Relative L2 error vs float64 over which a peer is wrong (flash-style kernels land near 1e-3
# in fp16 and 5e-3 in bf16).
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
GRAD_NAMES = ("out", "dq", "dk", "dv")
FLASH_RATIO_TARGET = 1.3  # dense and causal: lowconv within 1.3x of SDPA's flash backend
LOCAL_SPEEDUP_TARGET = 4.0  # local W=256 at 16k vs dense causal SDPA (flash)


class Unsupported(Exception):
    """A peer that cannot run a case: the table says why."""


@dataclass(frozen=True)
class Case:
    seq: int
    head_dim: int
    dtype: str
    layout: str  # a key of LAYOUTS
    window: int | None  # the local layouts' W (smaller with --tiny)

    def label(self):
        return f"L={self.seq} d={self.head_dim} {self.dtype} {self.layout}"


@dataclass
class Result:
    section: str  # the mode: "fwd" | "fwd+bwd"
    case: str
    peer: str
    dims: dict = field(default_factory=dict)
    status: str = "ok"  # ok | fails | skipped | unsupported | wrong
    error: str = ""
    ms: float | None = None  # the median of rounds_ms
    rounds_ms: list = field(default_factory=list)  # each do_bench median, the peers interleaved by round
    workspace_mb: float | None = None
    first_call_s: float | None = None
    rel_l2: dict = field(default_factory=dict)  # output or gradient name -> error vs float64


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, name="bench_block_attention", quick_help="seq 16k only (the targets' rows)",
                      tiny_help=f"batch {TINY['batch']}, heads {TINY['heads']}, seqs {TINY['seqs']}",
                      cpu_help="the torch reference for lowconv", budget_s=420, warmup_ms=25, rep_ms=100)
    parser.add_argument("--seqs", type=int, nargs="+", default=SEQS)
    parser.add_argument("--head-dims", type=int, nargs="+", default=HEAD_DIMS)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=tuple(DTYPES))
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=tuple(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=PEERS)
    add_rounds_argument(parser, "every call (the 1k forward+backward rows are host-bound and move with the host's "
                                "load)")
    args = parser.parse_args()
    if args.quick:
        args.seqs = [max(args.seqs)]
    if args.tiny:
        args.seqs = TINY["seqs"]
    return args


def cases(args):
    """Every case, the largest sequences first (the targets' rows before the budget runs out)."""
    windows = TINY["windows"] if args.tiny else {}
    return [Case(seq, d, dtype, layout, windows.get(layout, LAYOUTS[layout][1]))
            for seq in sorted(args.seqs, reverse=True) for d in args.head_dims for dtype in args.dtypes
            for layout in args.layouts]


def local_keys(seq, window, device):
    """(seq, seq) bool: key j allowed for query i when 0 <= i - j < window."""
    offset = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (offset >= 0) & (offset < window)


def sdpa_peer(backend_name):
    def build(case, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        mask = None
        if case.layout.startswith("local"):
            if backend == SDPBackend.FLASH_ATTENTION:
                raise Unsupported("SDPA's flash backend takes no mask (no sliding window)")
            mask = local_keys(case.seq, case.window, device)
        causal = case.layout == "causal"

        def attention(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return attention
    return build


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    # Dynamic shapes: one compile per dtype, head_dim, mask and grad mode for every seq, not one
    # per shape (compiles count against the budget). Allow them all.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=True)


@functools.cache
def flex_sliding_window(device):
    """flex's one mask_mod, the sliding window, and the window tensor it reads (causal is the
    window W = seq). One function over one tensor is one compile for every masked layout: a
    mask_mod per layout, or a window in a new closure, recompiles flex for each."""
    window = torch.zeros((), dtype=torch.int64, device=device)

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return sliding_window, window


def flex_block_mask(case, device):
    """The case's BlockMask (None for dense). It sets the window tensor, which flex reads when it
    runs: build a case's mask just before timing it."""
    from torch.nn.attention.flex_attention import create_block_mask

    if case.layout == "dense":
        return None
    mask_mod, window = flex_sliding_window(torch.device(device))
    window.fill_(case.window or case.seq)
    compile_mask = "_compile" in inspect.signature(create_block_mask).parameters
    return create_block_mask(mask_mod, None, None, case.seq, case.seq, device=device,
                             **({"_compile": True} if compile_mask else {}))


def flex_peer(case, device):
    block_mask = flex_block_mask(case, device)
    flex = compiled_flex_attention()
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def lowconv_peer(case, device):
    layout, _ = LAYOUTS[case.layout]
    return lambda q, k, v: block_attention(q, k, v, layout=layout, window=case.window)


PEER_BUILDERS = {"sdpa-flash": sdpa_peer("FLASH_ATTENTION"), "sdpa-efficient": sdpa_peer("EFFICIENT_ATTENTION"),
                 "flex": flex_peer, "lowconv": lowconv_peer}


def random_inputs(case, batch, heads, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, case.seq, case.head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=gen, device=device, dtype=DTYPES[case.dtype])
                         for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], grad_out


def reference_slice(case, inputs, grad_out):
    """The float64 output and gradients of batch 0, head 0."""
    q, k, v = (t.detach()[:1, :1].double().requires_grad_() for t in inputs)
    layout, _ = LAYOUTS[case.layout]
    out = block_attention_reference(q, k, v, layout=layout, window=case.window)
    grads = torch.autograd.grad(out, (q, k, v), grad_out[:1, :1].double())
    return dict(zip(GRAD_NAMES, (out.detach(), *grads)))


def rel_l2(x, ref):
    x = x.double()
    return float("nan") if x.isnan().any() else ((x - ref).norm() / ref.norm()).item()


def train_step(attention, inputs, grad_out):
    def run():
        out = attention(*inputs)
        return (out, *torch.autograd.grad(out, inputs, grad_out))
    return run


class Run(BudgetedRun):
    def __init__(self, args, device, header):
        super().__init__(args, device)
        self.header, self.results = header, []

    def write(self, final=False):
        return write_report(self, final)

    def case(self, case, batch, heads, peers):
        inputs, grad_out = random_inputs(case, batch, heads, self.device, self.args.seed)
        reference = None if self.blocked() else reference_slice(case, inputs, grad_out)
        dims = dict(batch=batch, heads=heads, **asdict(case))
        for mode in self.args.modes:
            queued = []
            for peer in peers:
                self.peer(Result(mode, case.label(), peer, dims), case, inputs, grad_out, reference, queued)
            self.interleaved_rounds(queued)

    def peer(self, result, case, inputs, grad_out, reference, queued):
        def work():
            try:
                attention = PEER_BUILDERS[result.peer](case, self.device)
            except Unsupported as why:
                return {"status": "unsupported", "error": str(why)}
            if result.section == "fwd":
                call = no_grad_call(lambda: attention(*inputs))
                got = {"out": call()}
            else:
                call = train_step(attention, inputs, grad_out)
                got = dict(zip(GRAD_NAMES, call()))
            errors = {name: rel_l2(got[name][:1, :1], reference[name]) for name in got}
            del got
            worst = max(errors.values())
            if not worst <= TOLERANCE[DTYPES[case.dtype]]:  # NaN too
                return {"status": "wrong", "rel_l2": errors,
                        "error": f"relative L2 error {worst:.2g} vs float64 (tolerance {TOLERANCE[DTYPES[case.dtype]]:g})"}
            return {"rel_l2": errors, **self.first_round(call, result, queued)}
        self.unit(result, work, result_line)


def result_line(result):
    if result.status != "ok":
        return f"{result.status}: {result.error}"
    errors = ", ".join(f"{name} {error:.1e}" for name, error in result.rel_l2.items())
    return f"{result.ms:.3f} ms, rel L2 {errors}"


def attended_pairs(seq, window):
    """How many (query, key) pairs the layout allows (window None with causal: W = seq)."""
    w = min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def tflops(result):
    """Useful TFLOP/s: 4 d flops per allowed pair forward (q k^T and P V), 2.5 times that more
    for the backward (dq, dk, dv, dP and the recomputed q k^T)."""
    dims = result.dims
    name = dims["layout"]
    pairs = dims["seq"] ** 2 if name == "dense" else attended_pairs(dims["seq"], dims["window"] or dims["seq"])
    flops = 4 * dims["head_dim"] * pairs * dims["batch"] * dims["heads"] * (1 if result.section == "fwd" else 3.5)
    return flops / result.ms / 1e9


def by_key(run):
    return {(r.section, r.case, r.peer): r for r in run.results}


def ms_cell(result, notes):
    if result is not None and result.status in ("unsupported", "wrong"):
        return f"{result.status} [{notes.setdefault(result.error, len(notes) + 1)}]"
    cell = status_cell(result, notes)
    return f"{result.ms:.3f}" if cell is None else cell


def ratio(a, b):
    ok = a is not None and b is not None and a.status == b.status == "ok"
    return a.ms / b.ms if ok else None


def causal_label(case_label):
    """The label of the dense causal case of the same seq, head_dim and dtype."""
    return " ".join(case_label.split()[:3] + ["causal"])


def table(run, mode, notes):
    results = by_key(run)
    labels = list(dict.fromkeys(r.case for r in run.results if r.section == mode))
    rows = []
    for label in labels:
        cells = [results.get((mode, label, peer)) for peer in PEERS]
        ours = results.get((mode, label, "lowconv"))
        flash = results.get((mode, label, "sdpa-flash"))
        causal_flash = results.get((mode, causal_label(label), "sdpa-flash"))
        vs_flash = ratio(ours, flash)
        speedup = ratio(causal_flash, ours) if "local" in label else None
        vs_flex = ratio(ours, results.get((mode, label, "flex")))
        rows.append([label, *(ms_cell(c, notes) for c in cells),
                     f"{vs_flash:.2f}x" if vs_flash else "",
                     f"{speedup:.2f}x" if speedup else "",
                     f"{vs_flex:.2f}x" if vs_flex else "",
                     f"{tflops(ours):.0f}" if ours is not None and ours.status == "ok" else ""])
    headers = ["case", *(f"{p} ms" for p in PEERS), "lowconv / flash", "causal flash / lowconv",
               "lowconv / flex", "lowconv TFLOP/s"]
    return tabulate(rows, headers, tablefmt="github")


def verdicts(run):
    """(target, measured, verdict) for the issue's two targets, over the rows measured."""
    results = by_key(run)
    rows = []
    flash_ratios = [(key[1] + " " + key[0], ratio(r, results.get((key[0], key[1], "sdpa-flash"))))
                    for key, r in results.items() if key[2] == "lowconv"
                    and key[1].split()[-1] in ("dense", "causal")]
    flash_ratios = [(label, x) for label, x in flash_ratios if x is not None]
    if flash_ratios:
        label, worst = max(flash_ratios, key=lambda item: item[1])
        met = sum(x <= FLASH_RATIO_TARGET for _, x in flash_ratios)
        rows.append([f"dense and causal within {FLASH_RATIO_TARGET}x of SDPA flash",
                     f"{met}/{len(flash_ratios)} rows; worst {worst:.2f}x ({label})",
                     "met" if met == len(flash_ratios) else "NOT met"])
    local = [(key, r) for key, r in results.items() if key[2] == "lowconv" and key[1].endswith("local-256")
             and r.dims["seq"] >= 16384]
    for (mode, label, _), ours in local:
        speedup = ratio(results.get((mode, causal_label(label), "sdpa-flash")), ours)
        vs_flex = ratio(ours, results.get((mode, label, "flex")))
        measured = (f"{speedup:.2f}x vs causal flash" if speedup else "causal flash not measured") + \
            (f"; {vs_flex:.2f}x flex's time" if vs_flex else "; flex not measured")
        met = speedup is not None and speedup >= LOCAL_SPEEDUP_TARGET and vs_flex is not None and vs_flex <= 1.0
        rows.append([f"local W=256 {label.rsplit(' ', 1)[0]} {mode}: >= {LOCAL_SPEEDUP_TARGET:g}x dense causal "
                     "SDPA, not slower than flex", measured, "met" if met else "NOT met"])
    return tabulate(rows, ["target", "measured", "verdict"], tablefmt="github") if rows else "(nothing measured)"


def write_report(run, final=False):
    header = {**run.header, "elapsed": f"{run.elapsed():.0f} s" + ("" if final else " (still running)")}
    notes = {}
    parts = ["# Block attention (issue 7)", "", *(f"- {k}: {v}" for k, v in header.items()), ""]
    for mode in MODES:
        if any(r.section == mode for r in run.results):
            parts += [f"## {mode}", "", table(run, mode, notes), ""]
    parts += ["## Targets", "", verdicts(run), ""]
    if notes:
        parts += ["Notes:", "", *(f"[{n}] {text}" for text, n in notes.items()), ""]
    text = "\n".join(parts)
    write_outputs(run.args.out, "bench_block_attention", text,
                  {"header": header, "results": [asdict(r) for r in run.results]})
    return text


def compile_lowconv(d, dtype, layout, seq, heads):
    """In a worker: lowconv's kernels for one (head_dim, dtype, band), forward and backward, at
    shapes that specialize as the timed ones do, into Triton's cache."""
    q, k, v = (torch.randn(2, heads, seq, d, device="cuda", dtype=DTYPES[dtype], requires_grad=True)
               for _ in range(3))
    layout, window = LAYOUTS[layout]
    block_attention(q, k, v, layout=layout, window=window).sum().backward()
    torch.cuda.synchronize()


def precompile_lowconv(args, heads, log):
    """Compile lowconv's kernels for every case in worker processes first: one at a time they
    take minutes of the budget. (Dense and causal are the two compiled variants; local is causal's.)"""
    jobs = {(case.head_dim, case.dtype, "dense" if case.layout == "dense" else "causal", min(args.seqs), heads)
            for case in cases(args)}
    in_workers(compile_lowconv, jobs, 12, log)


def compile_flex(d, dtype, layout, mode, seqs, batch, heads):
    """In a worker: flex for one (head_dim, dtype, masked or not, grad mode) into Inductor's
    caches, which the main process then reads instead of compiling. The worker calls flex at the
    main process's shapes and in its order, so that whatever flex compiles (again for a new seq,
    or once with dynamic shapes) is what the main process will ask for."""
    for seq in sorted(seqs, reverse=True):
        case = Case(seq, d, dtype, layout, None)
        inputs, grad_out = random_inputs(case, batch, heads, torch.device("cuda"), seed=0)
        attention = flex_peer(case, torch.device("cuda"))
        if mode == "fwd":
            with torch.no_grad():
                attention(*inputs)
        else:
            train_step(attention, inputs, grad_out)()
    torch.cuda.synchronize()


def precompile_flex(args, batch, heads, log):
    """Compile flex for every case in worker processes first: one at a time its compiles take
    most of a call's 10 minutes. (Every masked layout shares one compile: flex_sliding_window.)"""
    jobs = {(case.head_dim, case.dtype, "dense" if case.layout == "dense" else "causal", mode,
             tuple(args.seqs), batch, heads) for case in cases(args) for mode in args.modes}
    in_workers(compile_flex, jobs, 14, log)


def in_workers(compile_job, jobs, workers, log):
    """compile_job(*job) for every job in spawned worker processes. A job that fails there (out
    of memory, a crashed worker) is logged, and the timed run compiles it itself."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), workers), mp_context=context) as pool:
        futures = {pool.submit(compile_job, *job): job for job in jobs}
        for future, job in futures.items():
            try:
                future.result()
            except Exception as error:  # whatever a worker met, the timed run goes on
                log(f"{compile_job.__name__}{job} failed in a worker ({first_line(error)}); "
                    "the timed run compiles it")


def main():
    args = parse_args()
    device = run_device(args, "bench_block_attention")
    batch, heads = (TINY["batch"], TINY["heads"]) if args.tiny else (BATCH, HEADS)
    tiles = {name: {d: tuple(t) for d, t in by_dim.items() if d in args.head_dims}
             for name, by_dim in BAND_TILES.items()}
    run = Run(args, device, run_header(args, device, shape=f"batch {batch} x heads {heads}",
                                       band_tiles=tiles))
    if device.type == "cuda" and "lowconv" in args.peers:
        precompile_lowconv(args, heads, run.log)
        run.log("lowconv's kernels compiled")
    if device.type == "cuda" and "flex" in args.peers:
        precompile_flex(args, batch, heads, run.log)
        run.log("flex compiled")
    # Every case without flex first, flex last, the targets' rows (the longest sequences, the local
    # layouts) first: should flex miss the workers' compiles, its own would eat the other peers' budget.
    for case in cases(args):
        run.case(case, batch, heads, [p for p in args.peers if p != "flex"])
    if "flex" in args.peers:
        for case in sorted(cases(args), key=lambda c: (-c.seq, c.layout != "local-256", c.layout != "causal")):
            run.case(case, batch, heads, ["flex"])
    print(run.write(final=True))


if __name__ == "__main__":
    main()
