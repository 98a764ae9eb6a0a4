"""Reading one functional attention off a region's graph (a Match), in two forms:
- `F.scaled_dot_product_attention(q, k, v, ...)` calls;
- hand-written `softmax(q @ k^T * scale [+ mask], dim=-1) [dropout] @ v`, read from the softmax
  up to `q @ k^T` and down to `@ v`, through dtype casts, constant scalings (of the scores, or of
  q or k before the matmul), masks (`+ m`, `masked_fill(m, -inf)`, `where(m, s, -inf)`), views
  and reshapes of the scores, and a dropout.

Matching reads node targets and constant arguments only; attention.py makes the Site of a Match.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lowconv.passes.attention_masks import Mask, looks_boolean, mask_fill
from lowconv.passes.example_values import decided
from lowconv.passes.fx_nodes import (
    ADDS, MATMULS, all_ints, call_args, is_cast, is_number, is_shape_of, is_slice, mutates, op_is, submodule,
)
from lowconv.passes.trace import Region
from lowconv.site import tensor_meta

MAX_SCORE_STEPS = 8  # ops between q @ k^T and the softmax that the matcher follows
TRIAL_HEAD_DIMS = (16, 64)  # where a scale computed from the head_dim is evaluated

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

SOFTMAXES = (F.softmax, torch.softmax)
MULS = (operator.mul, torch.mul)
DIVS = (operator.truediv, torch.div)
SCALAR_OPS = (operator.mul, operator.truediv, operator.floordiv, operator.pow, operator.add,
              operator.sub, operator.neg, math.sqrt)


@dataclass
class Match:
    """What the matcher read off one functional attention in the graph."""

    form: str  # "sdpa" | "handwritten"
    q: fx.Node
    k: fx.Node | None  # None: not found (then there is a problem)
    v: fx.Node
    output: fx.Node
    nodes: list[fx.Node]
    scale: float | None
    causal: bool = False
    dropout: float = 0.0
    masks: list[Mask] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    scores: fx.Node | None = None  # hand-written: the q @ k^T matmul
    steps: list[Step] = field(default_factory=list)  # hand-written: from the softmax up to `scores`


@dataclass
class Step:
    """One op between q @ k^T and the softmax."""

    node: fx.Node
    factor: float | None = None  # it multiplies the scores by this constant
    scaled_at_run_time: bool = False  # it multiplies the scores by a computed value
    mask: fx.Node | None = None
    kind: str | None = None
    reshape: bool = False  # it views or reshapes the scores
    problem: str | None = None
    finite_fill: bool = False  # a mask that sets the masked scores to a finite value


# ---- SDPA ----

def match_sdpa(region: Region, node: fx.Node) -> Match | None:
    if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
        return None
    args = call_args(node, SDPA_ARGS)
    q, k, v = args.get("query"), args.get("key"), args.get("value")
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        return None
    match = Match("sdpa", q, k, v, output=node, nodes=[node], scale=None)
    match.scale = constant(match, "SDPA's scale", args.get("scale"), None)
    match.causal = constant(match, "SDPA's is_causal", args.get("is_causal", False), False)
    match.dropout = constant(match, "SDPA's dropout_p", args.get("dropout_p", 0.0), 0.0)
    mask = args.get("attn_mask")
    if isinstance(mask, fx.Node):
        meta = tensor_meta(mask)
        boolean = meta.dtype == "bool" if meta else looks_boolean(region, mask)
        match.masks.append(Mask(mask, "keep" if boolean else "additive"))
    return match


def constant(match: Match, what: str, value, default):
    """`value`, or `default` and a problem when it is computed at run time. A value that a branch
    of the trace was decided on (Hugging Face's decode step passes `is_causal = q_length > 1`, after
    `q_length > 1 and ...` chose its branch) is the constant the branch's guard holds it to."""
    if isinstance(value, fx.Node):
        guarded = [user.args[1] for user in value.users if user.op == "call_function" and user.target is decided]
        if guarded:
            return guarded[0]
        match.problems.append(f"{what} is computed at run time (a tensor), not a constant")
        return default
    return value


