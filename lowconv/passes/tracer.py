"""The tracer: one module traced with torch.fx, its module hierarchy kept, what lowconv converts
kept as calls (nn.Linear, nn.MultiheadAttention).

Tracing is done in eval mode: fx freezes `self.training` into the graph, and inference is what
a conversion is for. A region whose code reads `self.training` (functional dropout) is marked,
and the plan warns that its converted form keeps eval behaviour in train mode.

Arguments that are None on the example call (`attention_mask=None`) are traced as the constant
None: fx would otherwise trace them as tensors and freeze `if mask is None` in its other branch.
The traced region then asserts that they are still None when called.

Arguments that are a bool, int, float or str on the example call (`use_cache=False`,
`logits_to_keep=0`) are traced as those constants, guarded the same way. With the example
inputs, the tracer also knows every traced value, and takes the branches that depend on shapes,
dtypes and flags the way the example does (`if q.shape[2] > 1`, `cos, sin = pair`, `f(**kwargs)`),
each checked by a guard in the graph (passes/example_values.py); branches on tensor data still
stop the trace. Forwards fx cannot take as they are (decorated, or with *args/**kwargs, as in
Hugging Face's models) are traced through a function of the arguments the example call bound.

Tracing works on the module it is given; callers pass a copy, never the user's model.

Every run of a model on example inputs that lowconv makes (here and in inputs.py) is given fresh
clones of their tensors (`fresh_inputs`): a model that writes into its inputs (`x[:, 0] *= 2`)
then neither changes the user's tensors nor sees another run's writes.
"""
from __future__ import annotations

import bisect
import dataclasses
import dis
import inspect
import operator
import re
import sys
import types
from contextlib import contextmanager

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.fx.proxy import TraceError

from lowconv.compat import flash_attn, sptr_install, timm, transformers
from lowconv.passes.example_values import (
    MISSING, ExampleValues, code_location, decided, decided_keys, decided_length,
)
from lowconv.inputs import fresh_inputs
from lowconv.passes.built_in_graph import built_in_graph
from lowconv.passes.example_calls import Call, is_site_module
from lowconv.scoped_setting import ScopedSetting

# What the libraries lowconv knows need of the tracer, each declared in its compat/ file.
TRACE_HOOKS = (sptr_install.TRACE_HOOK, timm.TRACE_HOOK, transformers.TRACE_HOOK, flash_attn.TRACE_HOOK)


def none_or_dtype(input):
    """F._none_or_dtype without its isinstance(input, Tensor) check, which rejects a Proxy (torch's
    encoder layer asks it for its src_mask's dtype): the dtype read is traced as metadata."""
    return None if input is None else input.dtype


def iterate_proxy(proxy: fx.Proxy):
    """fx's Proxy.__iter__ without its reference cycle: it keeps its own frame in a local
    (inspect.currentframe()), so that frame and every frame it was called from, with their locals
    (the tracer and its example values, the model's tensors, the recorded example calls), stay
    alive after the trace until the garbage collector runs. As fx does: unpacking (`a, b = x`)
    gets as many items as the code unpacks; any other iteration asks the tracer."""
    caller = sys._getframe(1)
    instructions = list(dis.get_instructions(caller.f_code))
    if sys.version_info >= (3, 11):
        at = bisect.bisect_left(instructions, caller.f_lasti, key=lambda i: i.offset)
    else:
        at = caller.f_lasti // 2
    if instructions[at].opname == "UNPACK_SEQUENCE":
        return (proxy[i] for i in range(instructions[at].argval))
    return proxy.tracer.iter(proxy)


def wrap_without_cycle(fn_or_name):
    """torch.fx.wrap as the code of a GraphModule calls it (`wrap("name")` at the top of the code's
    module, for a function traced as one call: SpTr's ops), without its reference cycle (as in
    Proxy.__iter__, see iterate_proxy): the frames running when a GraphModule is compiled would stay."""
    name = fn_or_name if isinstance(fn_or_name, str) else fn_or_name.__name__
    caller = sys._getframe(1)
    torch.fx._symbolic_trace._wrapped_fns_to_patch[(id(caller.f_globals), name)] = caller.f_globals
    return fn_or_name


