"""A rel_idx column that a split function rewrites (SphereFormer's exponential split of the radial
axis), read as buckets of a per-pair difference:

    rel_idx[:, axis] = base + #{t in thresholds : t <= s[index_0] - s[index_1]}

for a per-point float tensor s. SpTr calls `split_func(xyz, index_0, index_1, rel_idx.clone())`,
which writes one column in place, and then clamps and casts; a trace records

    c = rel_idx.clone();  c[:, axis] = f(s[index_0] - s[index_1]);  ... c.clamp(lo, hi).int()

The pass takes f as the nodes between the difference and the written value, runs them, with the
cast into c's dtype and the clamps and casts after the write, on floats of the difference's dtype,
and finds where the result steps up by searching the floats in their order: each threshold is the
least float at which the bucket grows, so the buckets are exact for every float where f is a
non-decreasing step function of the difference (SphereFormer's log2 buckets are), up to
|d| = 2**24. That is checked on a grid over that range and around each threshold; a split that fails
it is kept, with why.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from lowconv.passes.fx_nodes import CLAMP_METHODS, CLAMPS, INT_CASTS, SUBS, casts, mutates, op_is, uncast
from lowconv.site import tensor_meta

# The float dtypes whose order the thresholds are searched in, with the unsigned ints of their width.
UINTS = {torch.float16: np.uint16, torch.float32: np.uint32, torch.float64: np.uint64}
NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
# The differences the buckets are exact for: |d| <= 2**24, any point cloud's in metres or voxels.
# Far beyond, a split's own arithmetic overflows (a cast to int64 of d / quant, or SphereFormer's
# (|d| + 2a) / a near 4e36 in float32) and its buckets are no step function there.
DOMAIN = 2.0 ** 24
MAX_BUCKETS = 255  # the window kernel's tables have at most 2 * 128 - 1 rows
SEARCH_POINTS = 1024  # floats tried per step of the search for a threshold
GRID_POINTS = 1 << 16  # floats, evenly spaced in their order, on which the buckets are checked


@dataclass
class RelIdxSplit:
    base: fx.Node  # rel_idx before the split function rewrote it
    axis: int
    values: fx.Node  # s (N,), the per-point tensor whose pair differences are bucketed
    first: int  # the bucket of the least difference
    thresholds: tuple[float, ...]  # non-decreasing: a bucket more at each
    outer: list[fx.Node]  # the casts and clamps of the rewritten rel_idx, outermost first
    nodes: list[fx.Node]  # what computes the rewritten column from s and the index tensors

    @property
    def last(self) -> int:
        """The bucket of the largest difference: the tables need last + 1 rows."""
        return self.first + len(self.thresholds)


def rel_idx_split(rel_idx, index_0, index_1) -> RelIdxSplit | str | None:
    """rel_idx read as a split function's rewrite of one column (see the module doc); None where it
    is no such rewrite (no clone written in place under its casts and clamps), else why it cannot be
    read."""
    outer, node = [], rel_idx
    while op_is(node, CLAMPS, CLAMP_METHODS + INT_CASTS):
        outer.append(node)
        node = node.args[0]
    writes = [user for user in node.users if mutates(user)] if op_is(node, (), ("clone",)) else []
    if not writes:
        return None
    if len(writes) > 1 or writes[0].target is not operator.setitem:
        return "a split function changes rel_idx in place other than by writing one column"
    write = writes[0]
    _, index, value = write.args
    axis = column_of(index)
    if axis is None:
        return f"a split function writes rel_idx at {index!r}, not at one whole column [:, a]"
    if outer and set(node.users) != {write, outer[-1]}:
        return "the rel_idx a split function rewrote is also read before its clamps and casts"
    cone = pair_function(value, index_0, index_1)
    if isinstance(cone, str):
        return cone
    differences, between, inputs = cone
    values = differences[0].args[0].args[0]
    meta, values_meta, target = tensor_meta(differences[0]), tensor_meta(values), tensor_meta(node)
    if meta is None or values_meta is None or target is None:
        return "the split's shapes and dtypes are not known (shapes were not propagated)"
    if len(values_meta.shape) != 1:
        return f"the split buckets differences of a {len(values_meta.shape)}-D tensor, not of one value per point"
    dtype = getattr(torch, meta.dtype)
    if dtype not in UINTS:
        return f"the split buckets a difference of {meta.dtype} values, not of float16, float32 or float64"
    function = column_function(differences, between, value, getattr(torch, target.dtype), node, outer)
    try:
        buckets = bucket_thresholds(function, dtype)
    except Exception as error:  # the split's own ops refuse a column of differences alone
        return f"the split function's column could not be computed alone: {type(error).__name__}: {error}"
    if isinstance(buckets, str):
        return buckets
    first, thresholds = buckets
    return RelIdxSplit(node.args[0], axis, values, first, thresholds, outer,
                       [*outer, node, write, *between, *differences, *inputs])


def column_of(index) -> int | None:
    """a for an index [:, a] (a in 0..2), else None."""
    if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
            and isinstance(index[1], int) and not isinstance(index[1], bool) and 0 <= index[1] < 3):
        return index[1]
    return None


def pair_function(value, index_0, index_1):
    """How `value` is computed from differences s[index_0] - s[index_1] of one per-point tensor s
    and from numbers alone: (the difference nodes, the nodes from them to value, the differences'
    getitems and index casts), each in graph order; else why not."""
    differences, between, to_visit = set(), set(), [value]
    while to_visit:
        node = to_visit.pop()
        if node in between or node in differences:
            continue
        if is_difference(node, index_0, index_1):
            differences.add(node)
            continue
        if is_difference(node, index_0, index_1, same=False):
            return ("the column a split function writes reads s[index_0] - t[index_1] of two different "
                    "per-point tensors, not the difference of one")
        if node.op not in ("call_function", "call_method"):
            return (f"the column a split function writes is computed from {node.op} `{node.target}`, not "
                    "from differences s[index_0] - s[index_1] of per-point values alone")
        between.add(node)
        to_visit += node.all_input_nodes
    if not differences:
        return "the column a split function writes reads no difference s[index_0] - s[index_1]"
    values = next(iter(differences)).args[0].args[0]
    if not all(same_value(values, g.args[0]) for d in differences for g in d.args):
        return "the column a split function writes reads differences of more than one per-point tensor"
    if any(mutates(user) and user.args[0] is node and user not in between for node in between for user in node.users):
        return "a tensor the split function computes is changed in place"
    getitems = [g for d in differences for g in d.args]
    inputs = [*getitems, *(cast for g in getitems for cast in casts(g.args[1]))]
    return sorted(differences), sorted(between), sorted(set(inputs))


def is_difference(node, index_0, index_1, same=True) -> bool:
    """Whether node is s[index_0] - s[index_1] (the index tensors with any integer casts); with
    `same` False, s[index_0] - t[index_1] of another tensor t."""
    if not (op_is(node, SUBS) and not node.kwargs and len(node.args) == 2
            and all(op_is(a, (operator.getitem,)) for a in node.args)):
        return False
    (s, i), (s_k, j) = (a.args for a in node.args)
    return isinstance(s, fx.Node) and same_value(s, s_k) == same and uncast(i) is uncast(index_0) \
        and uncast(j) is uncast(index_1)


def same_value(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes are one value: the same node, or one getitem of one tensor made twice
    (a split function's `xyz[:, 2][index_0] - xyz[:, 2][index_1]`)."""
    return a is b or (op_is(a, (operator.getitem,)) and op_is(b, (operator.getitem,))
                      and a.args == b.args and not a.kwargs and not b.kwargs)


