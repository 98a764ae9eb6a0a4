"""Move the activation that makes a converted layer's input into the layer, where its quantizer
computes it (registry.TakesActivation: an FP8 layer with a scale per row of x).

Quantizing x = act(h) [* up] per row needs each row's amax before the cast. Inductor fuses the
activation and the quantization, but past 1024 values a row its reduction loops over the row
twice and computes the activation twice (ViT-L's GELU and fc2's quantization: 188 us a layer on
an H200; Llama-8B's SiLU * up and down_proj's: 602 us). The layer's own kernel holds a row (up to
16384 values) in registers and reads h (and up) once (276 us at Llama-8B's).

In the graph that calls a converted layer (its region's rewritten graph, else its parent module
traced alone here, unless the parent is the model itself) the pass finds x = act(h), act(h) * up
or up * act(h), act SiLU or GELU (erf), a Dropout of p = 0 allowed after it, each step read by
nothing else, and makes the call layer(h, activation=act, up=up). A parent traced here (once) is
replaced by its graph, a GraphModule with the same submodules, so the same state dict. Convert and
load both run the pass after rewrite.
"""
from __future__ import annotations

import operator
import traceback

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lowconv.kernels.fp8 import ACTIVATIONS
from lowconv.ops.registry import TakesActivation
from lowconv.passes.rewrite import keep_buffers_out_of_state_dict, swap_module
from lowconv.passes.tracer import recompile, release_graph, stand_ins

MULTIPLIES = (operator.mul, torch.mul)
NAMES = {"silu": "SiLU", "gelu": "GELU"}
FUSED_NOTE = "computed in its quantization kernel (fuse_activation.py)"  # the plan's note, after what moved


def fuse_activations(model: nn.Module, modules: dict[str, nn.Module]) -> tuple[nn.Module, dict[str, str]]:
    """(the model, fqn -> what moved into that layer: "SiLU", "SiLU * up", ...) for the converted
    `modules` (fqn -> op module) that take an activation."""
    fused, traced = {}, {}  # traced: parent fqn -> its graph (None: it did not trace), each traced once
    for fqn, module in modules.items():
        if not (isinstance(module, TakesActivation) and module.takes_activation()):
            continue
        caller = caller_graph(model, fqn, modules, traced)
        if caller is None:
            continue
        owner, gm, target = caller
        moved = [fuse_call(gm, node) for node in list(gm.graph.nodes)
                 if node.op == "call_module" and node.target == target]  # each call on its own
        moved = [what for what in moved if what]
        if not moved:
            continue
        gm.graph.lint()
        gm.delete_all_unused_submodules()  # the activation's (and a Dropout's) module
        recompile(gm)
        if (model.get_submodule(owner) if owner else model) is not gm:
            model = swap_module(model, owner, gm)
        fused[fqn] = moved[0]
    held = {id(m) for m in model.modules()}
    for gm in traced.values():
        if gm is not None and id(gm) not in held:
            release_graph(gm)  # a parent traced for nothing: no cycle left to the garbage collector
    return model, fused