# The code fx generates calls torch.fx._symbolic_trace.wrap by that name: while lowconv compiles a
# GraphModule (fx.GraphModule(...), recompile()), the name is wrap_without_cycle's.
COMPILING = ScopedSetting(lambda: torch.fx._symbolic_trace.wrap,
                          lambda wrap: setattr(torch.fx._symbolic_trace, "wrap", wrap), wrap_without_cycle)


def recompile(gm: fx.GraphModule) -> None:
    with COMPILING.held():
        gm.recompile()


# What stands in for these while tracing: functions that reject a Proxy (the same value on a
# tensor, or the example's, guarded, or the call recorded), and fx's Proxy.__iter__ (the same,
# without a reference cycle).
FINFO = torch.finfo


def finfo(type=None):
    """torch.finfo of a traced dtype (transformers' eager mask asks it of the hidden states'
    dtype): the example's, a decision the graph guards as a branch on it."""
    if isinstance(type, fx.Proxy):
        value = type.tracer.decidable(type)  # MISSING without example values
        if value is MISSING or not bool(type == value):  # bool() guards the dtype in the graph
            raise TraceError(f"torch.finfo of {type.node.name}, whose dtype is not known before it runs")
        type = value
    return FINFO() if type is None else FINFO(type)


def sized_by_arguments(factory):
    """A torch factory whose argument parser refuses a traced size (`torch.ones(n, seq, device=d)`,
    n a traced value) before a Proxy can take the call: recorded as a call."""
    def stand_in(*args, **kwargs):
        values = [v for a in (*args, *kwargs.values()) for v in (a if isinstance(a, (tuple, list)) else (a,))]
        traced = next((v for v in values if isinstance(v, fx.Proxy)), None)
        if traced is None:
            return factory(*args, **kwargs)
        return traced.tracer.create_proxy("call_function", factory, args, kwargs)
    return stand_in


FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn")
STAND_INS = {(F, "_none_or_dtype"): none_or_dtype, (fx.Proxy, "__iter__"): iterate_proxy, (torch, "finfo"): finfo,
             **{(torch, name): sized_by_arguments(getattr(torch, name)) for name in FACTORIES}}


@contextmanager
def stand_ins():
    """STAND_INS in place of what they stand in for, while a trace runs (process-wide, as fx's own patches)."""
    originals = {(module, name): getattr(module, name) for module, name in STAND_INS}
    for (module, name), stand_in in STAND_INS.items():
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


# torch.nn modules whose forward, in inference, may skip their submodules' forward and read their
# weights directly (torch's "fast path": a fused C++ encoder layer, nested tensors). fx keeps
# torch.nn modules as calls; these are traced into, so that their sites are found in the plain path
# the graph records, and their converted region runs that graph instead of the fast path.
FUSED_INFERENCE_PATHS = (nn.TransformerEncoder, nn.TransformerEncoderLayer)


def has_fused_path(module: nn.Module) -> bool:
    """Whether a module in `module` may read a swapped module's weight instead of calling it: a
    converted FP8 or 2:4 weight would break its fused kernel, so the region's graph replaces it."""
    return any(isinstance(m, FUSED_INFERENCE_PATHS) for m in module.modules())


class SetItemProxy(fx.Proxy):
    """A Proxy that records `x[i] = y` as an operator.setitem call, which fx generates code for
    but its Proxy refuses (SpTr's sparse_self_attention puts its output back in order that way),
    and whose len() the tracer answers from the example values when it can."""

    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __len__(self) -> int:
        return self.tracer.length(self)

    def __getattr__(self, name):
        # fx's Proxy has every attribute. Where the example's value lacks one, so does the proxy:
        # `hasattr(x, "jax")` (transformers' torchax check, which then calls x.jax() when jax is
        # installed) must say False for a tensor, not record a call that fails when the graph runs.
        example = self.tracer.example
        value = MISSING if example is None else example.value(self.node)
        if value is not MISSING and not hasattr(value, name):
            raise AttributeError(f"{type(value).__name__} has no attribute {name!r}")
        return super().__getattr__(name)