# ---- hand-written softmax(q k^T) v ----

def match_handwritten(region: Region, softmax: fx.Node) -> Match | None:
    scores = softmax_input(region, softmax)
    found = trace_scores(scores) if scores is not None else None
    probs = trace_probs(region, softmax) if found is not None else None
    if probs is None:
        return None
    scores_matmul, steps = found
    pv_matmul, prob_nodes, dropout = probs

    q, q_factor, q_nodes = strip_scale(scores_matmul.args[0])
    kt, kt_factor, kt_nodes = strip_scale(scores_matmul.args[1])
    k = untranspose(kt)
    k, k_factor, k_nodes = strip_scale(k) if k is not None else (None, 1.0, [])
    nodes = [*q_nodes, *kt_nodes, *([kt] if k is not None else []), *k_nodes, scores_matmul,
             *(s.node for s in steps), softmax, *prob_nodes, pv_matmul]
    match = Match("handwritten", q, k, pv_matmul.args[1], output=pv_matmul, nodes=nodes,
                  scale=q_factor * kt_factor * k_factor, scores=scores_matmul, steps=steps)
    match.dropout = constant(match, "the dropout probability", dropout, 0.0)
    if k is None:
        match.problems.append(f"k^T ({kt.name}) is not k.transpose(-2, -1) of a "
                              f"(batch, heads, seq, head_dim) k")

    scaled = False  # steps run softmax side first: a scale seen here applies after later masks
    computed = []  # (step, the scores it scales) for scalings by a computed value
    for step, up in zip(steps, [*(s.node for s in steps[1:]), scores_matmul]):
        if step.problem:
            match.problems.append(step.problem)
        if step.factor is not None:
            match.scale *= step.factor
        if step.scaled_at_run_time:
            computed.append((step.node, up))
        scaled = scaled or step.factor is not None or step.scaled_at_run_time
        if step.mask is not None:
            match.masks.append(Mask(step.mask, step.kind, scaled, step.finite_fill))
    if computed:
        fold_computed_scale(match, computed)
    for node in (scores_matmul, *(s.node for s in steps), softmax, *prob_nodes):
        changed = next((u for u in node.users if mutates(u)), None)
        if changed is not None:
            match.problems.append(f"an in-place op ({changed.name}) changes {node.name}")
    return match


def fold_computed_scale(match: Match, scalings: list[tuple[fx.Node, fx.Node]]) -> None:
    """Fold scalings by values computed from q's or k's head_dim (nanoGPT's
    `* (1.0 / math.sqrt(k.size(-1)))`) into match.scale: None when they make it
    1/sqrt(head_dim), SDPA's default; a number when shapes give the head_dim."""
    def factor(head_dim):
        values = [scalar_value(node, {up: 1.0}, (match.q, match.k), head_dim)
                  for node, up in scalings]
        return None if None in values else math.prod(values)

    meta = tensor_meta(match.q)
    if factor(TRIAL_HEAD_DIMS[0]) is None:
        names = ", ".join(node.name for node, _ in scalings)
        sources = [size_sources(a) for node, up in scalings for a in node.args if a is not up]
        if sources and None not in sources:
            sized = ", ".join(dict.fromkeys(x.name for found in sources for x in found))
            match.problems.append(f"the scores are scaled by a number computed from the shape of {sized} ({names}), "
                                  f"which lowconv folds only from q's or k's last size: write it as "
                                  f"q.size(-1) ** -0.5 or as a constant")
        else:
            match.problems.append(f"the scores are scaled by a tensor ({names}), not a constant")
    elif match.scale == 1.0 and all(math.isclose(factor(d), d ** -0.5) for d in TRIAL_HEAD_DIMS):
        match.scale = None
    elif meta is not None:
        match.scale *= factor(meta.shape[-1])
    else:
        match.problems.append("the scale is computed from shapes: trace with example inputs")


