"""Find SpTr windowed-attention chains (lowconv.compat.sptr, or a real SpTr install's ops, read as
their compat equivalents: compat/sptr_install.py) in a traced region.

    attn = attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    attn = scatter_softmax_csr(attn, index_0_offsets)
    out  = attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)

or, with contextual relative position, dot_prod_with_idx_all(q, ..., table_q, table_k, rel_idx,
n_max) and attention_step2_with_rel_pos_value(attn, v, ..., table_v, rel_idx), where rel_idx is
relative_position_index(xyz, index_0, index_1, window_size, quant_size, G, shift_win).

Real SpTr computes rel_idx inline instead (compat/sptr_install.py):

    rel_idx = (P[index_0.long()] - P[index_1.long()] + G - 1).int()

with P (N, 3) the points' whole-number quantized coordinates; that form is read too, its casts,
an added constant folded in any order and a clamp to [0, 2G-2] or wider allowed (SpTr's split path
clamps to [0, 2G-1]). Such a clamp is taken as harmless: it cannot change rel_idx while each
window's coordinates spread over at most G-1 on every axis (differences in [-(G-1), G-1]). SpTr's
float rounding can put a point G cells from its window's least; the original then clamps rel_idx
(per pair) and the conversion the point's coordinate (compat's coordinates_in_window), and the two
differ for that point's pairs.

Each chain becomes one site whose op (ops/window_attention.py's SparseWindowAttention) takes q, k,
v and what the fused kernel needs instead of the (M, h) pair tensors: the windows, as index_0_offsets
and index_1, from which the op builds each point's row window (start, end), and, with relative
position, the tables and what rel_idx was made from: the points' xyz and quantization, or P and G.
The rel_idx nodes (and the index casts only the chain reads) go with the chain, so nothing of size
M x 3 is computed either; after the rewrite, a get_indices_params whose pair layout only converted
chains read is replaced by get_window_rows, and the op then takes its row windows (`row_windows`)
in place of index_0_offsets and index_1 (ops/window_rows.py).

Either form with one column rewritten by a split function (SphereFormer's exponential split of the
radial axis: rel_idx.clone(), one column written in place, then clamped to [0, 2G-1]) is read when
that column is buckets of a per-pair difference s[index_0] - s[index_1] (passes/rel_idx_split.py):
the op then takes s and the buckets' thresholds, and computes the column from them. A rel_idx of
another form has no per-point coordinates: its chain is found but kept, and the site says why. So
are tables whose propagated shapes have fewer rows than rel_idx reads (2G-1, or a split's buckets),
where G is a known number (the op checks the same when it runs).

Assumed, not checked: the chain's index tensors are SpTr's pair layout (compat/sptr.py), each
query's pairs one CSR row of index_0_offsets holding its whole window in order, so that the key of
its first pair is its window's first point and its pair count the window's size. The op reads the
windows that way (compat's row_windows_from_pairs) and computes attention over those windows, not
over the pairs themselves: index tensors of another layout (a subset of a window, pairs in another
order or across windows) would be converted into attention over other pairs, with no error.
A real op called with its own keyword names (index0, index_q, table) is read through its signature.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from lowconv.compat import sptr
from lowconv.compat.sptr_install import as_compat
from lowconv.ops.window_attention import SPLIT_VALUES_ARG
from lowconv.passes.attention import attention_site
from lowconv.passes.fx_nodes import (ADDS, CLAMP_METHODS, CLAMPS, INT_CASTS, SUBS, call_args, casts, is_number,
                                     mutates, op_is, uncast)
from lowconv.passes.rel_idx_split import RelIdxSplit, rel_idx_split
from lowconv.passes.trace import Region
from lowconv.site import Site, WindowInfo, tensor_meta

STEP1_ARGS = ("q", "k", "index_0", "index_0_offsets", "index_1", "index_1_offsets", "n_max")
SOFTMAX_ARGS = ("src", "indptr", "dim")
OPTIONAL_ARGS = ("dim",)  # the ops' only argument with a default
STEP2_ARGS = ("attn", "v", "index_0", "index_0_offsets", "index_1", "index_1_offsets", "n_max")
DOT_PROD_ARGS = ("q", "index_0", "index_0_offsets", "k", "index_1", "index_1_offsets", "table_q", "table_k",
                 "rel_idx", "n_max")
STEP2_REL_ARGS = ("attn", "v", "index_0", "index_0_offsets", "n_max", "index_1", "index_1_offsets", "table_v",
                  "rel_idx")
REL_IDX_ARGS = ("xyz", "index_0", "index_1", "window_size", "quant_size", "quant_grid_length", "shift_win")
SHARED = ("index_0", "index_0_offsets", "index_1", "index_1_offsets")
# What makes whole numbers of any tensor (torch.div and .div only with a rounding mode).
ROUNDINGS = (operator.floordiv, torch.floor_divide, torch.floor, torch.ceil, torch.trunc)
ROUNDING_METHODS = ("floor_divide", "floor", "ceil", "trunc") + INT_CASTS


def calls(node, function) -> bool:
    """Whether node calls `function`, a lowconv.compat.sptr function, or a real SpTr op standing for it."""
    return isinstance(node, fx.Node) and node.op == "call_function" and as_compat(node.target) is function


def op_args(node: fx.Node, names: tuple[str, ...]) -> dict:
    """An SpTr op call's arguments by compat parameter name (`names`, in order). A real op's keywords
    are its own names (index0, index_q, table): renamed by their place in its signature. A keyword
    that names no parameter keeps its name (unread_arguments_problem)."""
    own = getattr(node.target, "parameter_names", None) or names
    rename = dict(zip(own, names))
    return {**dict(zip(names, node.args)), **{rename.get(key, key): value for key, value in node.kwargs.items()}}


def unread_arguments_problem(node: fx.Node, args: dict, names: tuple[str, ...]) -> str | None:
    """Why a call's arguments cannot all be read by name (None when they can)."""
    unread = [key for key in args if key not in names]
    if unread:
        return (f"`{node.target.__name__}` is called with keywords that lowconv cannot place among its "
                f"parameters ({', '.join(unread)})")
    missing = [name for name in names if name not in args and name not in OPTIONAL_ARGS]
    if missing:
        return f"`{node.target.__name__}` is called without {', '.join(missing)}"
    return None


