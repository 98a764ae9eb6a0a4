"""Control flow that tracing decides from the example inputs, and the guards that keep it honest.

torch.fx traces with Proxies, which have no values: `if q.shape[2] > 1`, `cos, sin = pair`,
`len(args)` or `f(**kwargs)` stop it. Real model code (Hugging Face's attention functions, their
masking and rotary helpers) is full of such branches on shapes, dtypes, flags and argument
structure. When the region's example arguments are known, ExampleValues computes every traced
node's value beside the trace, so the tracer can take the branch the example takes.

Only decisions on metadata are taken: shapes, dtypes, Python flags and containers, never on
tensor data (`if mask.all()`, `x.sum().item() > 0`): a value computed from tensor data is
tainted, and a branch on it still stops the trace, which then falls back to the submodules (a
branch on the example's padding must not be frozen into the converted model). Each decision
becomes a guard in the graph (`decided`, `decided_length`): the converted region raises, naming
the line of code, when it is called with inputs that would branch the other way.
"""
from __future__ import annotations

import builtins
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

MISSING = object()  # a node whose value is not known (it failed to evaluate, or no values)

# What reads a tensor's metadata, not its data: a branch on these may be decided.
METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "is_sparse", "layout", "requires_grad",
                       "is_floating_point", "is_complex", "is_meta", "is_nested", "is_quantized"}
METADATA_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
                    "is_complex", "is_contiguous", "get_device", "stride"}
METADATA_FUNCTIONS = {torch.is_floating_point, torch.is_complex, torch.numel}  # torch.nn.functional's mask checks
# Frames of these files are tracing machinery, not the model's code that branched.
MACHINERY = (os.path.dirname(fx.__file__), os.path.dirname(os.path.dirname(__file__)))


def decided(value, expected: bool, where: str) -> None:
    """The guard of a branch decided at trace time (a graph node: runs on every call). A branch,
    not `bool(value) != expected`: under torch.compile with dynamic shapes value is a SymBool,
    which dynamo compares with a bool as a sympy expression that fails."""
    if (not value) if expected else value:
        raise AssertionError(f"{where}: this branch was decided as {expected} by the example inputs at "
                             f"conversion; these inputs take the other branch: convert with inputs like them")


def decided_length(value, expected: int, where: str) -> None:
    """The guard of an iteration or len() decided at trace time."""
    if len(value) != expected:
        raise AssertionError(f"{where}: the length {expected} was fixed by the example inputs at conversion; "
                             f"these inputs have length {len(value)}: convert with inputs like them")


def decided_keys(value, expected: tuple, where: str) -> None:
    """The guard of a `**mapping` whose keys were fixed at trace time."""
    if tuple(value) != expected:
        raise AssertionError(f"{where}: the keys {list(expected)} were fixed by the example inputs at conversion; "
                             f"these inputs have {list(value)}: convert with inputs like them")


torch.fx.wrap("decided")  # stays one call in a retrace of the converted graph
torch.fx.wrap("decided_length")
torch.fx.wrap("decided_keys")


@dataclass
class ExampleValues:
    """The value of each traced node on the example arguments, and the decisions taken from them.

    A node's value is kept while a proxy of it lives (`watch`): the traced code can give a node
    new users only through its proxies, so once they are gone its value is never read again, and
    is dropped as a forward drops its intermediate tensors. The values held are then those the
    traced code still holds, not every node's for the whole trace.
    """

    arguments: list  # the traced forward's arguments, in placeholder order
    placeholders_seen: int = 0
    values: dict = field(default_factory=dict)  # fx.Node -> value, while a proxy of it lives
    tainted: set = field(default_factory=set)  # nodes whose value was computed from tensor data
    decisions: list[str] = field(default_factory=list)  # "file:line: what was decided", in trace order
    proxies: dict = field(default_factory=dict)  # fx.Node -> how many of its proxies live
    watchers: list = field(default_factory=list)  # weak references to the proxies, whose callbacks count them

    def evaluate(self, node: fx.Node, root: torch.nn.Module) -> None:
        """Compute `node`'s value from its inputs' (MISSING when any is unknown, or it fails)."""
        if node.op == "placeholder":
            self.values[node] = self.arguments[self.placeholders_seen]
            self.placeholders_seen += 1
            return
        try:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.known)
            value = run_node(node, root, args, kwargs)
        except Exception:  # noqa: BLE001 - an unknown value only means no branch on it can be decided
            value = MISSING
        self.values[node] = value
        inputs = node.all_input_nodes
        if any(n in self.tainted for n in inputs) or (
                not holds_tensors(value) and not reads_metadata(node)
                and any(holds_tensors(self.value(n)) for n in inputs)):
            self.tainted.add(node)  # plain Python values read out of tensor data (.item(), .tolist())

    def watch(self, proxy: fx.Proxy) -> None:
        """Keep the value of the proxy's node while this proxy, or another of the node's, lives.
        (The callback holds the counts and values, not self: no reference cycle.)"""
        node, values, proxies = proxy.node, self.values, self.proxies

        def gone(_):
            proxies[node] -= 1
            if not proxies[node]:
                values.pop(node, None)

        proxies[node] = proxies.get(node, 0) + 1
        self.watchers.append(weakref.ref(proxy, gone))

    def value(self, node: fx.Node):
        """The node's value, MISSING when it is unknown. An attribute read (`x.shape`, `x.T`) is
        read again from its object when its value was dropped: fx's Attribute proxy keeps the
        node once made but not a proxy of it, and its object's proxy lives as long as it does."""
        value = self.values.get(node, MISSING)
        if value is MISSING and node not in self.values and is_attribute_read(node):
            try:
                return getattr(*fx.node.map_arg(node.args, self.known))
            except Exception:  # noqa: BLE001 - as in evaluate
                return MISSING
        return value

    def known(self, node: fx.Node):
        value = self.value(node)
        if value is MISSING:
            raise LookupError(node.name)
        return value

    def decidable(self, proxy: fx.Proxy):
        """The proxy's value when a branch may be decided on it, else MISSING."""
        value = self.value(proxy.node)
        if proxy.node in self.tainted or isinstance(value, torch.Tensor):
            return MISSING
        return value


def is_attribute_read(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is builtins.getattr


def run_node(node: fx.Node, root: torch.nn.Module, args: tuple, kwargs: dict):
    if node.op == "get_attr":
        value = root
        for name in node.target.split("."):
            value = getattr(value, name)
        # A buffer that code may update in place (F.batch_norm's running statistics when traced in
        # train mode) is read as a copy: the example run leaves the model as it was.
        return value.clone() if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) else value
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        training = module.training
        module.eval()  # a leaf run for its value only: no statistics updated, no dropout
        try:
            return module(*args, **kwargs)
        finally:
            module.train(training)
    return MISSING


def holds_tensors(value) -> bool:
    """A tensor, or a container with a tensor in it (a split's chunks, a (cos, sin) pair)."""
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def reads_metadata(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is builtins.getattr:
        return node.args[1] in METADATA_ATTRIBUTES
    if node.op == "call_function":
        return node.target in METADATA_FUNCTIONS
    return node.op == "call_method" and node.target in METADATA_METHODS


def code_location() -> str:
    """file:line of the model code that is being traced at this moment (the innermost frame
    outside torch.fx and lowconv)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(MACHINERY):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


def short_path(path: str) -> str:
    """A source path from its package on (site-packages/transformers/x.py -> transformers/x.py)."""
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return "/".join(parts[-2:])