def scalar_value(node, env: dict, sized: tuple, head_dim: int) -> float | None:
    """The value of a scalar expression of constants, `env`'s nodes and the head_dim (the
    last size of a node in `sized`), or None when it is anything else."""
    if is_number(node):
        return node
    if not isinstance(node, fx.Node):
        return None
    if node in env:
        return env[node]
    if is_last_size(node, sized):
        return head_dim
    if node.op == "call_function" and node.target in SCALAR_OPS and not node.kwargs:
        values = [scalar_value(a, env, sized, head_dim) for a in node.args]
        return None if None in values else node.target(*values)
    return None


def size_sources(node) -> list[fx.Node] | None:
    """The tensors whose sizes a scalar expression of constants and sizes reads (`b, t, c =
    x.shape`, then `c // heads`), or None where it reads anything else."""
    if is_number(node):
        return []
    if not isinstance(node, fx.Node):
        return None
    if op_is(node, (), ("size",)) or is_shape_of(node):
        return [node.args[0]]
    if is_slice(node) and is_shape_of(node.args[0]):
        return [node.args[0].args[0]]
    if node.op == "call_function" and node.target in SCALAR_OPS and not node.kwargs:
        found = [size_sources(a) for a in node.args]
        return None if None in found else [x for sources in found for x in sources]
    return None


def is_last_size(node: fx.Node, sized: tuple) -> bool:
    """Whether `node` is `x.size(-1)`, `x.size()[-1]` or `x.shape[-1]` of an x in `sized`."""
    if op_is(node, (), ("size",)) and len(node.args) == 2:
        x, dim = node.args
    elif is_slice(node) and is_shape_of(node.args[0]):
        x, dim = node.args[0].args[0], node.args[1]
    else:
        return False
    return any(x is s for s in sized) and is_last_dim(x, dim)


def is_last_dim(x: fx.Node, dim) -> bool:
    """Whether `dim` is x's last dim (without shapes, x is taken to be 4-D)."""
    meta = tensor_meta(x)
    return dim in (-1, len(meta.shape) - 1 if meta else 3)


def softmax_input(region: Region, node: fx.Node) -> fx.Node | None:
    """The input of `node` when it is a softmax over the last dim, else None."""
    if op_is(node, SOFTMAXES, ("softmax",)):
        args = call_args(node, ("input", "dim"))
        x, dim = args.get("input"), args.get("dim")
    elif node.op == "call_module" and isinstance(module := submodule(region, node), nn.Softmax):
        x, dim = node.args[0], module.dim
    else:
        return None
    return x if isinstance(x, fx.Node) and is_last_dim(x, dim) else None


def trace_scores(node: fx.Node, depth: int = 0) -> tuple[fx.Node, list[Step]] | None:
    """From the softmax's input up to q @ k^T: the matmul and the steps, softmax side first."""
    if op_is(node, MATMULS, ("matmul",)):
        return node, []
    if depth == MAX_SCORE_STEPS:
        return None
    for up, step in score_steps(node):
        found = trace_scores(up, depth + 1)
        if found is not None:
            return found[0], [step, *found[1]]
    return None


def score_steps(node: fx.Node) -> list[tuple[fx.Node, Step]]:
    """The readings of `node` as a step on the scores: (the scores before it, the step)."""
    if not isinstance(node, fx.Node):
        return []
    if is_cast(node):
        return [(node.args[0], Step(node))]
    if op_is(node, (torch.reshape,), ("view", "reshape")) and not any(
            isinstance(a, torch.dtype) for a in node.args[1:]):  # x.view(dtype) reinterprets bits
        return [(node.args[0], Step(node, reshape=True))]
    scalings = scale_operands(node)
    if scalings:
        return [(x, Step(node, factor=c) if is_number(c) else Step(node, scaled_at_run_time=True))
                for x, c in scalings]
    if op_is(node, ADDS, ("add",)) and not node.kwargs and len(node.args) == 2:
        a, b = node.args
        return [(x, Step(node, mask=m, kind="additive"))
                for x, m in ((a, b), (b, a)) if isinstance(x, fx.Node) and isinstance(m, fx.Node)]
    if op_is(node, (torch.masked_fill,), ("masked_fill",)):
        args = call_args(node, ("input", "mask", "value"))
        fill = mask_fill(args.get("value"))
        if fill is not None:
            return [(args["input"], Step(node, mask=args["mask"], kind="drop", finite_fill=math.isfinite(fill)))]
        return [(args["input"], Step(node, problem=f"masked_fill({node.name}) fills "
                                                   f"{args.get('value')!r}, not -inf"))]
    if node.op == "call_function" and node.target is torch.where and len(node.args) == 3:
        cond, x, y = node.args
        for kept, fill, kind in ((x, mask_fill(y), "keep"), (y, mask_fill(x), "drop")):
            if fill is not None:
                return [(kept, Step(node, mask=cond, kind=kind, finite_fill=math.isfinite(fill)))]
    return []