def made_by(node) -> str:
    """What computed node, for a message."""
    if not isinstance(node, fx.Node):
        return "a constant"
    if node.op == "call_method":
        return f"a `.{node.target}()` call"
    if node.op == "call_function":
        return f"a call of `{getattr(node.target, '__name__', node.target)}`"
    return f"`{node.target}` ({node.op})"


def find_window_attention_sites(region: Region, names: dict[str, set[str]] | None = None) -> list[Site]:
    """The SpTr chains of `region`; `names` as in find_attention_sites."""
    if region.graph is None:
        return []
    names = {} if names is None else names
    sites = []
    for node in region.graph.graph.nodes:
        if calls(node, sptr.attention_step2) or calls(node, sptr.attention_step2_with_rel_pos_value):
            site = chain_site(region, node, names)
            if site is not None:
                sites.append(site)
    return sites


def chain_site(region: Region, step2: fx.Node, names: dict[str, set[str]]) -> Site | None:
    rel_value = calls(step2, sptr.attention_step2_with_rel_pos_value)
    second_names = STEP2_REL_ARGS if rel_value else STEP2_ARGS
    second = op_args(step2, second_names)
    softmax = second.get("attn")
    if not calls(softmax, sptr.scatter_softmax_csr):
        return None
    scores = op_args(softmax, SOFTMAX_ARGS)
    step1 = scores.get("src")
    rel_query = calls(step1, sptr.dot_prod_with_idx_all)
    if not (rel_query or calls(step1, sptr.attention_step1)):
        return None
    first_names = DOT_PROD_ARGS if rel_query else STEP1_ARGS
    first = op_args(step1, first_names)
    contextual = rel_query and rel_value

    unread = [why for why in (unread_arguments_problem(step1, first, first_names),
                              unread_arguments_problem(softmax, scores, SOFTMAX_ARGS),
                              unread_arguments_problem(step2, second, second_names)) if why]
    if unread:  # what the chain computes is not known: nothing more to say of it
        return window_site(region, first.get("q"), step2, "contextual" if contextual else "none", unread, (),
                           [step1, softmax, step2], names)
    problems = []
    if len(step1.users) > 1 or len(softmax.users) > 1:
        problems.append("the attention scores or probabilities are also used elsewhere")
    if (any(uncast(first[name]) is not uncast(second[name]) for name in SHARED)
            or uncast(scores["indptr"]) is not uncast(first["index_0_offsets"])):
        problems.append("the chain's ops do not share one pair layout")
    if rel_query != rel_value:
        problems.append("relative position on the query/key side only or on the value side only")
    # The op takes the index tensors uncast (same values); their casts go with the chain, removed
    # where nothing else reads them: real SpTr's `index_0.int()` alone is M-sized.
    index_casts = [cast for arg in [*(first[n] for n in SHARED), *(second[n] for n in SHARED), scores["indptr"]]
                   for cast in casts(arg)]
    nodes = [*index_casts, step1, softmax, step2]
    args = [first["q"], first["k"], second["v"], uncast(first["index_0_offsets"]), uncast(first["index_1"])]
    split = None
    if contextual:
        rel_idx = first["rel_idx"]
        tables = [first["table_q"], first["table_k"], second["table_v"]]
        split = rel_idx_split(rel_idx, first["index_0"], first["index_1"])
        base = split.base if isinstance(split, RelIdxSplit) else rel_idx
        grid_length = None
        if second["rel_idx"] is not rel_idx:
            problems.append("the query/key and the value side take different rel_idx")
        elif isinstance(split, str):
            problems.append(f"rel_idx is rewritten by a split function that lowconv cannot read: {split}")
        elif calls(base, sptr.relative_position_index):
            made = call_args(base, REL_IDX_ARGS)
            if uncast(made.get("index_0")) is not uncast(first["index_0"]) or \
                    uncast(made.get("index_1")) is not uncast(first["index_1"]):
                problems.append("rel_idx is relative_position_index(...) of other index tensors than the chain's "
                                "index_0 and index_1, in that order")
            grid_length = made["quant_grid_length"]
            args += [made["xyz"], made["window_size"], made["quant_size"], grid_length,
                     made.get("shift_win", False), *tables]
            nodes.append(base)
        elif isinstance(inline := inline_rel_idx(base, first["index_0"], first["index_1"]), InlineRelIdx):
            # The op's xyz form is left empty (xyz, window_size, quant_size; shift_win False): coords last.
            grid_length = inline.grid_length
            args += [None, None, None, grid_length, False, *tables, inline.coords]
            nodes += inline.nodes
        else:
            problems.append(f"rel_idx is not relative_position_index(...) of the points, nor SpTr's inline "
                            f"P[index_0] - P[index_1] + G - 1 of per-point whole-number coordinates P, "
                            f"nor one of those with a column rewritten by a split function: {inline}; so it "
                            f"has no per-point coordinates")
        if grid_length is not None and isinstance(split, RelIdxSplit):
            args += [None] * (SPLIT_VALUES_ARG - len(args))  # the xyz form takes no coords
            args += [split.values, (split.axis, split.first, split.thresholds)]
            nodes += split.nodes
            problems += split_problems(split, grid_length)
        if grid_length is not None:
            problems += short_tables(tables, grid_length, split.last if isinstance(split, RelIdxSplit) else None)
    v_meta, q_meta = tensor_meta(second["v"]), tensor_meta(first["q"])
    if v_meta and q_meta and v_meta.shape[1:] != q_meta.shape[1:]:
        problems.append(f"v's (heads, head_dim) {list(v_meta.shape[1:])} are not q's and k's {list(q_meta.shape[1:])}")
    changed = changed_in_place([a for a in args if isinstance(a, fx.Node)], nodes, step2)
    if changed:
        problems.append(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} changed in place while the "
                        "chain runs; the op reads them once, where the chain ends")
    rel_pos = "none" if not contextual else "contextual" if not isinstance(split, RelIdxSplit) else \
        f"contextual, axis {split.axis} split into buckets {split.first} to {split.last}"
    return window_site(region, first["q"], step2, rel_pos, problems, args, nodes, names)