def column_function(differences, between, value, column_dtype, clone, outer) -> fx.GraphModule:
    """A module d -> the rewritten column's entries at differences d: the nodes from the differences
    to the written value, the value cast to the column's dtype (as the write casts it), then the
    clamps and casts that follow the write, innermost first."""
    graph = fx.Graph()
    d = graph.placeholder("d")
    env = dict.fromkeys(differences, d)
    for node in between:
        env[node] = graph.node_copy(node, env.__getitem__)
    env[clone] = graph.call_method("to", (env[value], column_dtype))
    for node in reversed(outer):
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[outer[0] if outer else clone])
    return fx.GraphModule(torch.nn.Module(), graph)


def bucket_thresholds(function, dtype) -> tuple[int, tuple[float, ...]] | str:
    """(first, thresholds) with function(d) == first + #{t in thresholds : t <= d} for every d of
    `dtype` with |d| <= DOMAIN, else why not."""
    order = FloatOrder(dtype)

    def buckets(keys) -> np.ndarray:
        d = torch.from_numpy(order.floats(np.asarray(keys)))
        out = function(d)
        if not isinstance(out, torch.Tensor) or out.shape != d.shape or (
                out.is_floating_point() and not torch.equal(out, out.round())):
            raise ValueError("it does not give one whole number per difference")
        return out.long().numpy()

    first, last = (int(b) for b in buckets([-order.top, order.top]))
    if not 0 <= first <= last <= first + MAX_BUCKETS:
        return (f"the split's buckets run from {first} to {last} over differences of +-2**24; table rows "
                f"are 0 to at most {MAX_BUCKETS}")
    thresholds, low, level = [], -order.top, first
    while level < last:
        high = first_above(buckets, low, order.top, level)
        above = int(buckets([high])[0])
        thresholds += [float(order.floats(np.array([high]))[0])] * (above - level)
        low, level = high, above
    keys = order.keys(thresholds)
    grid = np.unique(np.concatenate([np.linspace(-order.top, order.top, GRID_POINTS).astype(np.int64),
                                     keys - 1, keys, keys + 1]))
    grid = grid[(grid >= -order.top) & (grid <= order.top)]
    expected = first + np.searchsorted(keys, grid, side="right")
    if not np.array_equal(buckets(grid), expected):
        return "the split is not a non-decreasing step function of the difference s[index_0] - s[index_1]"
    return first, tuple(thresholds)


