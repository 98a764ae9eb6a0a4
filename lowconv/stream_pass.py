"""A streamed conversion's pass over the model: its runs in lockstep, module by module; the
calibration of static scales, and the report: each converted site and the outputs measured.

The model, its parameters stand-ins, runs on several inputs at once, each run in a thread of its
own and one thread at a time (Lockstep): a run stops before each module that owns parameters until
every run has reached it; then the module's parameters are read from the input checkpoint (and
handed to the stream, which writes the tensors it keeps), each run in turn goes through the module,
and the parameters are dropped once no run is inside it. So the weights are read once whatever the
number of runs, and memory holds the weights of the module running (and of those around it) plus
each run's activations.

The runs: one per calibration batch where a converted site's scales are calibrated (static or
delayed FP8), then the original's and the converted model's on the example inputs. A calibration
run is the converted model's: at each converted site its op module's output replaces the
original's, the op calibrating where it calibrates, as lowconv.convert runs the calibration
through the converted model. The original's run: at each converted site, once every calibration
run has passed it, the op module is finished (its scales set), handed to the stream to write, and
run on that module's inputs (the site alone). The converted model's run, last through each
module, runs the finished op in the site's place. So the report has compare.compare's numbers:
each site alone and in the converted model, and the outputs, with the recipe's gates; not timed.
Where fuse_activation moves an activation into a layer's quantizer, the converted run computes it
before the layer, as the original does (the same numbers on the CPU; on CUDA within rounding).

Not measured: sites that are no module's whole forward. A model whose code computes with a
parameter outside the module that owns it stops at that read; the report then says so rather
than run on stand-ins (and a calibration stops the conversion there).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from lowconv import report as reports
from lowconv.compare import check_no_nan, first_tensor, paired_outputs, worst_call
from lowconv.errors import LowconvError
from lowconv.inputs import normalize_inputs, run_eval
from lowconv.ops.registry import Calibrated, ReportsStats
from lowconv.plan import Plan
from lowconv.site import Site

SCOPE = ("streamed: the model run module by module, the converted model with each converted site's op in its "
         "module's place (an activation fused into a layer computed before it); not timed")
FAILED_SCOPE = "streamed, and the model does not run module by module: the sites and the outputs were not measured"
Reader = Callable[[str], torch.Tensor]


class ReadOutsideItsModule(RuntimeError):
    """A computation with an unloaded parameter: its module is not running."""


class Unloaded(torch.Tensor):
    """A parameter's stand-in whose values are asked for while its module is not running: its
    shape, dtype and device answer (model code reads them anywhere), any computation raises. (A
    meta tensor would not do: F.linear of a CPU x and a meta weight returns a CPU tensor.)"""
    METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__,
                torch.Tensor.size, torch.Tensor.dim, torch.Tensor.is_floating_point}
    parameter: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        names = sorted({a.parameter for a in (*args, *(kwargs or {}).values()) if isinstance(a, Unloaded)})
        raise ReadOutsideItsModule(f"{getattr(func, '__name__', func)} computed with {', '.join(names) or 'a parameter'} "
                                   f"while the module that owns it was not running")


def unloaded(stand_in: torch.Tensor, name: str) -> Unloaded:
    tensor = torch.Tensor._make_subclass(Unloaded, stand_in.detach())
    tensor.parameter = name
    return tensor


class Stopped(BaseException):
    """Ends a run's thread from inside the model: another run failed, or the pass was interrupted."""


class Diverged(LowconvError):
    """The runs went different ways through the model's modules."""


DONE = "done"  # where a finished run waits