class SiteTracer(fx.Tracer):
    """fx's default tracer, but everything it may need to rewrite stays a call_module.

    Given the example values of the forward's arguments (in placeholder order), it computes each
    node's value beside the trace and takes the branches, iterations and lengths the example
    takes where they depend on metadata only, each guarded in the graph (passes/example_values.py).
    """

    # Buffers become get_attr nodes (not constants): `self.mask[:, :, :T, :T]` with a traced T
    # then traces, and the attention pass can read the buffer to recognize a causal mask.
    proxy_buffer_attributes = True

    def __init__(self, example_arguments: list | None = None, forward=None):
        wrapped = [(hook, hook.autowrap_functions()) for hook in TRACE_HOOKS]  # asked once: they may scan sys.modules
        super().__init__(autowrap_functions=tuple(f for _, functions in wrapped for f in functions))
        self._autowrap_search += [m for hook in TRACE_HOOKS for m in hook.autowrap_modules()]
        # By id: fx records the very object it patched, and call targets need not be hashable.
        self.recorded_as = {id(f): target for hook, functions in wrapped for f in functions
                            if (target := hook.recorded_as(f)) is not None}
        self.traced_into = frozenset().union(*(hook.traced_into for hook in TRACE_HOOKS))
        self.example = ExampleValues(example_arguments) if example_arguments is not None else None
        self.forward = forward  # traced instead of the root's forward (see bound_forward)
        self.running_example = False  # a node is being run on its example values

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        return super().create_args_for_root(self.forward or root_fn, is_module, concrete_args)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self.example is not None and kind != "output":
            # fx's patches of nn.Module stay on while the node runs on real values: getattr and
            # call_module below let the run through instead of recording it.
            # Without autograd, as in an eval run; the trace itself keeps the caller's grad mode,
            # so code reading torch.is_grad_enabled() is traced as the caller runs it.
            self.running_example = True
            try:
                with torch.no_grad():
                    self.example.evaluate(proxy.node, self.root)
            finally:
                self.running_example = False
            self.example.watch(proxy)
        return proxy

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.running_example:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self.running_example:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def decidable(self, proxy: fx.Proxy):
        return self.example.decidable(proxy) if self.example is not None else MISSING

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self.decidable(obj)
        if value is MISSING:  # a branch on data, or on something unknown: not traceable
            raise TraceError(f"symbolically traced variables cannot be used as inputs to control flow (at "
                             f"{code_location()})")
        where, taken = code_location(), bool(value)
        self.create_proxy("call_function", decided, (obj, taken, where), {})
        self.example.decisions.append(f"{where}: branch {taken}")
        return taken

    def length(self, obj: fx.Proxy) -> int:
        value = self.decidable(obj)
        if value is MISSING or not hasattr(value, "__len__"):
            raise TraceError(f"len() of {obj.node.name} (at {code_location()}), whose length is not known before it "
                             f"runs")
        where = code_location()
        self.create_proxy("call_function", decided_length, (obj, len(value), where), {})
        self.example.decisions.append(f"{where}: length {len(value)}")
        return len(value)

    def iter(self, obj: fx.Proxy):
        value = self.decidable(obj)
        if isinstance(value, dict):  # `for key in obj`, `key in obj`: the example's keys
            return iter(self.keys(obj))
        if not isinstance(value, (tuple, list, torch.Size)):
            return super().iter(obj)
        return iter([obj[i] for i in range(self.length(obj))])

    def keys(self, obj: fx.Proxy):
        value = self.decidable(obj)
        if not isinstance(value, dict):
            return super().keys(obj)
        where = code_location()  # `**obj`: its keys are fixed as the example's
        self.create_proxy("call_function", decided_keys, (obj, tuple(value), where), {})
        self.example.decisions.append(f"{where}: keys {', '.join(map(str, value))}")
        return list(value)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind == "call_function":
            target = self.recorded_as.get(id(target), target)  # a real SpTr op as its RealOp
        return super().create_node(kind, target, args, kwargs, name, type_expr)

    def create_arg(self, a):
        # SpTr keeps window and quant sizes as numpy arrays (to_3d_numpy) and passes them to
        # get_indices_params; fx takes no numpy argument, so the graph rebuilds the array.
        if isinstance(a, np.ndarray):
            return self.create_node("call_function", np.array, (a.tolist(),), {"dtype": str(a.dtype)})
        # A numpy scalar (SphereFormer's `np.log(2)`) as the Python number it holds: fx refuses
        # np.float32 and np.int64, and writes np.float64 as numpy 2 prints it, `np.float64(0.69...)`,
        # which the generated code cannot run (it has no `np`).
        if isinstance(a, np.generic):
            return a.item()
        # A dataclass (Hugging Face's ModelOutput, a dict subclass that fx would turn into a plain
        # dict) is rebuilt by the graph, so a converted model returns what the model returned.
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            fields = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), fields)
        return super().create_arg(a)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return SetItemProxy(node, self)

    def trace(self, root, concrete_args=None):
        # Functions a library made opaque with torch.fx.wrap that hide an attention's scores: fx
        # would record one call for them; traced into, the attention pass sees the ops. The table
        # is torch's, process-wide: an fx trace in another thread meanwhile would not see them wrapped.
        # And what STAND_INS lists is replaced by its stand-in meanwhile, and the classes the hooks
        # name are built by the graph (built_in_graph).
        table = torch.fx._symbolic_trace._wrapped_fns_to_patch
        hidden = {key: frame for key, frame in table.items() if qualified_name(frame.get(key[1])) in self.traced_into}
        for key in hidden:
            del table[key]
        try:
            built = tuple(cls for hook in TRACE_HOOKS for cls in hook.built_in_graph())
            with stand_ins(), built_in_graph(self, root, built):
                return super().trace(root, concrete_args)
        finally:
            table.update(hidden)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # fx keeps torch.nn's modules as calls; these hold linears and attention to convert
        if isinstance(m, FUSED_INFERENCE_PATHS + (nn.TransformerDecoderLayer,)):
            return False
        return is_site_module(m) or super().is_leaf_module(m, qualname)


