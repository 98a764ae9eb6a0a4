"""nn.MultiheadAttention sites: module-backed sites for the MHA modules a traced graph calls
(one per module, over all its calls) and for MHA regions traced on their own, with the
MhaInfo read off the module and the reasons (add_bias_kv, add_zero_attn, used attention
weights) one cannot be converted.
"""
from __future__ import annotations

import torch.fx as fx
from torch import nn

from lowconv.passes.fx_nodes import call_args, is_getitem, submodule
from lowconv.passes.trace import Region, join_fqn
from lowconv.site import MhaInfo, Site, class_names, dtype_name, tensor_meta, value_meta

MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def is_mha_call(region: Region, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(submodule(region, node), nn.MultiheadAttention)


def mha_site(region: Region, target: str) -> Site:
    """The module-backed site of the MHA at `target`, over all of its calls in the graph."""
    calls = [n for n in region.graph.graph.nodes if n.op == "call_module" and n.target == target]
    mha = region.module.get_submodule(target)
    outputs = [u for c in calls for u in c.users if is_getitem(u, c, 0)]
    unsupported = mha_problem(mha)
    if unsupported is None and any(weights_used(c) for c in calls):
        unsupported = "the attention weights it returns are used"
    return Site(
        kind="attention",
        fqn=join_fqn(region.fqn, target),
        region=region.fqn,
        classes=class_names(type(mha)),
        info=mha_info(mha),
        input=tensor_meta(call_args(calls[0], MHA_ARGS).get("query")),
        output=tensor_meta(outputs[0]) if outputs else None,
        unsupported=unsupported,
        output_node=calls[0],
        module_backed=True,
    )


def lone_mha_site(region: Region) -> Site:
    """An MHA region of its own: its caller is not traced, so whether the weights it returns
    are used is unknown (the op computes them as nn.MultiheadAttention does where a call asks)."""
    args = region.example_args
    info = mha_info(region.module)
    info.weights_unknown = True
    return Site(
        kind="attention",
        fqn=region.fqn,
        region=region.fqn,
        classes=class_names(type(region.module)),
        info=info,
        input=value_meta(args[0]) if args else None,
        output=region.output_meta,
        unsupported=mha_problem(region.module),
        module_backed=True,
    )


def mha_info(mha: nn.MultiheadAttention) -> MhaInfo:
    return MhaInfo(form="mha", heads=mha.num_heads, kv_heads=mha.num_heads,
                   head_dim=mha.head_dim, dropout=float(mha.dropout),
                   embed_dim=mha.embed_dim, kdim=mha.kdim, vdim=mha.vdim,
                   bias=mha.in_proj_bias is not None, batch_first=mha.batch_first,
                   dtype=dtype_name(mha.out_proj.weight.dtype))


def mha_problem(mha: nn.MultiheadAttention) -> str | None:
    """Why this MHA's configuration cannot be converted (None: it can)."""
    if mha.bias_k is not None:
        return "nn.MultiheadAttention with add_bias_kv"
    if mha.add_zero_attn:
        return "nn.MultiheadAttention with add_zero_attn"
    return None


def weights_used(call: fx.Node) -> bool:
    """Whether anything uses the attention weights that this MHA call returns."""
    if call_args(call, MHA_ARGS).get("need_weights", True) is False:
        return False
    return any(not is_getitem(u, call, 0) and not (is_getitem(u, call, 1) and not u.users)
               for u in call.users)