def split_problems(split: RelIdxSplit, grid_length) -> list[str]:
    """Why a split's clamps and casts (after its write) could change the columns it did not write:
    clamps to narrower bounds than [0, 2G-2]."""
    if not isinstance(grid_length, int):
        return [f"the split's quant_grid_length is not a number ({made_by(grid_length)})"]
    return [f"a clamp ({made_by(clamp)}) of the split rel_idx to other bounds than [0, {2 * grid_length - 2}] "
            f"or wider can change its other columns" for clamp in split.outer
            if op_is(clamp, CLAMPS, CLAMP_METHODS) and not clamps_wider(clamp, 0, 2 * grid_length - 2)]


def changed_in_place(inputs: list[fx.Node], chain: list[fx.Node], end: fx.Node) -> list[str]:
    """The inputs of a chain (q, k, v, xyz, rel_idx, ...) that an in-place op changes between the
    chain's first node and its last: the chain's ops read them before, the op at the end after."""
    start, own = min(chain), set(chain)  # fx nodes order as they stand in the graph
    return [node.name for node in dict.fromkeys([*inputs, *chain]) for user in node.users
            if mutates(user) and user.args[0] is node and start < user < end and user not in own]


def window_site(region: Region, q, step2: fx.Node, rel_pos: str, problems: list[str], args, nodes,
                names: dict[str, set[str]]) -> Site:
    q_meta = tensor_meta(q)
    info = WindowInfo(
        form="window",
        heads=q_meta.shape[1] if q_meta else None,
        kv_heads=q_meta.shape[1] if q_meta else None,
        head_dim=q_meta.shape[2] if q_meta else None,
        scale=1.0,  # SpTr's q comes pre-scaled
        rel_pos=rel_pos,
    )
    order = {node: i for i, node in enumerate(region.graph.graph.nodes)}
    return attention_site(region, step2, names, info=info, input=q_meta, problems=problems, args=tuple(args),
                          nodes=sorted(set(nodes), key=order.__getitem__))  # graph order: erased last first