def qualified_name(function) -> str:
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"


def trace_module(module: nn.Module, fixed: dict | None = None, training: bool = False,
                 call: Call | None = None) -> fx.GraphModule:
    """The module traced with every submodule's mode set to `training` (modes restored after),
    with the arguments in `fixed` (name -> None or a constant) traced as those values.

    Given the example `call`, branches on metadata are decided by its values, and a forward that
    fx cannot take as it is (a decorated one, one with *args/**kwargs) is traced through
    `bound_forward`. The decisions are in the result's meta["decided"].
    """
    modes = {m: m.training for m in module.modules()}
    module.train(training)
    arguments = None if call is None or call.arguments is None else fresh_inputs((), call.arguments)[1]
    tracer = SiteTracer(None if arguments is None else list(arguments.values()), bound_forward(module, arguments))
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:  # the global RNG as it was after the example values' run (autograd: see create_proxy)
        with torch.random.fork_rng(devices=cuda):
            graph = tracer.trace(module, concrete_args=fixed or None)
    finally:
        for m, mode in modes.items():
            m.training = mode
        decisions = tracer.example.decisions if tracer.example is not None else []
        # fx leaves its tracer in a reference cycle (Tracer.trace's recursive collect_tensor_attrs
        # closes over it): drop what it holds (the module, the example values) now, not when the
        # garbage collector runs.
        vars(tracer).clear()
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.target.removesuffix("_1") in (fixed or {}):
            node.target = node.target.removesuffix("_1")  # fx named it `name_1`: keep it callable by keyword
        elif fixed_argument_guard(node):
            name, value = FX_FIXED_MESSAGE.match(node.args[1]).groups()
            node.args = (node.args[0], f"{name} was {value} in the example inputs at conversion, and the converted "
                                       f"code takes only {value} there: convert with {name} in the example inputs "
                                       f"as you will pass it")
        elif node.op == "get_attr" and not node.users:
            graph.erase_node(node)  # read by a branch not taken (a fast path's checks): no site's weight use
    with COMPILING.held():
        traced = fx.GraphModule(module, graph, class_name=type(module).__name__)
    traced.meta["decided"] = decisions
    keep_read_containers(traced, module)
    return traced


