"""Trace a model with torch.fx, keeping its module hierarchy, and propagate shapes.

The whole model is traced when it can be. When it cannot, its children are tried, and so on
down: the result is the largest submodules that trace (regions), plus each module whose own
code did not trace and why. Leaf modules that lowconv converts as a whole (nn.Linear,
nn.MultiheadAttention) are regions of their own when their parent does not trace.

Tracing is done in eval mode: fx freezes `self.training` into the graph, and inference is what
a conversion is for. A region whose code reads `self.training` (functional dropout) is marked,
and the plan warns that its converted form keeps eval behaviour in train mode.

Arguments that are None on the example call (`attention_mask=None`) are traced as the constant
None: fx would otherwise trace them as tensors and freeze `if mask is None` in its other branch.
The traced region then asserts that they are still None when called.

Tracing works on the module it is given; callers pass a copy, never the user's model.

Every run of a model on example inputs that lowconv makes (here and in api.py) is given fresh
clones of their tensors (`fresh_inputs`): a model that writes into its inputs (`x[:, 0] *= 2`)
then neither changes the user's tensors nor sees another run's writes.
"""
from __future__ import annotations

import inspect
import operator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from lowconv.compat import sptr, sptr_install
from lowconv.errors import LowconvError

# Modules that are sites by themselves: traced as calls, never into.
SITE_MODULES = (nn.Linear, nn.MultiheadAttention)


def is_site_module(module: nn.Module) -> bool:
    """An nn.Linear or nn.MultiheadAttention that computes what its class says (a subclass with
    its own forward, e.g. a LoRA layer, is traced into instead)."""
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in SITE_MODULES)


@dataclass
class Region:
    fqn: str  # path of the module in the model; "" is the whole model
    module: nn.Module
    graph: fx.GraphModule | None  # None: a lone site module under untraceable code
    none_args: list[str] = field(default_factory=list)  # forward arguments traced as None
    reads_training: bool = False  # its code branches on self.training (traced as eval)
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


class SetItemProxy(fx.Proxy):
    """A Proxy that records `x[i] = y` as an operator.setitem call, which fx generates code for
    but its Proxy refuses; SpTr's sparse_self_attention puts its output back in order that way."""

    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class SiteTracer(fx.Tracer):
    """fx's default tracer, but everything it may need to rewrite stays a call_module.

    Extra leaf classes (e.g. the op modules of an already converted model) can be given.
    """

    # Buffers become get_attr nodes (not constants): `self.mask[:, :, :T, :T]` with a traced T
    # then traces, and the attention pass can read the buffer to recognize a causal mask.
    proxy_buffer_attributes = True

    def __init__(self):
        # SpTr ops stay single calls even when a model imported them by name (torch.fx.wrap only
        # patches calls through the module's namespace); so do a real SpTr install's, whose
        # autograd Functions and CUDA extension cannot take a Proxy.
        real_ops = sptr_install.real_ops()
        super().__init__(autowrap_functions=sptr.SPTR_OPS + sptr.SPTR_HELPERS + tuple(op.real for op in real_ops))
        # fx patches autowrap functions in the traced forwards' globals and in the modules of its
        # (private) _autowrap_search list: adding sptr's catches `sptr.functional.attention_step1(...)`,
        # `F.attention_step1(...)` and the calls in sptr's own sparse_self_attention. (The public
        # autowrap_modules would also wrap every other callable there, SparseTrTensor included.)
        self._autowrap_search += sptr_install.loaded_modules()
        # By id: fx records the very object it patched, and call targets need not be hashable.
        self.real_ops = {id(op.real): op for op in real_ops}

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind == "call_function":
            target = self.real_ops.get(id(target), target)  # a real SpTr op is recorded as its RealOp
        return super().create_node(kind, target, args, kwargs, name, type_expr)

    def create_arg(self, a):
        # SpTr keeps window and quant sizes as numpy arrays (to_3d_numpy) and passes them to
        # get_indices_params; fx takes no numpy argument, so the graph rebuilds the array.
        if isinstance(a, np.ndarray):
            return self.create_node("call_function", np.array, (a.tolist(),), {"dtype": str(a.dtype)})
        return super().create_arg(a)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return SetItemProxy(node, self)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_site_module(m) or super().is_leaf_module(m, qualname)


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()


def trace_module(module: nn.Module, none_args=(), training: bool = False) -> fx.GraphModule:
    """The module traced with every submodule's mode set to `training` (modes restored after)."""
    modes = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        graph = SiteTracer().trace(module, concrete_args={name: None for name in none_args} or None)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