def short_tables(tables, grid_length, split_last=None) -> list[str]:
    """Why tables (query, key, value nodes) cannot serve rel_idx in [0, 2G-2] (and a split's buckets
    up to split_last) when their lengths (shape propagation) and G (a whole number) are known: fewer
    rows. The original indexes past such tables wherever a pair's rel_idx reaches their length; the
    op would compute something else (it refuses them when it runs)."""
    if not (isinstance(grid_length, int) and not isinstance(grid_length, bool)):
        return []
    rows = max(2 * grid_length - 1, (split_last or 0) + 1)
    lengths = [meta.shape[0] if (meta := tensor_meta(t)) is not None and meta.shape else None for t in tables]
    if not any(length is not None and length < rows for length in lengths):
        return []
    return [f"the relative position tables (query, key, value) have "
            f"{', '.join('?' if length is None else str(length) for length in lengths)} rows; "
            f"rel_idx needs {f'2G-1 = {rows}' if rows == 2 * grid_length - 1 else rows} (G = {grid_length}"
            f"{'' if split_last is None else f', buckets of the split to {split_last}'})"]


@dataclass
class InlineRelIdx:
    coords: fx.Node  # P (N, 3), whole numbers
    grid_length: int  # G
    nodes: list[fx.Node]  # what computes rel_idx from P and the index tensors


def inline_rel_idx(rel_idx, index_0, index_1) -> InlineRelIdx | str:
    """rel_idx read as SpTr's inline cast(P[cast(index_0)] - P[cast(index_1)] + c), c = G - 1 made of
    numbers added or subtracted in any order, with any clamp outside the sum that cannot change it;
    else why not."""
    nodes, node = [], rel_idx
    while op_is(node, CLAMPS, CLAMP_METHODS + INT_CASTS):
        nodes.append(node)
        node = node.args[0]
    constant = 0
    while (term := added_number(node)) is not None:
        nodes.append(node)
        node, number = term
        constant += number
    if not (op_is(node, SUBS) and not node.kwargs and len(node.args) == 2
            and all(op_is(a, (operator.getitem,)) for a in node.args)):
        return f"less its casts, clamps and added numbers it is made by {made_by(node)}, not P[index_0] - P[index_1]"
    (coords, index_q), (coords_k, index_k) = (a.args for a in node.args)
    if coords_k is not coords or uncast(index_q) is not uncast(index_0) or uncast(index_k) is not uncast(index_1):
        return "it is not the difference of one tensor indexed by the chain's index_0 and index_1"
    nodes += [node, *node.args, *casts(index_q), *casts(index_k)]
    if not whole_numbers(coords):
        return f"its coordinates are made by {made_by(coords)}, which need not give whole numbers"
    if not (float(constant).is_integer() and constant >= 0):
        return f"the number added, {constant}, is not G - 1 for a whole G >= 1"
    for clamp in nodes:
        if op_is(clamp, CLAMPS, CLAMP_METHODS) and not clamps_wider(clamp, 0, 2 * constant):
            return f"a clamp ({made_by(clamp)}) to other bounds than [0, {2 * constant}] or wider can change its values"
    if any(mutates(user) and user.args[0] is n for n in [*nodes, coords] for user in n.users):
        return "a tensor it is computed from is changed in place"
    return InlineRelIdx(coords, int(constant) + 1, nodes)


def added_number(node) -> tuple[fx.Node, float] | None:
    """(x, n) where node is x + n, n + x or x - n with n a number; else None."""
    if not (op_is(node, ADDS + SUBS) and not node.kwargs and len(node.args) == 2):
        return None
    left, right = node.args
    if is_number(right):
        return left, right if op_is(node, ADDS) else -right
    if is_number(left) and op_is(node, ADDS):
        return right, left
    return None


def clamps_wider(clamp: fx.Node, low, high) -> bool:
    """Whether a clamp's bounds are numbers (or none) that leave [low, high] alone."""
    bounds = call_args(clamp, ("input", "min", "max"))
    lower, upper = bounds.get("min"), bounds.get("max")
    return ((lower is None or is_number(lower) and lower <= low)
            and (upper is None or is_number(upper) and upper >= high))


def whole_numbers(node) -> bool:
    """Whether node holds whole numbers by how it is made: rounded, cast to or of an integer dtype."""
    meta = tensor_meta(node)
    if meta is not None and not getattr(torch, meta.dtype).is_floating_point:
        return True
    if op_is(node, (torch.div,), ("div",)):
        return node.kwargs.get("rounding_mode") in ("floor", "trunc")
    return op_is(node, ROUNDINGS, ROUNDING_METHODS)