def restore_activation(model: nn.Module, fqn: str) -> None:
    """Undo fuse_call for the layer at `fqn` (lowconv.revert puts an nn.Linear there): the calls
    that pass it an activation get act(h) [* up] computed before them again."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        gm = model.get_submodule(".".join(parts[:i])) if i else model
        target = ".".join(parts[i:])
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == target
                 and "activation" in n.kwargs] if isinstance(gm, fx.GraphModule) else []
        for call in calls:
            with gm.graph.inserting_before(call):
                x = gm.graph.call_function(ACTIVATIONS[call.kwargs["activation"]], call.args)
                if "up" in call.kwargs:
                    x = gm.graph.call_function(operator.mul, (x, call.kwargs["up"]))
            call.args, call.kwargs = (x,), {}
        if calls:
            recompile(gm)
            return


def caller_graph(model: nn.Module, fqn: str, modules: dict[str, nn.Module], traced: dict):
    """(owner fqn, GraphModule, the layer's target in it) of the graph that calls the layer: a
    GraphModule above it whose graph calls it, else its parent traced alone (kept in `traced`);
    None where the parent is the model or does not trace."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:i])
        gm = model.get_submodule(owner) if owner else model
        target = ".".join(parts[i:])
        if isinstance(gm, fx.GraphModule) and any(n.op == "call_module" and n.target == target for n in gm.graph.nodes):
            return owner, gm, target
    parent_fqn = ".".join(parts[:-1])
    if not parent_fqn:  # the model keeps its own class (an nn.Sequential stays subscriptable)
        return None
    if parent_fqn not in traced:
        traced[parent_fqn] = traced_alone(model.get_submodule(parent_fqn), modules)
    return None if traced[parent_fqn] is None else (parent_fqn, traced[parent_fqn], parts[-1])


def traced_alone(parent: nn.Module, modules: dict[str, nn.Module]) -> fx.GraphModule | None:
    """`parent`'s forward as a GraphModule, the converted modules kept as calls; None where it does not trace."""
    tracer = LeafTracer({id(m) for m in modules.values()})
    try:
        graph = tracer.trace(parent)
    except Exception as error:  # noqa: BLE001 - a parent that does not trace keeps its forward
        traceback.clear_frames(error.__traceback__)  # their locals would hold tensors in reference cycles
        return None
    finally:
        vars(tracer).clear()  # fx leaves its tracer in a reference cycle, holding the module (tracer.py trace_module)
    gm = fx.GraphModule(parent, graph, class_name=type(parent).__name__)
    gm.train(parent.training)
    keep_buffers_out_of_state_dict(gm, parent)
    return gm


class LeafTracer(fx.Tracer):
    """fx's tracer, with the converted op modules kept as calls."""

    def __init__(self, leaves: set[int]):
        super().__init__()
        self.leaves = leaves

    def trace(self, root, concrete_args=None):
        with stand_ins():  # fx's Proxy.__iter__ would keep its frames, and the model, in a reference cycle
            return super().trace(root, concrete_args)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def fuse_call(gm: fx.GraphModule, call: fx.Node) -> str | None:
    """Make `call` layer(h, activation=..., up=...) where its one argument is act(h) [* up] read by
    it alone; what moved ("SiLU * up"), or None where the graph has no such pattern."""
    if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], fx.Node):
        return None
    dead, x = [], call.args[0]
    while only_reader(x, call if not dead else dead[-1]) and is_identity(gm, x):
        dead.append(x)
        x = x.args[0]
    reader = dead[-1] if dead else call
    if not only_reader(x, reader):
        return None
    activation, up = activation_of(gm, x), None
    if activation is None and is_multiply(x):
        for act, other in (x.args, x.args[::-1]):
            if isinstance(other, fx.Node) and only_reader(act, x) and activation_of(gm, act):
                dead.append(x)
                x, up, activation = act, other, activation_of(gm, act)
                break
    if activation is None or not isinstance(x.args[0], fx.Node):
        return None
    call.args = (x.args[0],)
    call.kwargs = {"activation": activation, **({"up": up} if up is not None else {})}
    for node in [*dead, x]:  # from the call outward: each was read only by the one erased before it
        gm.graph.erase_node(node)
    return NAMES[activation] + (" * up" if up is not None else "")


def only_reader(node, reader: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_module", "call_function", "call_method") \
        and list(node.users) == [reader]


def is_identity(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A Dropout of p = 0 or an Identity module between the activation and the layer."""
    if node.op != "call_module" or len(node.args) != 1:
        return False
    module = gm.get_submodule(node.target)
    return type(module) is nn.Identity or (isinstance(module, nn.Dropout) and module.p == 0)


def is_multiply(node: fx.Node) -> bool:
    return len(node.args) == 2 and not node.kwargs and ((node.op == "call_function" and node.target in MULTIPLIES)
                                                        or (node.op == "call_method" and node.target == "mul"))


def activation_of(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """"silu" or "gelu" where the node computes one of them of its one argument, as torch does."""
    if len(node.args) != 1:
        return None
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) is nn.SiLU and not module.inplace:
            return "silu"
        if type(module) is nn.GELU and module.approximate == "none":
            return "gelu"
        return None
    if node.op != "call_function":
        return None
    if node.target is F.silu and not node.kwargs.get("inplace", False):
        return "silu"
    if node.target is F.gelu and node.kwargs.get("approximate", "none") == "none":
        return "gelu"
    return None