class Lockstep:
    """`model`, within `with`, with each parameter unloaded except while a run is inside the module
    that owns it: runs(...) runs its callables in lockstep over those modules (module doc). A module
    is loaded with original(name) for each parameter, and on_load(its stand-in, the tensor) called.
    The stand-ins are back afterwards."""

    def __init__(self, model: nn.Module, original: Reader, on_load: Callable[[torch.Tensor, torch.Tensor], None]):
        self.model, self.original, self.on_load = model, original, on_load
        self.live: dict[str, torch.Tensor] = {}  # the parameters of the modules loaded now, by name
        self.held: dict[nn.Module, tuple[str, dict]] = {}  # module -> (its name's prefix, its stand-ins)
        self.loaded: set[nn.Module] = set()
        self.inside: Counter[nn.Module] = Counter()  # module -> the runs inside it now
        self.handles = []
        self.turn: int | None = None  # the run whose thread may go on (None: the scheduler's)
        self.waiting: dict[int, nn.Module | str] = {}  # run -> the module it waits before, or DONE
        self.stopping = False
        self.changed = threading.Condition()
        self.local = threading.local()  # .run: the index of the run this thread runs

    def read(self, name: str) -> torch.Tensor:
        """A parameter as the model holds it: the loaded module's, without a second read."""
        return self.live[name] if name in self.live else self.original(name)

    def current(self) -> int:
        """The index of the run calling (in runs(...)'s order)."""
        return self.local.run

    def __enter__(self) -> Lockstep:
        for fqn, module in self.model.named_modules():
            if any(p is not None for p in module._parameters.values()):
                self.held[module] = (f"{fqn}." if fqn else "", dict(module._parameters))
                self.unload(module)
                self.handles += [module.register_forward_pre_hook(self.arrive),
                                 module.register_forward_hook(self.leave)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        for module, (_, stand_ins) in self.held.items():
            module._parameters.update(stand_ins)
        self.live.clear()

    def load(self, module: nn.Module) -> None:
        if module in self.loaded:
            return
        prefix, stand_ins = self.held[module]
        for name, stand_in in stand_ins.items():
            if stand_in is not None:
                tensor = self.live[prefix + name] = self.original(prefix + name)
                module._parameters[name] = tensor
                self.on_load(stand_in, tensor)
        self.loaded.add(module)

    def unload(self, module: nn.Module) -> None:
        prefix, stand_ins = self.held[module]
        for name, stand_in in stand_ins.items():
            if stand_in is not None:
                module._parameters[name] = unloaded(stand_in, prefix + name)
                self.live.pop(prefix + name, None)
        self.loaded.discard(module)

    def arrive(self, module: nn.Module, args) -> None:
        """Before a module: wait until the scheduler has loaded it and it is this run's turn."""
        run = self.current()
        with self.changed:
            self.waiting[run] = module
            self.turn = None
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.turn == run)
            if self.stopping:
                raise Stopped
        self.inside[module] += 1

    def leave(self, module: nn.Module, args, output) -> None:
        self.inside[module] -= 1

    def give_turn(self, run: int) -> None:
        """Let `run` go on until it waits before the next module or finishes."""
        with self.changed:
            self.turn = run
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.turn is None)

    def runs(self, runs: dict[str, Callable[[], object]]) -> None:
        """Call each of `runs` (by name: for messages) in a thread of its own, in lockstep. The first
        error of a run is raised once every thread has ended; runs that go different ways through
        the modules raise Diverged."""
        names, errors = list(runs), {}

        def thread(run: int) -> None:
            self.local.run = run
            with self.changed:
                self.changed.wait_for(lambda: self.turn == run)
            try:
                if not self.stopping:
                    runs[names[run]]()
            except Stopped:
                pass
            except BaseException as err:  # noqa: B036 (an interruption too: the scheduler raises it)
                errors[run] = err
            finally:
                with self.changed:
                    self.waiting[run] = DONE
                    self.turn = None
                    self.changed.notify_all()

        threads = [threading.Thread(target=thread, args=(run,), name=f"lowconv-run-{run}", daemon=True)
                   for run in range(len(names))]
        for t in threads:
            t.start()
        try:
            going = list(range(len(names)))
            while going:
                for run in going:
                    self.give_turn(run)
                    if run in errors:
                        raise errors[run]
                for module in [m for m in self.loaded if self.inside[m] <= 0]:
                    self.unload(module)
                going = [run for run in going if self.waiting[run] is not DONE]
                if going:
                    self.load(self.next_module(names, going))
        finally:
            with self.changed:  # an interruption may have come while a run was going on
                self.changed.wait_for(lambda: self.turn is None)
            self.stopping = True
            while any(self.waiting.get(run) is not DONE for run in range(len(names))):
                for run in range(len(names)):
                    if self.waiting.get(run) is not DONE:
                        self.give_turn(run)
            for t in threads:
                t.join()
            self.stopping = False
            for module in list(self.loaded):
                self.unload(module)
            self.inside.clear()

    def next_module(self, names: list[str], going: list[int]) -> nn.Module:
        """The module every run waits before: the next one to load."""
        at = {self.waiting[run] for run in going}
        if len(at) == 1 and len(going) == len(names):
            return at.pop()
        where = {names[run]: "finished" if self.waiting[run] is DONE else f"waits before {self.name(self.waiting[run])}"
                 for run in range(len(names))}
        raise Diverged("--stream runs the model on its calibration batches and its example inputs (the original "
                       "and the converted model) together, module by module, and they went different ways through "
                       "it: " +
                       "; ".join(f"{name} {state}" for name, state in where.items()) +
                       "; convert without --stream (in memory)")

    def name(self, module: nn.Module) -> str:
        return self.held[module][0].rstrip(".") or "the model itself"


