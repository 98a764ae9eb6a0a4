"""A streamed conversion's pass over the model: its runs in lockstep, module by module; the
calibration of static scales, and each converted site measured alone.

The model, its parameters stand-ins, runs on several inputs at once, each run in a thread of its
own and one thread at a time (Lockstep): a run stops before each module that owns parameters until
every run has reached it; then the module's parameters are read from the input checkpoint (and
handed to the stream, which writes the tensors it keeps), each run in turn goes through the module,
and the parameters are dropped once no run is inside it. So the weights are read once whatever the
number of runs, and memory holds the weights of the module running (and of those around it) plus
each run's activations.

The runs: one per calibration batch where a converted site's scales are calibrated (static or
delayed FP8), then the example inputs'. A calibration run is the converted model's: at each
converted site its op module's output replaces the original's, the op calibrating where it
calibrates, as lowconv.convert runs the calibration through the converted model. The example
inputs' run is the original's: at each converted site, once every calibration run has passed it,
the op module is finished (its scales set), handed to the stream to write, and run on that
module's inputs: the pair of outputs is the site's "alone" measurement of compare.compare, the same
numbers.

Not measured: the model's outputs and each site in the converted model (both need the converted
model run whole, which the stream never holds), and sites that are no module's whole forward. A
model whose code computes with a parameter outside the module that owns it stops at that read; the
report then says so rather than run on stand-ins (and a calibration stops the conversion there).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

import torch
from torch import nn

from lowconv import report as reports
from lowconv.compare import first_tensor, worst_call
from lowconv.errors import LowconvError
from lowconv.inputs import normalize_inputs, run_eval
from lowconv.ops.registry import Calibrated
from lowconv.plan import Plan
from lowconv.site import Site

SCOPE = ("streamed: each converted site alone (its op on the original's inputs at that site), the model run "
         "module by module; the model's outputs and the sites in the converted model were not compared")
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
        raise Diverged("--stream runs the model on its calibration batches and its example inputs together, module "
                       "by module, and they went different ways through it: " +
                       "; ".join(f"{name} {state}" for name, state in where.items()) +
                       "; convert without --stream (in memory)")

    def name(self, module: nn.Module) -> str:
        return self.held[module][0].rstrip(".") or "the model itself"


def streamed_pass(model: nn.Module, plan: Plan, sites: dict[str, Site], inputs, original: Reader,
                  build: Callable[[Site, Reader], nn.Module], keep: Callable[[Site, nn.Module], None],
                  on_load: Callable[[torch.Tensor, torch.Tensor], None], calibration: list | None = None
                  ) -> reports.Report:
    """Run `model` on the calibration batches and on `inputs` in lockstep (module doc);
    `build(site, read)` gives a converted site's op module from the weights read(name) gives, and
    keep(site, op module) takes it once it is finished (calibrated). The report of each converted
    site alone."""
    decisions = {d.fqn: d for d in plan.converted()}
    modules = {fqn: site_module(model, sites[fqn]) for fqn in decisions}
    batches = list(calibration or [])
    runs = {f"calibration batch {i}": batch for i, batch in enumerate(batches, 1)} | {"the example inputs": inputs}
    calls: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    ops: dict[str, nn.Module] = {}  # a site's op module, from the first run through it to the example's
    finished: set[str] = set()  # sites whose scales were calibrated
    failed = ""
    with Lockstep(model, original, on_load) as lockstep:
        def at_site(module, args, kwargs, output, site):
            if site.fqn not in ops:
                ops[site.fqn] = build(site, lockstep.read)
                if batches and calibrates(ops[site.fqn]):
                    if site.fqn in finished:
                        raise LowconvError(f"{site.fqn} runs more than once in a forward, and --stream calibrates a "
                                           f"site's scales in one pass of its module; convert without --stream")
                    ops[site.fqn].begin_calibration()
            op = ops[site.fqn]
            if lockstep.current() < len(batches):  # a calibration run: the converted model's
                return run_eval(op, args, kwargs)
            del ops[site.fqn]
            if batches and calibrates(op):
                op.end_calibration()
                finished.add(site.fqn)
            keep(site, op)
            originals, conversions = calls.setdefault(site.fqn, ([], []))
            originals.append(first_tensor(output).detach().clone())
            conversions.append(first_tensor(run_eval(op, args, kwargs)))

        handles = [module.register_forward_hook(lambda m, a, k, o, site=sites[fqn]: at_site(m, a, k, o, site),
                                                with_kwargs=True, prepend=True)
                   for fqn, module in modules.items() if module is not None]
        try:
            lockstep.runs({name: (lambda batch=batch: run_eval(model, *normalize_inputs(batch)))
                           for name, batch in runs.items()})
        except ReadOutsideItsModule as err:
            if batches:
                raise LowconvError(f"the model does not run module by module ({err}), so --stream cannot calibrate "
                                   f"its scales; convert without --stream") from None
            failed = f"{reports.NOT_MEASURED}: the model does not run module by module ({err})"
        finally:
            for handle in handles:
                handle.remove()
    alone, notes = {}, {}
    for fqn in decisions:
        if failed:
            notes[fqn] = failed
        elif modules[fqn] is None:
            notes[fqn] = f"{reports.NOT_MEASURED}: a streamed report measures sites that are a module's whole forward"
        elif fqn not in calls:
            notes[fqn] = "not reached by the inputs"
        else:
            alone[fqn], notes[fqn] = worst_call(*calls[fqn])
    return reports.build_report({}, {fqn: d.op for fqn, d in decisions.items()}, [], site_alone=alone,
                                gate_min_site_sqnr_db=plan.gate_min_site_sqnr_db, recipe=plan.recipe,
                                site_notes=notes, scope=SCOPE + unchecked_gate(plan),
                                calibration=plan.model.get("calibration") or "")


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
