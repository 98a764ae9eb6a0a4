"""Measuring one call, as the benchmarks in scripts/ do: the median time (triton's do_bench on
CUDA, wall clock on the CPU) and the workspace memory, and the helpers around it."""
import datetime
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing

from lowconv.errors import first_line

CPU_REPS = 3


@dataclass(frozen=True)
class Shape:
    """A GEMM y (m, n) = x (m, k) W^T, named for the report."""
    name: str
    m: int
    k: int
    n: int

    @property
    def dims(self):
        return (self.m, self.k, self.n)

    def label(self):
        return f"{self.name} {self.m}x{self.k}x{self.n}"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, warmup_ms, rep_ms):
    """Median ms and workspace memory (MB, 1e6 bytes: the peak allocated during fn() beyond
    the memory before it and the tensors it returns) of fn(); its first call (compiles,
    autotuning) is timed apart. rounds_ms lists the one round (BudgetedRun.interleaved_rounds
    adds more). On CPU: a median of a few wall-clock calls, no memory."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    first_call_s = time.perf_counter() - start
    if device.type != "cuda":
        times = []
        for _ in range(CPU_REPS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        return {"ms": ms, "rounds_ms": [ms], "workspace_mb": None, "first_call_s": first_call_s}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result_bytes = sum(t.numel() * t.element_size() for t in returned_tensors(fn()))
    torch.cuda.synchronize()
    workspace_mb = (torch.cuda.max_memory_allocated() - base - result_bytes) / 1e6
    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return {"ms": ms, "rounds_ms": [ms], "workspace_mb": workspace_mb, "first_call_s": first_call_s}


def returned_tensors(result):
    """The distinct tensors in fn()'s result (None, an output, or a tuple of them)."""
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    tensors = [t for part in result for t in returned_tensors(part)]
    return list({id(t): t for t in tensors}.values())


def add_run_arguments(parser, *, name, quick_help, tiny_help, cpu_help, budget_s, warmup_ms, rep_ms):
    """The options every benchmark takes: --out, --quick, --tiny, --device, --budget-s, the do_bench
    warmup and rep, --seed."""
    parser.add_argument("--out", required=True, help=f"directory for {name}.md/.json")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--tiny", action="store_true", help=f"{tiny_help} (plumbing test, e.g. with --device cpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help=f"cpu runs {cpu_help} and wall-clock timing, no memory")
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="stop starting measurements after this many seconds since the start, "
                             f"marking the rest 'skipped (time budget)' (default {budget_s:g})")
    parser.add_argument("--warmup-ms", type=float, default=warmup_ms, help=f"do_bench warmup (default {warmup_ms:g})")
    parser.add_argument("--rep-ms", type=float, default=rep_ms, help=f"do_bench rep (default {rep_ms:g})")
    parser.add_argument("--seed", type=int, default=0)


def add_rounds_argument(parser, what):
    """--rounds, for a benchmark that times its peers with BudgetedRun.interleaved_rounds."""
    parser.add_argument("--rounds", type=int, default=3,
                        help=f"{what}: do_bench runs per call, the peers of a case interleaved round by round, "
                             "the median reported (the JSON lists every round; default 3)")


def run_device(args, name) -> torch.device:
    """The device to run on; exits with a hint when CUDA is asked for and absent."""
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{name}: no CUDA device here (torch {torch.__version__}). It times GPU kernels; "
                 "to exercise its plumbing on a CPU run it with --device cpu --quick --tiny.")
    return torch.device(args.device)