def streamed_pass(model: nn.Module, plan: Plan, sites: dict[str, Site], inputs, original: Reader,
                  build: Callable[[Site, Reader], nn.Module], keep: Callable[[Site, nn.Module], None],
                  on_load: Callable[[torch.Tensor, torch.Tensor], None], calibration: list | None = None,
                  logits: bool | None = None) -> reports.Report:
    """Run `model` on the calibration batches, the original and the converted model on `inputs`,
    in lockstep (module doc); `build(site, read)` gives a converted site's op module from the
    weights read(name) gives, and keep(site, op module) takes it once it is finished (calibrated).
    The report, as compare.compare's: each converted site alone and in the converted model, and
    the outputs (`logits` as compare takes it)."""
    decisions = {d.fqn: d for d in plan.converted()}
    modules = {fqn: site_module(model, sites[fqn]) for fqn in decisions}
    batches = list(calibration or [])
    example, converted = len(batches), len(batches) + 1  # the runs' indices
    runs = {f"calibration batch {i}": batch for i, batch in enumerate(batches, 1)} | \
        {"the example inputs": inputs, "the converted model on the example inputs": inputs}
    outputs: dict[int, object] = {}
    calls: dict[str, SiteCalls] = {}
    ops: dict[str, nn.Module] = {}  # a site's op module, from the first run through it to the converted one
    finished: set[str] = set()  # sites whose scales were calibrated
    failed = ""
    with Lockstep(model, original, on_load) as lockstep:
        def at_site(module, args, kwargs, output, site):
            run = lockstep.current()
            if run == converted:
                return calls[site.fqn].converted(ops.pop(site.fqn), args, kwargs)
            if site.fqn not in ops:
                ops[site.fqn] = build(site, lockstep.read)
                if batches and calibrates(ops[site.fqn]):
                    if site.fqn in finished:
                        raise LowconvError(f"{site.fqn} runs more than once in a forward, and --stream calibrates a "
                                           f"site's scales in one pass of its module; convert without --stream")
                    ops[site.fqn].begin_calibration()
            op = ops[site.fqn]
            if run < example:  # a calibration run: the converted model's
                return run_eval(op, args, kwargs)
            if batches and calibrates(op):
                op.end_calibration()
                finished.add(site.fqn)
            keep(site, op)
            calls.setdefault(site.fqn, SiteCalls()).original(op, args, kwargs, output)

        def run(index: int, batch) -> None:
            outputs[index] = run_eval(model, *normalize_inputs(batch))

        handles = [module.register_forward_hook(lambda m, a, k, o, site=sites[fqn]: at_site(m, a, k, o, site),
                                                with_kwargs=True, prepend=True)
                   for fqn, module in modules.items() if module is not None]
        try:
            lockstep.runs({name: (lambda i=i, batch=batch: run(i, batch)) for i, (name, batch) in enumerate(runs.items())})
        except ReadOutsideItsModule as err:
            if batches:
                raise LowconvError(f"the model does not run module by module ({err}), so --stream cannot calibrate "
                                   f"its scales; convert without --stream") from None
            failed = f"{reports.NOT_MEASURED}: the model does not run module by module ({err})"
        finally:
            for handle in handles:
                handle.remove()
    in_model, alone, notes = {}, {}, {}
    for fqn in decisions:
        if failed:
            notes[fqn] = failed
        elif modules[fqn] is None:
            notes[fqn] = f"{reports.NOT_MEASURED}: a streamed report measures sites that are a module's whole forward"
        elif fqn not in calls:
            notes[fqn] = "not reached by the inputs"
        else:
            in_model[fqn], notes[fqn] = worst_call(calls[fqn].originals, calls[fqn].conversions)
            alone[fqn] = (calls[fqn].originals[0], calls[fqn].alone)
    pairs = []
    if not failed:
        check_no_nan(outputs[example])
        pairs = paired_outputs(outputs[example], outputs[converted])
    return reports.build_report(
        in_model, {fqn: d.op for fqn, d in decisions.items()}, pairs, site_alone=alone, logits=logits,
        gate_min_sqnr_db=None if failed else plan.gate_min_sqnr_db, gate_min_site_sqnr_db=plan.gate_min_site_sqnr_db,
        site_stats={fqn: c.stats for fqn, c in calls.items()}, recipe=plan.recipe, site_notes=notes,
        scope=FAILED_SCOPE + unchecked_gate(plan) if failed else SCOPE, calibration=plan.model.get("calibration") or "")


