"""Find SpTr windowed-attention chains (lowconv.compat.sptr, or a real SpTr install's ops, read as
their compat equivalents: compat/sptr_install.py) in a traced region.

    attn = attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    attn = scatter_softmax_csr(attn, index_0_offsets)
    out  = attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)

or, with contextual relative position, dot_prod_with_idx_all(q, ..., table_q, table_k, rel_idx,
n_max) and attention_step2_with_rel_pos_value(attn, v, ..., table_v, rel_idx), where rel_idx is
relative_position_index(xyz, index_0, index_1, window_size, quant_size, G, shift_win).

Each chain becomes one site whose op takes q, k, v and what the fused kernel needs instead of the
(M, h) pair tensors: the window offsets (derived from index_0_offsets and index_1) and, with
relative position, the points' xyz and the quantization that rel_idx was made from, and the tables.
The rel_idx node goes with the chain, so nothing of size M x 3 is computed either. Real SpTr
computes rel_idx inline, with no function to read the points from: its contextual chains are found
but kept, and the site says why.
"""
from __future__ import annotations

import torch.fx as fx

from lowconv.compat import sptr
from lowconv.compat.sptr_install import as_compat
from lowconv.passes.attention import owner_of, site_fqn
from lowconv.passes.fx_nodes import call_args
from lowconv.passes.trace import Region
from lowconv.site import AttentionInfo, Site, class_names, tensor_meta

STEP1_ARGS = ("q", "k", "index_0", "index_0_offsets", "index_1", "index_1_offsets", "n_max")
SOFTMAX_ARGS = ("src", "indptr", "dim")
STEP2_ARGS = ("attn", "v", "index_0", "index_0_offsets", "index_1", "index_1_offsets", "n_max")
DOT_PROD_ARGS = ("q", "index_0", "index_0_offsets", "k", "index_1", "index_1_offsets", "table_q", "table_k",
                 "rel_idx", "n_max")
STEP2_REL_ARGS = ("attn", "v", "index_0", "index_0_offsets", "n_max", "index_1", "index_1_offsets", "table_v",
                  "rel_idx")
REL_IDX_ARGS = ("xyz", "index_0", "index_1", "window_size", "quant_size", "quant_grid_length", "shift_win")
SHARED = ("index_0", "index_0_offsets", "index_1", "index_1_offsets")
INT_CASTS = ("int", "long")


def calls(node, function) -> bool:
    """Whether node calls `function`, a lowconv.compat.sptr function, or a real SpTr op standing for it."""
    return isinstance(node, fx.Node) and node.op == "call_function" and as_compat(node.target) is function


def uncast(node):
    """node less its integer casts: real SpTr passes `index_0_offsets.long()` to the softmax."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in INT_CASTS:
        node = node.args[0]
    return node


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
    second = call_args(step2, STEP2_REL_ARGS if rel_value else STEP2_ARGS)
    softmax = second["attn"]
    if not calls(softmax, sptr.scatter_softmax_csr):
        return None
    scores = call_args(softmax, SOFTMAX_ARGS)
    step1 = scores.get("src")
    rel_query = calls(step1, sptr.dot_prod_with_idx_all)
    if not (rel_query or calls(step1, sptr.attention_step1)):
        return None
    first = call_args(step1, DOT_PROD_ARGS if rel_query else STEP1_ARGS)

    problems = []
    if len(step1.users) > 1 or len(softmax.users) > 1:
        problems.append("the attention scores or probabilities are also used elsewhere")
    if (any(uncast(first[name]) is not uncast(second[name]) for name in SHARED)
            or uncast(scores.get("indptr")) is not uncast(first["index_0_offsets"])):
        problems.append("the chain's ops do not share one pair layout")
    if rel_query != rel_value:
        problems.append("relative position on the query/key side only or on the value side only")
    nodes = [step1, softmax, step2]
    args = [first["q"], first["k"], second["v"], first["index_0_offsets"], first["index_1"]]
    if rel_query and rel_value:
        rel_idx = first["rel_idx"]
        if second["rel_idx"] is not rel_idx:
            problems.append("the query/key and the value side take different rel_idx")
        elif not calls(rel_idx, sptr.relative_position_index):
            problems.append(f"rel_idx is not relative_position_index(...) of the points but made by "
                            f"{made_by(rel_idx)} (real SpTr computes it inline; a split function rewrites it), "
                            f"so it has no per-point coordinates")
        else:
            made = call_args(rel_idx, REL_IDX_ARGS)
            args += [made["xyz"], made["window_size"], made["quant_size"], made["quant_grid_length"],
                     made.get("shift_win", False), first["table_q"], first["table_k"], second["table_v"]]
            nodes.insert(0, rel_idx)

    q_meta = tensor_meta(first["q"])
    info = AttentionInfo(
        form="window",
        heads=q_meta.shape[1] if q_meta else None,
        kv_heads=q_meta.shape[1] if q_meta else None,
        head_dim=q_meta.shape[2] if q_meta else None,
        scale=1.0,  # SpTr's q comes pre-scaled
        rel_pos="contextual" if rel_query and rel_value else "none",
    )
    owner_fqn, owner = owner_of(region, step2)
    return Site(
        kind="attention",
        fqn=site_fqn(owner_fqn, owner, names),
        region=region.fqn,
        classes=class_names(type(owner)),
        info=info,
        input=q_meta,
        output=tensor_meta(step2),
        unsupported="; ".join(problems) or None,
        args=tuple(args),
        output_node=step2,
        nodes=nodes,
    )
