"""Attention masks: what kind a mask is (bool and kept, or added), whether a masked_fill/where
fill masks, and whether a mask is a causal one that `causal=True` can replace.

Shapes, when shape propagation left them, decide an SDPA mask's kind: a bool mask keeps (True
attends), any other is added. Without shapes an SDPA mask is taken as bool only when the graph
visibly makes it so (comparisons, logical ops, `~`, `.bool()`, bool factories or buffers, and
shape ops or tril/triu of those), and as additive otherwise.

A mask that is a top-left slice of a lower-triangular constant (nanoGPT's
`self.bias[:, :, :T, :T] == 0`) is recognized from the constant's value and becomes
causal=True. That the slice covers the whole score matrix is checked on the shapes; without
shapes it is assumed when rows and columns are sliced to the same length.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import reduce

import torch
import torch.fx as fx

from lowconv.passes.fx_nodes import is_number, is_slice, op_is
from lowconv.passes.trace import Region
from lowconv.site import tensor_meta

# A masked_fill/where fill at or below this is a mask: exp() of it is 0 in every float dtype.
# (A finite fill differs from -inf only on rows where every key is masked.)
LARGE_NEGATIVE = -1e4
COMPARISONS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
               torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge)
COMPARISON_METHODS = ("eq", "ne", "lt", "le", "gt", "ge")
# Elementwise ops that a causal mask may apply to its lower-triangular constant.
MASK_OPS = COMPARISONS + (operator.invert, torch.logical_not)
MASK_METHODS = COMPARISON_METHODS + ("logical_not", "bool", "float", "to")
# Ops whose result is bool, and ops whose result has their first argument's dtype.
BOOL_OPS = MASK_OPS + (torch.logical_and, torch.logical_or, torch.logical_xor)
BOOL_METHODS = COMPARISON_METHODS + ("bool", "logical_not", "logical_and", "logical_or",
                                     "logical_xor")
SAME_DTYPE_OPS = (operator.getitem, operator.and_, operator.or_, operator.xor, torch.tril,
                  torch.triu, torch.reshape, torch.unsqueeze, torch.squeeze, torch.transpose,
                  torch.permute, torch.broadcast_to)
SAME_DTYPE_METHODS = ("view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze",
                      "transpose", "permute", "contiguous", "repeat", "flatten", "tril", "triu",
                      "clone", "logical_and", "logical_or")
FACTORIES = (torch.ones, torch.zeros, torch.empty, torch.full, torch.ones_like,
             torch.zeros_like, torch.empty_like, torch.full_like, torch.tensor)


@dataclass
class Mask:
    node: fx.Node
    kind: str  # "additive" | "keep" | "drop"
    scaled: bool = False  # the scores are scaled after this mask is applied


def causal_chain(region: Region, mask: Mask, scores_shape) -> list[fx.Node] | None:
    """The nodes that make `mask` when it is a top-left slice of a lower-triangular constant,
    so that causal=True says all it says; else None."""
    chain, node, index = [], mask.node, None
    while node.op != "get_attr":
        if is_slice(node) and index is None:
            index = node.args[1]
        elif not is_mask_op(node):
            return None
        chain.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    value = reduce(getattr, node.target.split("."), region.graph)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if index is not None and not is_top_left_slice(index, value.dim()):
        return None
    with torch.no_grad():
        for op in reversed(chain):  # elementwise ops commute with the slice: apply them whole
            if op.target is not operator.getitem:
                value = apply(op, value)
    allowed = allowed_by(value, mask.kind)
    if allowed is None or not torch.equal(allowed, torch.ones_like(allowed).tril()):
        return None
    meta = tensor_meta(mask.node)
    if meta and scores_shape:
        covers = meta.shape[-2:] == tuple(scores_shape[-2:])
    elif index is not None:
        rows, cols = index[-2].stop, index[-1].stop
        covers = rows is cols or (not isinstance(rows, fx.Node) and rows == cols)
    else:
        covers = value.shape[-2] == value.shape[-1]
    return [*chain, node] if covers else None


def allowed_by(value: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Where a mask of `kind` with this value lets a query attend (None: not a plain mask)."""
    if kind in ("keep", "drop") and value.dtype == torch.bool:
        return value if kind == "keep" else ~value
    if kind == "additive" and value.is_floating_point():
        if ((value == 0) | (value <= LARGE_NEGATIVE)).all():
            return value == 0
    return None


def is_top_left_slice(index, ndim: int) -> bool:
    """Whether `index` takes [:a, :b] of a tensor's last two dims."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis not in index and sum(i is not None for i in index) != ndim:
        return False
    return all(isinstance(s, slice) and s.start in (None, 0) and s.step in (None, 1)
               for s in index[-2:])


def is_mask_op(node: fx.Node) -> bool:
    """An elementwise op of its first argument with constant other arguments."""
    constants = not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))
    return op_is(node, MASK_OPS, MASK_METHODS) and constants


def apply(node: fx.Node, value: torch.Tensor) -> torch.Tensor:
    if node.op == "call_method":
        return getattr(value, node.target)(*node.args[1:], **node.kwargs)
    return node.target(value, *node.args[1:], **node.kwargs)


def looks_boolean(region: Region, node) -> bool:
    """Whether the graph visibly makes `node` a bool tensor (see the module docstring)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        value = reduce(getattr, node.target.split("."), region.graph)
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool
    if op_is(node, BOOL_OPS, BOOL_METHODS):
        return True
    if op_is(node, FACTORIES, ("to", "type")):
        return any(a is torch.bool for a in (*node.args[1:], *node.kwargs.values()))
    if op_is(node, SAME_DTYPE_OPS, SAME_DTYPE_METHODS):
        return looks_boolean(region, node.args[0])
    return False


def is_mask_fill(value) -> bool:
    """Whether a masked_fill/where fill is -inf or a large negative number (a constant, or a
    `torch.full`/`torch.tensor` of one)."""
    if isinstance(value, fx.Node) and value.op == "call_function" and value.target in (
            torch.full, torch.tensor):
        value = value.args[-1] if value.target is torch.full else value.args[0]
    return is_number(value) and value <= LARGE_NEGATIVE
