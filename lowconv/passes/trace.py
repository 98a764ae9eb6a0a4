"""Trace a model with torch.fx, keeping its module hierarchy, and propagate shapes.

The whole model is traced when it can be. When it cannot, its children are tried, and so on
down: the result is the largest submodules that trace (regions), plus each module whose own
code did not trace and why. Leaf modules that lowconv converts as a whole (nn.Linear,
nn.MultiheadAttention) are regions of their own when their parent does not trace.

Tracing works on the module it is given; callers pass a copy, never the user's model.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

# Modules that are sites by themselves: traced as calls, never into.
SITE_MODULES = (nn.Linear, nn.MultiheadAttention)


@dataclass
class Region:
    fqn: str  # path of the module in the model; "" is the whole model
    module: nn.Module
    graph: fx.GraphModule | None  # None: a lone SITE_MODULES module under untraceable code
    example_args: tuple | None = None  # its inputs on the first call with the example inputs
    example_output: object = None  # its output on that call (lone site modules only)


@dataclass
class Untraced:
    fqn: str
    error: str  # the trace error, first line


@dataclass
class Trace:
    regions: list[Region]
    untraced: list[Untraced]


class SiteTracer(fx.Tracer):
    """fx's default tracer, but everything it may need to rewrite stays a call_module.

    Extra leaf classes (e.g. the op modules of an already converted model) can be given.
    """

    # Buffers become get_attr nodes (not constants): `self.mask[:, :, :T, :T]` with a traced T
    # then traces, and the attention pass can read the buffer to recognize a causal mask.
    proxy_buffer_attributes = True

    def __init__(self, leaf_classes: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_classes = SITE_MODULES + leaf_classes

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaf_classes) or super().is_leaf_module(m, qualname)


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()


def trace_module(module: nn.Module) -> fx.GraphModule:
    graph = SiteTracer().trace(module)
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


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
            if not isinstance(module, SITE_MODULES) and next(module.children(), None) is not None:
                targets.append(node.target)
    return targets


def find_regions(model: nn.Module, only: list[str] | None = None) -> Trace:
    """Trace `model`, or where it does not trace, its largest traceable submodules.

    `only` replays a known list of region FQNs (from a saved plan) instead of searching.
    """
    if only is not None:
        regions = []
        for fqn in only:
            module = model.get_submodule(fqn)
            graph = None if isinstance(module, SITE_MODULES) else trace_module(module)
            regions.append(Region(fqn, module, graph))
        return Trace(regions, [])

    regions: list[Region] = []
    untraced: list[Untraced] = []

    def visit_children(fqn: str, module: nn.Module):
        for name, child in module.named_children():
            visit(join_fqn(fqn, name), child)

    def visit(fqn: str, module: nn.Module):
        if isinstance(module, SITE_MODULES):
            regions.append(Region(fqn, module, None))
            return
        if not has_own_forward(module):
            visit_children(fqn, module)
            return
        try:
            graph = trace_module(module)
        except Exception as err:  # any trace failure: fall back to the children
            untraced.append(Untraced(fqn, first_line(err)))
            visit_children(fqn, module)
            return
        regions.append(Region(fqn, module, graph))
        for target in opaque_calls(graph):
            visit_children(join_fqn(fqn, target), graph.get_submodule(target))

    visit("", model)
    return Trace(regions, untraced)


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """example_inputs as (args, kwargs): a tuple/list is args, a dict is kwargs, else one arg."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def bind_positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The forward's arguments as one positional tuple, defaults filled (None if impossible)."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        return None
    return tuple(bound.arguments.values())


@contextmanager
def evaluating(model: nn.Module):
    """The model in eval mode (no BatchNorm statistics updated, no dropout), modes restored after;
    the global RNG is left as it was."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield model
    finally:
        for m, mode in modes.items():
            m.training = mode


def capture_region_inputs(model: nn.Module, regions: list[Region], example_inputs) -> None:
    """Run the model once and record each region's inputs (and lone modules' outputs)."""
    handles = []
    for region in regions:
        def pre_hook(mod, args, kwargs, region=region):
            if region.example_args is None:
                region.example_args = bind_positional(mod, args, kwargs)

        def post_hook(mod, args, output, region=region):
            if region.example_output is None:
                region.example_output = output

        handles.append(region.module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        if region.graph is None:
            handles.append(region.module.register_forward_hook(post_hook))
    args, kwargs = normalize_inputs(example_inputs)
    try:
        with evaluating(model):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def propagate_shapes(region: Region) -> None:
    """Leave tensor_meta on the region's graph nodes (no-op when its inputs are unknown)."""
    if region.graph is None or region.example_args is None:
        return
    with evaluating(region.graph):
        ShapeProp(region.graph).propagate(*region.example_args)


def trace_model(model: nn.Module, example_inputs=None, only: list[str] | None = None) -> Trace:
    """Find regions in `model` (or replay `only`) and, given example inputs, propagate shapes."""
    trace = find_regions(model, only)
    if example_inputs is not None:
        capture_region_inputs(model, trace.regions, example_inputs)
        for region in trace.regions:
            propagate_shapes(region)
    return trace