FX_FIXED_MESSAGE = re.compile(r"(\w+) has been specialized to have value (.*) but got another value")  # fx's guard


def fixed_argument_guard(node: fx.Node) -> bool:
    """Whether the node is fx's guard of an argument traced as the example's None or constant."""
    return node.op == "call_function" and node.target in (torch._assert, _assert_is_none) and len(node.args) == 2 \
        and isinstance(node.args[1], str) and FX_FIXED_MESSAGE.fullmatch(node.args[1]) is not None


def keep_read_containers(traced: fx.GraphModule, module: nn.Module) -> None:
    """fx holds a traced submodule's children in bare nn.Module containers; a module whose class
    says READ_FROM_OUTSIDE_GRAPH (attributes that code outside the graph reads: an expanded MHA's
    batch_first, read by nn.TransformerEncoder) is put back as itself, holding the same children."""
    for name, sub in module.named_modules():
        if not name or not getattr(type(sub), "READ_FROM_OUTSIDE_GRAPH", False):
            continue
        parent, _, attr = name.rpartition(".")
        try:
            holder = traced.get_submodule(parent)
        except AttributeError:
            continue
        if isinstance(getattr(holder, attr, None), nn.Module):
            setattr(holder, attr, sub)


def bound_forward(module: nn.Module, arguments: dict | None):
    """The module's forward as a plain function of the arguments the example call bound, when fx
    cannot trace the forward as it is (None otherwise): a decorated forward (fx cannot see through
    functools.wraps wrappers of (*args, **kwargs)) or one with *args/**kwargs (fx makes them
    placeholders that cannot be unpacked). The function calls the forward, decorators and all,
    with its own parameters: the forward's, then the extra keyword arguments of the call (None
    by default, so a converted region is still called as the original was)."""
    forward = type(module).forward
    params = inspect.signature(forward).parameters
    varying = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    if arguments is None or not (varying or hasattr(forward, "__wrapped__")):
        return None
    names = list(arguments)
    own = {name: p for name, p in params.items() if name in arguments}
    defaults = [own[n].default if n in own and own[n].default is not inspect.Parameter.empty else None
                for n in names]
    first_default = next((i for i, n in enumerate(names) if n not in own or own[n].default is not
                          inspect.Parameter.empty), len(names))
    source = (f"def make(forward):\n"
              f"    def forward_of_call(self, {', '.join(names)}):\n"
              f"        return forward(self, {', '.join(f'{n}={n}' for n in names)})\n"
              f"    return forward_of_call\n")
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - a signature made of the forward's own parameter names
    made = namespace["make"](forward)
    # The forward's module globals: fx patches wrapped functions (SpTr ops) in the traced code's globals.
    return types.FunctionType(made.__code__, inspect.unwrap(forward).__globals__, "forward",
                              tuple(defaults[first_default:]) or None, made.__closure__)


def branches_on_training(module: nn.Module, graph: fx.GraphModule, fixed: dict | None = None,
                         call: Call | None = None) -> bool:
    """Whether the module's traced code differs between train and eval mode, guards of decided
    branches aside (torch's encoder layer checks src.is_nested in eval mode only); a module that
    does not trace in train mode differs."""
    try:
        in_training = trace_module(module, fixed, training=True, call=call)
    except Exception:  # noqa: BLE001 (the model's own code raised, in train mode only)
        return True
    differs = code_without_guards(in_training) != code_without_guards(graph)
    release_graph(in_training)
    return differs


def code_without_guards(gm: fx.GraphModule) -> str:
    graph = fx.Graph(owning_module=gm)  # a copy of the nodes (eliminate_dead_code asks the module)
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (decided, decided_length, decided_keys):
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.owning_module = None  # the copy's nodes are a reference cycle: they must not keep gm (see release_graph)
    return graph.python_code("self").src


def release_graph(gm: fx.GraphModule) -> None:
    """Let a GraphModule that is no longer used go as soon as nothing refers to it. It and its
    Graph refer to each other (graph.owning_module), so it would otherwise stay, with the modules
    it holds (the weights of the sites a conversion replaced), until the garbage collector runs.
    What stays in a cycle then is the graph's nodes, which hold metadata, not tensors."""
    gm.graph.owning_module = None
