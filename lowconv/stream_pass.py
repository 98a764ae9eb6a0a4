"""A streamed conversion's pass over the model: run module by module, each converted site measured alone.

The model (its parameters stand-ins) runs on the example inputs with every parameter unloaded (a
stand-in that refuses to compute) except while the module that owns it runs: then it is read from
the input checkpoint (and handed to the stream, which writes the tensors it keeps), and dropped
after. Where a converted site's module has run, the stream builds its op module from the weights
that module holds (and writes it), and the op runs on the inputs that module saw: the pair of
outputs is the site's "alone" measurement of compare.compare, the same numbers. Memory holds one
module's weights.

Not measured: the model's outputs and each site in the converted model (both need the converted
model run whole, which the stream never holds), and sites that are no module's whole forward. A
model whose code computes with a parameter outside the module that owns it stops at that read; the
report then says so rather than run on stand-ins.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lowconv import report as reports
from lowconv.compare import first_tensor, worst_call
from lowconv.inputs import normalize_inputs, run_eval
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


class Onloaded:
    """`model`, within `with`, with each parameter unloaded except while the module that owns it
    runs: then it is original(its name), and on_load(its stand-in, the tensor) is called. The
    stand-ins are back afterwards."""

    def __init__(self, model: nn.Module, original: Reader, on_load: Callable[[torch.Tensor, torch.Tensor], None]):
        self.model, self.original, self.on_load = model, original, on_load
        self.live: dict[str, torch.Tensor] = {}  # the parameters of the modules running now, by name
        self.held: dict[nn.Module, tuple[str, dict]] = {}  # module -> (its name's prefix, its stand-ins)
        self.handles = []

    def read(self, name: str) -> torch.Tensor:
        """A parameter as the model holds it: the running module's, without a second read."""
        return self.live[name] if name in self.live else self.original(name)

    def load(self, module: nn.Module, args) -> None:
        prefix, stand_ins = self.held[module]
        for name, stand_in in stand_ins.items():
            if stand_in is not None:
                tensor = self.live[prefix + name] = self.original(prefix + name)
                module._parameters[name] = tensor
                self.on_load(stand_in, tensor)

    def drop(self, module: nn.Module, args, output) -> None:
        prefix, stand_ins = self.held[module]
        for name, stand_in in stand_ins.items():
            if stand_in is not None:
                module._parameters[name] = unloaded(stand_in, prefix + name)
                self.live.pop(prefix + name, None)

    def __enter__(self) -> Onloaded:
        for fqn, module in self.model.named_modules():
            if any(p is not None for p in module._parameters.values()):
                self.held[module] = (f"{fqn}." if fqn else "", dict(module._parameters))
                self.drop(module, (), None)
                self.handles += [module.register_forward_pre_hook(self.load), module.register_forward_hook(self.drop)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        for module, (_, stand_ins) in self.held.items():
            module._parameters.update(stand_ins)
        self.live.clear()


def streamed_pass(model: nn.Module, plan: Plan, sites: dict[str, Site], inputs, original: Reader,
                  built: Callable[[Site, Reader], nn.Module],
                  on_load: Callable[[torch.Tensor, torch.Tensor], None]) -> reports.Report:
    """Run `model` on `inputs` module by module (module doc); `built(site, read)` gives a converted
    site's op module from the weights read(name) gives. The report of each converted site alone."""
    decisions = {d.fqn: d for d in plan.converted()}
    calls: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    modules = {fqn: site_module(model, sites[fqn]) for fqn in decisions}
    failed = ""
    with Onloaded(model, original, on_load) as onloaded:
        def measure(module, args, kwargs, output, site):
            converted = first_tensor(run_eval(built(site, onloaded.read), args, kwargs))
            originals, conversions = calls.setdefault(site.fqn, ([], []))
            originals.append(first_tensor(output).detach().clone())
            conversions.append(converted)

        handles = [module.register_forward_hook(lambda m, a, k, o, site=sites[fqn]: measure(m, a, k, o, site),
                                                with_kwargs=True, prepend=True)
                   for fqn, module in modules.items() if module is not None]
        try:
            run_eval(model, *normalize_inputs(inputs))
        except ReadOutsideItsModule as err:
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
                                site_notes=notes, scope=SCOPE + unchecked_gate(plan))


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
