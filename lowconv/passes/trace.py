"""Find a model's regions: the whole model traced (passes/tracer.py) when it can be, else its
children, and so on down: the result is the largest submodules that trace (regions), plus each
module whose own code did not trace and why. Leaf modules that lowconv converts as a whole
(nn.Linear, nn.MultiheadAttention) are regions of their own when their parent does not trace.
Each region's graph runs its example call (shape propagation).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from lowconv.errors import LowconvError, first_line
from lowconv.passes.example_calls import Call, first_calls, fixed_arguments, is_site_module
from lowconv.passes.shapes import propagate_shapes
from lowconv.passes.tracer import branches_on_training, release_graph, trace_module
from lowconv.site import TensorMeta


# The hooks a user registers on a module (register_forward_hook, ..._pre_hook, ...full_backward_hook).
HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
         "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name) for name in HOOKS)


def hooked_inside(region: "Region") -> list[str]:
    """Modules below a traced region's root that tracing went into (not called from the graph)
    and that have hooks: tracing ran those hooks once, on symbolic values."""
    called = [node.target for node in region.graph.graph.nodes if node.op == "call_module"]
    return [join_fqn(region.fqn, name) for name, module in region.module.named_modules()
            if name and has_hooks(module) and not any(name == c or name.startswith(c + ".") for c in called)]


@dataclass
class Region:
    fqn: str  # path of the module in the model; "" is the whole model
    module: nn.Module
    graph: fx.GraphModule | None  # None: a lone site module under untraceable code
    none_args: list[str] = field(default_factory=list)  # forward arguments traced as None
    constant_args: dict = field(default_factory=dict)  # forward arguments traced as this bool/int/float/str
    decided: list[str] = field(default_factory=list)  # branches the example inputs decided (guarded)
    example_args: tuple | None = None  # its inputs on the first call with the example inputs
    output_meta: TensorMeta | None = None  # its output's shape and dtype on that call (lone site modules only)
    training_check: Callable[[], bool] | None = field(default=None, repr=False)  # reads_training's

    @functools.cached_property
    def reads_training(self) -> bool:
        """Whether its code branches on self.training (it was traced as eval). Asked only of the
        regions a rewrite replaces (a plan's warning), as it traces the module again: half of a
        Llama's planning time, spent on every region otherwise."""
        return self.training_check is not None and self.training_check()


@dataclass
class Untraced:
    fqn: str
    error: str  # the trace error, first line


@dataclass
class Trace:
    regions: list[Region]
    untraced: list[Untraced]


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def release_graphs(trace: Trace, kept: nn.Module | None = None) -> None:
    """release_graph for each region graph of `trace` that `kept` (a converted model) does not hold."""
    held = {id(m) for m in kept.modules()} if kept is not None else set()
    for region in trace.regions:
        if region.graph is not None and id(region.graph) not in held:
            release_graph(region.graph)


def has_own_forward(module: nn.Module) -> bool:
    """False for containers called only through their items (ModuleList, ModuleDict)."""
    return type(module).forward is not nn.Module.forward


def opaque_calls(graph: fx.GraphModule) -> list[str]:
    """Targets of call_modules that hide sites: torch.nn modules with children (fx keeps every
    torch.nn module a leaf; nn.TransformerEncoderLayer holds an nn.MultiheadAttention)."""
    targets = []
    for node in graph.graph.nodes:
        if node.op == "call_module" and node.target not in targets:
            module = graph.get_submodule(node.target)
            if not is_site_module(module) and next(module.children(), None) is not None:
                targets.append(node.target)
    return targets


def find_regions(model: nn.Module, only: list[str] | None = None,
                 none_args: dict[str, list[str]] | None = None, example_inputs=None,
                 constant_args: dict[str, dict] | None = None) -> Trace:
    """Trace `model`, or where it does not trace, its largest traceable submodules.

    `only` replays a known list of region FQNs (from a saved plan) instead of searching.
    Given `example_inputs`, each module is traced with its first call on them (first_calls), whose
    values decide branches on metadata (see trace_module) and become the region's example_args
    (and a lone site module's output_meta); the traced graph runs them (shape propagation).
    `none_args`: per module FQN, the forward arguments to trace as None; `constant_args`, those to
    trace as a constant (name -> value); by default, those that are None, or a constant
    (is_constant), on the example call.

    The search tries the model, then the children of what does not trace, one level of the module
    tree at a time: each level's calls are recorded by one run of the model, for that level's
    modules only, so that the calls held are one level's (and the regions' own), not every module's.
    Regions and untraced modules are listed in the model's order (depth first).
    """
    def region(fqn: str, module: nn.Module, call: Call | None) -> Region:
        example_args = tuple(call.arguments.values()) if call is not None and call.arguments is not None else None
        if is_site_module(module):
            return Region(fqn, module, None, example_args=example_args,
                          output_meta=call.output if call is not None else None)
        nones, constants = fixed_arguments(call)
        if none_args is not None:
            nones = none_args.get(fqn, [])
        if constant_args is not None:
            constants = constant_args.get(fqn, {})
        fixed = {**dict.fromkeys(nones), **constants}
        graph = trace_module(module, fixed, call=call)
        traced = Region(fqn, module, graph, nones, constants, decided=graph.meta["decided"], example_args=example_args,
                        training_check=lambda: branches_on_training(module, graph, fixed, call))
        propagate_shapes(traced)  # a graph that does not run its example call is no region: its children are tried
        return traced

    def replayed(fqn: str, call: Call | None) -> Region:
        try:
            return region(fqn, model.get_submodule(fqn), call)
        except Exception as err:
            hint = "" if example_inputs is not None else (
                " (its branches were decided by the example inputs: pass example_inputs)")
            raise LowconvError(f"region {fqn or '(whole model)'} does not trace again: {first_line(err)}{hint}") from err

    def calls_of(fqns: list[str]) -> dict[str, Call]:
        return first_calls(model, example_inputs, fqns) if example_inputs is not None else {}

    if only is not None:
        calls = calls_of(only)
        return Trace([replayed(fqn, calls.get(fqn)) for fqn in only], [])

    regions: list[Region] = []
    untraced: list[Untraced] = []
    level = with_own_forward([("", model)])
    while level:
        level = search_level(level, calls_of([fqn for fqn, _ in level]), region, regions, untraced)
    return Trace(sorted(regions, key=lambda r: tree_position(model, r.fqn)),
                 sorted(untraced, key=lambda u: tree_position(model, u.fqn)))


def search_level(level: list[tuple[str, nn.Module]], calls: dict[str, Call], region, regions: list[Region],
                 untraced: list[Untraced]) -> list[tuple[str, nn.Module]]:
    """Try each module of a level as a region (`region(fqn, module, call)`), adding it to `regions`
    or `untraced`; the next level: the children of what did not trace, and of the opaque calls
    (opaque_calls) of what did."""
    below = []
    for fqn, module in level:
        try:
            traced = region(fqn, module, calls.get(fqn))
        except Exception as err:  # any trace failure: fall back to the children
            untraced.append(Untraced(fqn, first_line(err)))
            below += children(fqn, module)
            continue
        regions.append(traced)
        if traced.graph is not None:
            for target in opaque_calls(traced.graph):
                below += children(join_fqn(fqn, target), traced.graph.get_submodule(target))
    return with_own_forward(below)


def children(fqn: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(join_fqn(fqn, name), child) for name, child in module.named_children()]


def with_own_forward(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules that the search tries: containers without a forward (ModuleList) are replaced
    by their children, recursively."""
    tried = []
    for fqn, module in modules:
        tried += [(fqn, module)] if has_own_forward(module) else with_own_forward(children(fqn, module))
    return tried


def tree_position(model: nn.Module, fqn: str) -> tuple[int, ...]:
    """Where a depth-first walk of the model's children meets `fqn`: the index of each name
    along its path among its parent's children."""
    position, module = [], model
    for name in fqn.split(".") if fqn else []:
        position.append([n for n, _ in module.named_children()].index(name))
        module = getattr(module, name)
    return tuple(position)


def trace_model(model: nn.Module, example_inputs=None, only: list[str] | None = None,
                none_args: dict[str, list[str]] | None = None,
                constant_args: dict[str, dict] | None = None) -> Trace:
    """Find regions in `model` (or replay `only`), their shapes propagated where example inputs are given.

    `none_args` (per module FQN, the arguments to trace as None) and `constant_args` (those to trace
    as a constant: name -> value) default to the arguments that are None, or a bool, int, float
    or str, on the example inputs; a replay passes the ones the conversion used. A constant
    argument is guarded by the traced graph, as a None one is, and takes code such as
    `isinstance(n, int)` the way the example took it.
    """
    return find_regions(model, only, none_args, example_inputs, constant_args)
