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

A bool mask that ANDs a causal comparison of index ranges with other masks (Hugging Face's
sdpa_mask: `kv_idx <= q_idx` with q_idx, kv_idx `arange(n) + offset` along the scores' rows and
columns, and the padding mask) becomes causal=True and the other mask, when the offsets are the
same constant (no KV cache: top-left aligned, as causal=True is) and the comparison has the
scores' rows and columns (checked on the shapes; without shapes it is left a mask).
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
# (A finite fill differs from -inf only on rows where every key is masked: their scores are all
# the fill, and the softmax averages v; Mask.finite_fill tells the op.)
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
    finite_fill: bool = False  # keep/drop: the masked scores are set to a finite value, not -inf


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


def causal_part(region: Region, mask: Mask, scores_shape) -> tuple[Mask | None, list[fx.Node]] | None:
    """(what is left of `mask` once causal=True says its causal part, None when nothing is; the
    nodes only that part needs) when it has one, else None."""
    chain = causal_chain(region, mask, scores_shape)
    if chain is not None:
        return None, chain
    return causal_conjunct(mask, scores_shape)


def causal_conjunct(mask: Mask, scores_shape) -> tuple[Mask | None, list[fx.Node]] | None:
    """A keep mask `[expand(] causal & [other] [)]` (see the module docstring): (the other mask,
    the nodes of the rest), or None."""
    if mask.kind != "keep" or scores_shape is None:
        return None
    node, nodes = mask.node, []
    if op_is(node, (), ("expand",)):  # only broadcasts: the other mask broadcasts as well
        nodes.append(node)
        node = node.args[0]
    terms, ands = conjuncts(node)
    causal = [t for t in terms if is_causal_comparison(device_moved(t), scores_shape)]
    rest = [t for t in terms if t not in causal and not is_all_true(t)]
    if len(causal) != 1 or len(rest) > 1:
        return None
    nodes += [*ands, *(t for t in terms if t not in rest), device_moved(causal[0])]
    return (Mask(rest[0], "keep", finite_fill=mask.finite_fill) if rest else None), nodes


def conjuncts(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the terms of `a & b & ...`, the and nodes)."""
    if op_is(node, (operator.and_, torch.logical_and), ("logical_and",)) and len(node.args) == 2:
        (left, left_ands), (right, right_ands) = (conjuncts(a) for a in node.args)
        return [*left, *right], [node, *left_ands, *right_ands]
    return [node], []


def device_moved(node: fx.Node) -> fx.Node:
    """x when `node` is x.to(y.device), else node."""
    if op_is(node, (), ("to",)) and not node.kwargs and len(node.args) == 2:
        device = node.args[1]
        if isinstance(device, fx.Node) and op_is(device, (getattr,)) and device.args[1] == "device":
            return node.args[0]
    return node


def is_all_true(node: fx.Node) -> bool:
    """`x.new_ones((), dtype=torch.bool)`: and_masks' start."""
    return (op_is(node, (), ("new_ones",)) and node.args[1:] in (((),), ([],))
            and node.kwargs == {"dtype": torch.bool})


def is_causal_comparison(node: fx.Node, scores_shape) -> bool:
    """`kv_idx <= q_idx` (or `q_idx >= kv_idx`) of index ranges along the scores' columns and
    rows with the same constant offset, over the scores' rows and columns."""
    if op_is(node, (operator.le, torch.le), ("le",)) and len(node.args) == 2:
        kv, q = node.args
    elif op_is(node, (operator.ge, torch.ge), ("ge",)) and len(node.args) == 2:
        q, kv = node.args
    else:
        return False
    meta = tensor_meta(node)
    offsets = index_range_offset(q, -2), index_range_offset(kv, -1)
    return (None not in offsets and offsets[0] == offsets[1]
            and meta is not None and meta.shape[-2:] == tuple(scores_shape[-2:]))


def index_range_offset(node, dim: int) -> int | None:
    """c when `node` is `(arange(n) + c)` laid along `dim` (`[None, None, :, None]` for -2), with
    c a constant (0 when not added), else None."""
    if not (isinstance(node, fx.Node) and is_slice(node) and isinstance(node.args[1], tuple)):
        return None
    index = node.args[1]
    along = [i for i, s in enumerate(index) if s is not None]
    if along != [len(index) + dim] or index[along[0]] != slice(None):
        return None
    values, offset = node.args[0], 0
    if op_is(values, (operator.add,)) and isinstance(values.args[1], int) and not isinstance(values.args[1], bool):
        values, offset = values.args
    is_range = (isinstance(values, fx.Node) and values.op == "call_function" and values.target is torch.arange
                and (len(values.args) == 1 or len(values.args) == 2 and values.args[0] == 0)
                and set(values.kwargs) <= {"device"})
    return offset if is_range else None


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
    if op_is(node, FACTORIES, ("to", "type", "new_ones", "new_zeros", "new_full", "new_empty")):
        return any(a is torch.bool for a in (*node.args[1:], *node.kwargs.values()))
    if op_is(node, SAME_DTYPE_OPS, SAME_DTYPE_METHODS):
        return looks_boolean(region, node.args[0])
    return False


def mask_fill(value) -> float | None:
    """A masked_fill/where fill that masks: -inf or a large negative number (a constant, or a
    `torch.full`/`torch.tensor` of one); None for any other."""
    if isinstance(value, fx.Node) and value.op == "call_function" and value.target in (
            torch.full, torch.tensor):
        value = value.args[-1] if value.target is torch.full else value.args[0]
    return float(value) if is_number(value) and value <= LARGE_NEGATIVE else None


def zero_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Zeros of q @ k^T's shape, in q's dtype: what the attention pass replays a hand-written
    attention's masks and reshapes on, to compute the one mask they add (k may have fewer heads:
    GQA's k before its repeat)."""
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    return q.new_zeros((*batch, *q.shape[-3:-1], k.shape[-2]))