def first_above(buckets, low: int, high: int, level: int) -> int:
    """The least order key in (low, high] whose bucket exceeds level (high's does)."""
    while high - low > 1:
        keys = np.unique([low + (high - low) * i // SEARCH_POINTS for i in range(1, SEARCH_POINTS + 1)])
        above = int(np.flatnonzero(buckets(keys) > level)[0])
        high, low = int(keys[above]), (int(keys[above - 1]) if above else low)
    return high


class FloatOrder:
    """The floats of a dtype in [-DOMAIN, DOMAIN] as whole numbers in their order ("keys"): a
    float's key is the magnitude of its bits, negated for a negative float (-0.0 is 0.0's key)."""

    def __init__(self, dtype: torch.dtype):
        self.floats_type, self.uints = NUMPY_FLOATS[dtype], UINTS[dtype]
        self.sign = 1 << (8 * np.dtype(self.uints).itemsize - 1)
        self.top = int(self.keys([min(float(np.finfo(self.floats_type).max), DOMAIN)])[0])

    def floats(self, keys: np.ndarray) -> np.ndarray:
        keys = keys.astype(np.int64)
        bits = np.where(keys < 0, (-keys).astype(np.uint64) | np.uint64(self.sign), keys.astype(np.uint64))
        return bits.astype(self.uints).view(self.floats_type)

    def keys(self, values) -> np.ndarray:
        bits = np.asarray(values, self.floats_type).view(self.uints).astype(np.uint64)
        magnitude = (bits & np.uint64(self.sign - 1)).astype(np.int64)
        return np.where(bits & np.uint64(self.sign), -magnitude, magnitude)