def trace_probs(region: Region, softmax: fx.Node):
    """From the softmax down to P @ V: (that matmul, the nodes between, the dropout p), or None."""
    node, nodes, dropout = softmax, [], 0.0
    while True:
        nexts = [u for u in node.users if u.args and u.args[0] is node and
                 (is_cast(u) or op_is(u, MATMULS, ("matmul",))
                  or (dropout == 0.0 and dropout_p(region, u) is not None))]
        if len(nexts) != 1:
            return None
        node = nexts[0]
        if op_is(node, MATMULS, ("matmul",)):
            return node, nodes, dropout
        nodes.append(node)
        if not is_cast(node):
            dropout = dropout_p(region, node)
            if len(node.users) > 1 and dropout != 0:  # the others would see another dropout mask than P @ V
                return None


def dropout_p(region: Region, node: fx.Node):
    """The probability of a dropout call (a number, or a node when computed), else None."""
    if node.op == "call_function" and node.target is F.dropout:
        args = call_args(node, ("input", "p", "training"))
        training = args.get("training", True)
        if not isinstance(training, bool):
            return None
        # training=False traced as a constant (self.training and ..., or self.training in eval
        # mode, which the plan warns about): no dropout, as the traced graph has none
        return args.get("p", 0.5) if training else 0.0
    if node.op == "call_function" and node.target is torch.dropout:
        return call_args(node, ("input", "p")).get("p")
    if node.op == "call_module" and isinstance(module := submodule(region, node), nn.Dropout):
        return module.p
    return None


def strip_scale(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """(x, c, [node]) when `node` is x * c or x / c for a constant c and used once; else
    (node, 1.0, []): a scaling with other users stays outside the site, as its input."""
    if isinstance(node, fx.Node) and len(node.users) == 1:
        for x, c in scale_operands(node):
            if is_number(c):
                return x, c, [node]
    return node, 1.0, []


def scale_operands(node: fx.Node) -> list[tuple[fx.Node, object]]:
    """The readings of `node` as x * c: (x, c), c a number or a node."""
    if node.kwargs or len(node.args) != 2:
        return []
    a, b = node.args
    if op_is(node, MULS, ("mul",)):
        return [(x, c) for x, c in ((a, b), (b, a)) if isinstance(x, fx.Node)
                and (is_number(c) or isinstance(c, fx.Node))]
    if op_is(node, DIVS, ("div",)) and isinstance(a, fx.Node):
        return [(a, 1.0 / b if is_number(b) else b)]
    return []


def untranspose(kt: fx.Node) -> fx.Node | None:
    """k when `kt` is k with its last two dims swapped, else None."""
    if not isinstance(kt, fx.Node):
        return None
    if op_is(kt, (torch.transpose,), ("transpose",)) and len(kt.args) == 3:
        meta = tensor_meta(kt)
        ndim = len(meta.shape) if meta else 4  # without shapes, the 4-D form
        dims = kt.args[1:]
        swapped = all_ints(dims) and {d % ndim for d in dims} == {ndim - 2, ndim - 1}
    elif op_is(kt, (torch.permute,), ("permute",)) and len(kt.args) >= 2:
        dims = kt.args[1] if isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        n = len(dims)
        swapped = all_ints(dims) and [d % n for d in dims] == [*range(n - 2), n - 1, n - 2]
    else:
        swapped = kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT"
    return kt.args[0] if swapped else None