def run_header(args, device, **extra) -> dict:
    """What a report says about its run: date, device, versions, command, budget."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, **extra,
        "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
        "budget": f"{getattr(args, 'budget_s', 0):g} s, do_bench warmup {args.warmup_ms:g} ms, rep {args.rep_ms:g} ms",
    }


def kernel_table(call, calls: int = 3, host: bool = False) -> str:
    """The GPU kernels of `calls` calls (after a warm one), by total time, then where the GPU
    waited between them (idle_gaps); with `host`, then the host's own time per op (Python's
    dispatch and launches, collectives' waits), by total."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=120)
    gaps = idle_gaps([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == DeviceType.CUDA], calls)
    if not host:
        return kernels + "\n\n" + gaps
    return (kernels + "\n\n" + gaps + "\n\nHost, by self CPU time:\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=120))


GAP_US = 5.0  # a wait between two kernels shorter than this is launch latency, not counted


def idle_gaps(kernels: list[tuple[float, float, str]], calls: int, top: int = 15) -> str:
    """Where the GPU waited, from its kernels' (start us, end us, name) over `calls` calls: the
    span from the first start to the last end, the time some kernel ran (overlaps counted once),
    the gaps of GAP_US or more summed by the kernel that ended each wait (what the GPU waited
    for: a kernel launched late, the host busy before it), and the longest gaps. Per call."""
    if not kernels:
        return "GPU gaps: no GPU activity recorded"
    kernels = sorted(kernels)
    busy, gaps, end = 0.0, [], kernels[0][0]
    previous = ""
    for start, stop, name in kernels:
        if start - end >= GAP_US:
            gaps.append((start - end, previous, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, name
    span = end - kernels[0][0]
    waited = sum(gap for gap, _, _ in gaps)
    by_next: dict[str, list[float]] = {}
    for gap, _, name in gaps:
        by_next.setdefault(name, []).append(gap)
    lines = [f"GPU gaps, per call: span {span / calls / 1e3:.2f} ms, busy {busy / calls / 1e3:.2f} ms, "
             f"{len(gaps) / calls:.0f} waits of {GAP_US:g} us or more totalling {waited / calls / 1e3:.2f} ms",
             "", "waits before each kernel, by total (count and ms per call):"]
    for name, waits in sorted(by_next.items(), key=lambda item: -sum(item[1]))[:top]:
        lines.append(f"  {sum(waits) / calls / 1e3:8.3f} ms  {len(waits) / calls:6.1f}  {name[:110]}")
    lines += ["", f"the {top} longest waits (us: after -> before):"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:9.1f}  {before[:60]} -> {after[:60]}")
    return "\n".join(lines)


def cuda_context_error(device) -> str | None:
    """After a failure: None if CUDA still works, else the first line of what it says."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as error:  # noqa: BLE001 - any error here means the context is gone
        return first_line(error)
    return None


def write_outputs(out, name, text, data) -> None:
    """OUT/name.md (the report) and OUT/name.json (its data)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))


class BudgetedRun:
    """A benchmark run's clock, time budget (args.budget_s) and CUDA health: once a failure has
    taken the CUDA context down, or the budget is spent, nothing more is run."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.start = time.perf_counter()
        self.context_lost = None  # first line of the error after which CUDA stopped working

    def elapsed(self):
        return time.perf_counter() - self.start

    def log(self, text):
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def blocked(self):
        """Why nothing more is run, or None."""
        if self.context_lost:
            return f"CUDA context lost ({self.context_lost})"
        if self.elapsed() > self.args.budget_s:
            return "time budget"
        return None

    def failed(self, error):
        """The failure's message; find out whether CUDA still works after it."""
        self.context_lost = self.context_lost or cuda_context_error(self.device)
        return first_line(error)

    def unit(self, result, work, describe):
        """Fill `result` (a dataclass with status and error) from work(), a dict of its fields,
        unless the run is blocked; append it to self.results, log describe(result), rewrite the
        report (self.write())."""
        blocked = self.blocked()
        if blocked:
            result.status, result.error = "skipped", blocked
        else:
            try:
                for name, value in work().items():
                    setattr(result, name, value)
            except Exception as error:  # noqa: BLE001 - a peer's failure is a result
                result.status, result.error = "fails", self.failed(error)
        self.results.append(result)
        self.log(f"{result.section} {result.case} {result.peer}: {describe(result)}")
        self.write()

    def first_round(self, call, result, queued):
        """measure(call), with (result, call) queued for interleaved_rounds' later rounds."""
        measured = measure(call, self.device, self.args.warmup_ms, self.args.rep_ms)
        queued.append((result, call))
        return measured

    def interleaved_rounds(self, queued):
        """Rounds 2..args.rounds of some peers' timed calls (a list of (result, call), each result
        measured once), the peers interleaved round by round, so that drifts of clocks, power and
        the host's load hit them alike; each result's ms becomes the median of its rounds_ms. Each of
        these rounds takes the peers in its own shuffled order (seeded by the round; round 1, taken
        by first_round beside each peer's checks, keeps the peers' order): in a fixed order each
        peer always followed the same neighbour (two identical calls, fp16acc's auto and S = 32 at
        4096^3, read 1.14x and 1.04x cuBLAS in one such run on the H100). A call that fails in a later round marks
        its result failed and leaves the rounds."""
        for round_index in range(1, self.args.rounds):
            for result, call in random.Random(round_index).sample(queued, len(queued)):
                if self.blocked():
                    break
                try:
                    result.rounds_ms.append(measure(call, self.device, self.args.warmup_ms, self.args.rep_ms)["ms"])
                except Exception as error:  # noqa: BLE001 - a peer's failure is a result
                    result.status, result.error = "fails", self.failed(error)
                    queued.remove((result, call))
        for result, _ in queued:
            result.ms = statistics.median(result.rounds_ms)
        if queued:
            self.write()


def interleaved_ms(timed: dict, device, rounds: int, warmup_ms: float, rep_ms: float) -> dict:
    """{key: the ms of each round, or None where a round ran out of memory} of each call of `timed`,
    the calls interleaved round by round, each round in its own shuffled order (seeded by the round),
    so that drifts of clocks and power hit them alike (BudgetedRun.interleaved_rounds says why)."""
    results = {key: [] for key in timed}
    for round_index in range(rounds):
        for key in random.Random(round_index).sample(list(timed), len(timed)):
            if results[key] is None:
                continue
            try:
                results[key].append(measure(timed[key], device, warmup_ms, rep_ms)["ms"])
            except torch.OutOfMemoryError:
                results[key] = None
                torch.cuda.empty_cache()
    return results


def host_ms(fn, calls):
    """Wall-clock ms per call of `calls` back-to-back calls of fn (after one warm call), with no
    sync between them: the host's side of a call, when the GPU queue keeps up."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return elapsed


def no_grad_call(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def train_call(layer, weight, x, grad_out):
    """Forward and the gradients of (out * grad_out).sum() for x and the weight."""
    x = x.detach().requires_grad_()

    def run():
        out = layer(x)
        return (out, *torch.autograd.grad(out, (x, weight), grad_out))
    return run


def status_cell(result, notes):
    """'' when not planned; the failure note or the skip reason when not ok; None when ok."""
    if result is None:
        return ""
    if result.status == "fails":
        return f"fails [{notes.setdefault(result.error, len(notes) + 1)}]"
    if result.status == "skipped":
        return f"skipped ({result.error})"
    return None
