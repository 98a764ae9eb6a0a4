"""Find attention sites in a traced region.

Three forms:
- `F.scaled_dot_product_attention(q, k, v, ...)` calls and hand-written `softmax(q @ k^T) @ v`,
  read off the graph as attention_match.py says;
- nn.MultiheadAttention modules: call_module nodes, or lone regions of their own (see
  lowconv.passes.mha).

Shapes, when shape propagation left them, fill in heads/head_dim/dtypes. Masks, their kinds and
causal masks are read as lowconv.passes.attention_masks describes.

Two edits of the region's graph (attention_edits.py) let a site take what its op takes.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from lowconv.passes.attention_edits import fold_masks, scores_shape, unrepeat_kv
from lowconv.passes.attention_masks import causal_part
from lowconv.passes.attention_match import Match, match_handwritten, match_sdpa
from lowconv.passes.mha import is_mha_call, lone_mha_site, mha_site
from lowconv.passes.trace import Region, join_fqn
from lowconv.site import AttentionInfo, Site, class_names, tensor_meta


def find_attention_sites(region: Region, names: dict[str, set[str]] | None = None) -> list[Site]:
    """The attention sites of `region`, in graph order. `names`: owner FQN -> site names taken
    (shared with other attention passes over the same region)."""
    if region.graph is None:
        if isinstance(region.module, nn.MultiheadAttention):
            return [lone_mha_site(region)]
        return []
    sites: list[Site] = []
    names = {} if names is None else names
    mha_targets: set[str] = set()
    for node in region.graph.graph.nodes:
        if is_mha_call(region, node):
            if node.target not in mha_targets:
                mha_targets.add(node.target)
                sites.append(mha_site(region, node.target))
            continue
        match = match_sdpa(region, node) or match_handwritten(region, node)
        if match is not None and fold_masks(region, match):
            match = match_handwritten(region, node)  # the scores now get one mask: read them again
        if match is not None:
            unrepeat_kv(match)
            sites.append(functional_site(region, match, names))
    order = {node: i for i, node in enumerate(region.graph.graph.nodes)}
    for site in sites:
        site.nodes.sort(key=order.__getitem__)
    return sites


def functional_site(region: Region, match: Match, names: dict[str, set[str]]) -> Site:
    """The Site of an SDPA or hand-written match; causal masks become causal=True."""
    q_meta, k_meta = tensor_meta(match.q), tensor_meta(match.k)
    mask, causal_from_mask = None, False
    for m in match.masks:
        causal = causal_part(region, m, scores_shape(match))
        if causal is not None:
            match.causal = causal_from_mask = True
            m, nodes = causal
            match.nodes.extend(nodes)
            if m is None:
                continue
        if mask is not None:
            match.problems.append("more than one attention mask")
        elif m.scaled and m.kind == "additive":
            match.problems.append(f"the additive mask {m.node.name} is scaled with the scores")
        else:
            mask = m
    if mask is not None and mask.finite_fill and match.causal:
        match.problems.append(f"the mask {mask.node.name} fills a finite value beside causal masking: the rows it "
                              "masks whole would average other keys than the op can tell")
    problem = operand_problem(q_meta, k_meta, tensor_meta(match.v), tensor_meta(mask.node) if mask else None)
    if problem:
        match.problems.append(problem)
    heads_known = q_meta is not None and len(q_meta.shape) >= 4 and k_meta is not None and len(k_meta.shape) >= 4
    info = AttentionInfo(
        form=match.form,
        heads=q_meta.shape[-3] if heads_known else None,
        kv_heads=k_meta.shape[-3] if heads_known else None,
        head_dim=q_meta.shape[-1] if q_meta else None,
        scale=None if match.scale is None else float(match.scale),
        mask=mask.kind if mask else "none",
        causal=bool(match.causal),
        causal_from_mask=causal_from_mask,
        finite_fill=bool(mask and mask.finite_fill),
        dropout=float(match.dropout),
    )
    args = (match.q, match.k, match.v) + ((mask.node,) if mask else ())
    return attention_site(region, match.output, names, info=info, input=q_meta, problems=match.problems,
                          args=args, nodes=list(dict.fromkeys(match.nodes)))


def operand_problem(q, k, v, mask) -> str | None:
    """Why the op cannot take these operands (TensorMetas; None: fine, or shapes unknown): it takes
    q (..., H, Lq, D), k (..., Hk, Lk, D), v (..., Hk, Lk, Dv) with the same leading dims and Hk
    dividing H, and a mask that broadcasts to the scores without enlarging them; the original
    may broadcast more (a k shared by the batch, one query head against many)."""
    if None in (q, k, v):
        return None
    shapes = f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if not 3 <= len(q.shape) == len(k.shape) == len(v.shape):
        return f"q, k and v are not all (..., heads, seq, head_dim) of one rank ({shapes})"
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-3] % k.shape[-3]:
        return f"q, k and v broadcast against each other ({shapes}), which the op does not"
    scores = (*q.shape[:-1], k.shape[-2])
    if mask is not None:
        try:
            fits = torch.broadcast_shapes(mask.shape, scores) == scores
        except RuntimeError:
            fits = False
        if not fits:
            return f"the mask {list(mask.shape)} does not broadcast to the scores {list(scores)}"
    return None


def attention_site(region: Region, output: fx.Node, names: dict[str, set[str]], *, info: AttentionInfo,
                   input, problems: list[str], args: tuple, nodes: list[fx.Node]) -> Site:
    """The attention Site whose result is `output`, named after the module whose forward made it."""
    owner_fqn, owner = owner_of(region, output)
    return Site(
        kind="attention",
        fqn=site_fqn(owner_fqn, owner, names),
        region=region.fqn,
        classes=class_names(type(owner)),
        info=info,
        input=input,
        output=tensor_meta(output),
        unsupported="; ".join(problems) or None,
        args=args,
        output_node=output,
        nodes=nodes,
    )


def owner_of(region: Region, node: fx.Node) -> tuple[str, nn.Module]:
    """The FQN and module of the innermost module whose forward made `node`."""
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    return join_fqn(region.fqn, path), region.module.get_submodule(path)


def site_fqn(owner_fqn: str, owner: nn.Module, names: dict[str, set[str]]) -> str:
    """owner.attention, or attention_1, ...: a name that no attribute or other site has."""
    taken = names.setdefault(owner_fqn, set())
    name, i = "attention", 0
    while name in taken or hasattr(owner, name):
        i += 1
        name = f"attention_{i}"
    taken.add(name)
    return join_fqn(owner_fqn, name)