def reads_training(module: nn.Module, graph: fx.GraphModule, none_args=()) -> bool:
    """Whether the module's traced code differs between train and eval mode."""
    return trace_module(module, none_args, training=True).code != graph.code


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
                 none_args: dict[str, list[str]] | None = None) -> Trace:
    """Trace `model`, or where it does not trace, its largest traceable submodules.

    `only` replays a known list of region FQNs (from a saved plan) instead of searching.
    `none_args`: per module FQN, the forward arguments to trace as None.
    """
    none_args = none_args or {}

    def region(fqn: str, module: nn.Module) -> Region:
        if is_site_module(module):
            return Region(fqn, module, None)
        nones = none_args.get(fqn, [])
        graph = trace_module(module, nones)
        return Region(fqn, module, graph, nones, reads_training(module, graph, nones))

    if only is not None:
        return Trace([region(fqn, model.get_submodule(fqn)) for fqn in only], [])

    regions: list[Region] = []
    untraced: list[Untraced] = []

    def visit_children(fqn: str, module: nn.Module):
        for name, child in module.named_children():
            visit(join_fqn(fqn, name), child)

    def visit(fqn: str, module: nn.Module):
        if not has_own_forward(module):
            visit_children(fqn, module)
            return
        try:
            found = region(fqn, module)
        except Exception as err:  # any trace failure: fall back to the children
            untraced.append(Untraced(fqn, first_line(err)))
            visit_children(fqn, module)
            return
        regions.append(found)
        if found.graph is not None:
            for target in opaque_calls(found.graph):
                visit_children(join_fqn(fqn, target), found.graph.get_submodule(target))

    visit("", model)
    return Trace(regions, untraced)


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """example_inputs as (args, kwargs): a tuple/list is args, a dict is kwargs, else one arg."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with every tensor in them (through tuples, lists, dicts and other pytree
    containers) a detached clone, requires_grad kept; anything else as it is. A tensor passed twice
    gets one clone, so the run sees the aliasing it had (views of one another become separate).
    What each internal run of a model is given, so that writes into its inputs change neither the
    caller's tensors nor what the next run sees."""
    clones: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in clones:
            clones[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
        return clones[id(t)]

    return pytree.tree_map_only(torch.Tensor, clone, (tuple(args), dict(kwargs)))


def bind_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The forward's arguments by name, defaults filled (None when they cannot be bound, or when
    extra *args/**kwargs were passed, which a traced forward cannot take positionally)."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if value:
                return None
            continue
        arguments[name] = value
    return arguments


@contextmanager
def evaluating(model: nn.Module):
    """The model in eval mode (no BatchNorm statistics updated, no dropout), modes restored after;
    the global RNG is left as it was."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield model
    finally:
        for m, mode in modes.items():
            m.training = mode


@dataclass
class Call:
    arguments: dict | None  # by name, see bind_arguments
    output: object


def first_calls(model: nn.Module, example_inputs) -> dict[str, Call]:
    """Run the model once (eval mode); what each module with a forward of its own got and gave.

    The run gets fresh clones of the inputs; the model's own call is then given other fresh clones,
    so that its recorded arguments hold the example values even if the model wrote into its inputs
    (a submodule's recorded arguments are what it got, as they are after the run)."""
    calls: dict[str, Call] = {}
    handles = []
    for fqn, module in model.named_modules():
        if not has_own_forward(module):
            continue

        def record(mod, args, kwargs, output, fqn=fqn):
            calls.setdefault(fqn, Call(bind_arguments(mod, args, kwargs), output))

        handles.append(module.register_forward_hook(record, with_kwargs=True))
    args, kwargs = normalize_inputs(example_inputs)
    run_args, run_kwargs = fresh_inputs(args, kwargs)
    try:
        with evaluating(model):
            model(*run_args, **run_kwargs)
    except Exception as err:
        raise LowconvError(f"the model failed on its example inputs: {type(err).__name__}: {err}") from err
    finally:
        for h in handles:
            h.remove()
    if "" in calls and calls[""].arguments is not None:
        calls[""].arguments = bind_arguments(model, *fresh_inputs(args, kwargs))
    return calls


def propagate_shapes(region: Region) -> None:
    """Leave tensor_meta on the region's graph nodes (no-op when its inputs are unknown). The run
    gets fresh clones of example_args, which keep their values."""
    if region.graph is None or region.example_args is None:
        return
    args, _ = fresh_inputs(region.example_args, {})
    with evaluating(region.graph):
        ShapeProp(region.graph).propagate(*args)


def trace_model(model: nn.Module, example_inputs=None, only: list[str] | None = None,
                none_args: dict[str, list[str]] | None = None) -> Trace:
    """Find regions in `model` (or replay `only`); given example inputs, propagate shapes.

    `none_args` (per module FQN, the arguments to trace as None) defaults to the arguments that
    are None on the example inputs; a replay passes the ones the conversion used.
    """
    calls = first_calls(model, example_inputs) if example_inputs is not None else {}
    if none_args is None:
        none_args = {fqn: [name for name, value in call.arguments.items() if value is None]
                     for fqn, call in calls.items() if call.arguments}
    trace = find_regions(model, only, none_args)
    for region in trace.regions:
        call = calls.get(region.fqn)
        if call is not None:
            region.example_output = call.output
            if call.arguments is not None:
                region.example_args = tuple(call.arguments.values())
        propagate_shapes(region)
    return trace
