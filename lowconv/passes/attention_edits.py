"""Edits of a region's graph around an attention match, each computing what it computed before.

They let a site take what its op takes:
- Scores that get several masks, or get a mask while reshaped (timm's Swin adds its shift mask
  to `scores.view(batch, windows, heads, N, N)` and views them back), are given one mask instead:
  the steps between q @ k^T and the softmax, masks and reshapes only, are replayed on zeros of
  the scores' shape, and the softmax takes `q @ k^T + that`. A site kept unconverted then adds
  its masks in another order (roundings differ where masks add up, e.g. the shift mask's -100).
  Reshapes must bring the scores back to their shape (checked on the propagated shapes); where
  lowconv cannot fold the steps, the site says why.
- Grouped-query k and v that the model repeats up to q's heads (Hugging Face's repeat_kv) are
  taken before the repeat (the op repeats them itself), also where the model reads the
  repeated tensor's shape: those reads are given the shape the repeat's reshape names.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from lowconv.passes.attention_masks import causal_chain, zero_scores
from lowconv.passes.fx_nodes import call_args, is_number, is_shape_of, is_slice, op_is
from lowconv.passes.trace import Region
from lowconv.site import tensor_meta

if TYPE_CHECKING:
    from lowconv.passes.attention_match import Match


# ---- several masks, or masks on reshaped scores: one mask ----

def fold_masks(region: Region, match: Match) -> bool:
    """Give the scores one mask where a hand-written match adds several (causal ones aside), or
    reshapes the scores (see the module docstring); True when the graph was changed. Where the
    scores are reshaped and cannot be folded, the match says why."""
    reshapes = [s.node.name for s in match.steps if s.reshape]
    # On reshaped scores every mask is folded: a causal one may not be causal in the scores' shape.
    masks = match.masks if reshapes else [m for m in match.masks
                                          if causal_chain(region, m, scores_shape(match)) is None]
    if not reshapes and len(masks) < 2:
        return False
    why = fold_problem(match, reshapes)
    if why is not None:
        if reshapes:  # several masks alone: functional_site says so
            match.problems.append(f"the scores are reshaped ({', '.join(reshapes)}) between q @ k^T and "
                                  f"the softmax, and {why}")
        return False
    if not masks:  # reshaped back with nothing added: the reshapes go with the site
        return False
    replace_by_one_mask(region.graph.graph, match)
    return True


def fold_problem(match: Match, reshapes: list[str]) -> str | None:
    """Why the steps of `match` cannot be replayed as one mask, or None when they can."""
    if match.k is None or match.problems:
        return "the attention has other problems"
    others = [s.node.name for s in match.steps if not (s.reshape or s.mask is not None)]
    if others:
        return f"steps other than masks and reshapes come between them ({', '.join(others)})"
    finite = [s.node.name for s in match.steps if s.finite_fill]
    if finite:  # added as one mask, it would shift the scores instead of replacing them
        return f"{', '.join(finite)} fill{'s' if len(finite) == 1 else ''} a finite value, not -inf"
    shared = [s.node.name for s in match.steps[1:] if len(s.node.users) > 1]
    if shared:
        return f"scores on the way ({', '.join(shared)}) are read outside the attention"
    before, after, q = (tensor_meta(x) for x in (match.scores, match.steps[0].node, match.q))
    if reshapes and (before is None or after is None):
        return "lowconv cannot check that they are reshaped back: trace with example inputs"
    if reshapes and before.shape != after.shape:
        return f"the softmax gets them in shape {after.shape}, not q @ k^T's {before.shape}"
    if before is not None and q is not None and before.shape[:-1] != q.shape[:-1]:
        return f"q {q.shape} is broadcast to the scores' {before.shape}"  # zero_scores takes q's
    return None


def replace_by_one_mask(graph: fx.Graph, match: Match) -> None:
    """Make the softmax take `q @ k^T + mask`, the mask being the match's steps replayed on zeros
    (masks and reshapes: adding the scores commutes with them), and drop the steps."""
    last = match.steps[0].node
    with graph.inserting_before(last.next):
        kv, _ = repeated_heads(match.k)  # not the repeated k: its single use marks it as GQA's
        zeros = graph.call_function(zero_scores, (match.q, kv))
        zeros.meta = dict(match.scores.meta)
        replayed = {match.scores: zeros}
        for step in reversed(match.steps):
            replayed[step.node] = graph.node_copy(step.node, lambda n: replayed.get(n, n))
        masked = graph.call_function(operator.add, (match.scores, replayed[last]))
        masked.meta = dict(last.meta)
    last.replace_all_uses_with(masked)
    for step in match.steps:  # softmax side first: each has no user left
        graph.erase_node(step.node)


def scores_shape(match: Match) -> tuple | None:
    q_meta, k_meta = tensor_meta(match.q), tensor_meta(match.k)
    return (*q_meta.shape[:-1], k_meta.shape[-2]) if q_meta and k_meta else None


# ---- grouped-query attention ----

def unrepeat_kv(match: Match) -> None:
    """Take k and v as the model's own kv heads when both were repeated up to q's heads (GQA)
    and nothing else reads the repeated tensors but their shape: the op repeats them itself
    (kernel-side), and the copies go away with the site. The shape reads are given the shape
    the repeat names."""
    if match.k is None:
        return
    k, k_nodes = repeated_heads(match.k)
    v, v_nodes = repeated_heads(match.v)
    if k_nodes and v_nodes:
        for repeated in (match.k, match.v):
            read_shape_from_arguments(repeated)
        match.k, match.v = k, v
        match.nodes.extend([*k_nodes, *v_nodes])


def repeated_heads(x: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(kv, the nodes that repeat it) when `x` is kv with each of its heads repeated n times in a
    row, as Hugging Face's repeat_kv writes it (`kv[:, :, None, :, :].expand(b, h, n, s, d)
    .reshape(b, h * n, s, d)`, whose shape may be read too) or as
    `kv.repeat_interleave(n, dim=1)`, used by the attention only; else (x, [])."""
    if op_is(x, (torch.repeat_interleave,), ("repeat_interleave",)) and len(x.users) == 1:
        args = call_args(x, ("input", "repeats", "dim"))
        meta = tensor_meta(args.get("input"))  # dim 1 holds the heads of (batch, heads, seq, head_dim) only
        if args.get("dim") == 1 and isinstance(args.get("repeats"), int) and meta and len(meta.shape) == 4:
            return args["input"], [x]
    if op_is(x, (torch.reshape,), ("reshape",)) and len(x.users) - len(shape_reads(x)) == 1:
        expand = x.args[0]
        if op_is(expand, (), ("expand",)) and len(expand.users) == 1 and reshaped_to(x) is not None:
            index = expand.args[0]
            new_axis = (slice(None),) * 2 + (None,) + (slice(None),) * 2
            if is_slice(index) and index.args[1] == new_axis and len(index.users) == 1:
                return index.args[0], [index, expand, x]
    return x, []


def shape_reads(x: fx.Node) -> list[fx.Node]:
    """The users of `x` that read its shape: `x.shape`, `x.size()`."""
    return [u for u in x.users if is_shape_of(u) and u.args[0] is x and not u.kwargs]


def reshaped_to(x: fx.Node) -> list | None:
    """The sizes a reshape names (ints and nodes), or None when one is -1 or they come as one
    node (`reshape(q.shape)`): then only the reshape knows its shape."""
    if len(x.args) == 2 and isinstance(x.args[1], fx.Node):
        return None
    sizes = x.args[1] if len(x.args) == 2 and isinstance(x.args[1], (tuple, list)) else x.args[1:]
    return None if any(is_number(size) and size < 0 for size in sizes) else list(sizes)


def read_shape_from_arguments(x: fx.Node) -> None:
    """Give x's shape reads the shape its reshape names, so that x goes away with the site."""
    for read in shape_reads(x):
        with x.graph.inserting_before(read):
            shape = x.graph.call_function(torch.Size, (reshaped_to(x),))
        read.replace_all_uses_with(shape)
        x.graph.erase_node(read)