@dataclass
class SiteCalls:
    """What compare.compare measures of a converted site: the original's output on each call, its
    op's on the first call's inputs (alone), the op's in the converted model on each call, and the
    op's counters over the converted model's calls."""
    originals: list[torch.Tensor] = field(default_factory=list)
    alone: torch.Tensor | None = None
    conversions: list[torch.Tensor] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def original(self, op: nn.Module, args, kwargs, output) -> None:
        self.originals.append(first_tensor(output).detach().clone())
        if self.alone is None:
            self.alone = first_tensor(run_eval(op, args, kwargs))

    def converted(self, op: nn.Module, args, kwargs):
        before = op.report_stats() if isinstance(op, ReportsStats) else {}
        output = run_eval(op, args, kwargs)
        self.conversions.append(first_tensor(output).detach().clone())
        for name, value in (op.report_stats() if before else {}).items():
            self.stats[name] = self.stats.get(name, 0.0) + value - before[name]
        return output


def calibrates(op: nn.Module) -> bool:
    return isinstance(op, Calibrated) and op.needs_calibration


def unchecked_gate(plan: Plan) -> str:
    gate = plan.gate_min_sqnr_db
    return "" if gate is None else f"; the recipe's gate on the outputs (SQNR >= {gate:.1f} dB) was not checked"


def site_module(model: nn.Module, site: Site) -> nn.Module | None:
    """The module of `model` whose forward is the site, where there is one: the site's own, or a
    Hugging Face Conv1D (GPT-2's: x @ W + b, its output the site's, reshaped). None in an expanded
    nn.MultiheadAttention, which exists in the traced copy alone."""
    try:
        module = model.get_submodule(site.fqn)
    except AttributeError:
        return None
    conv1d = type(module).__name__ == "Conv1D" and site.info.weight == f"{site.fqn}.weight"
    return module if site.module_backed or conv1d else None
