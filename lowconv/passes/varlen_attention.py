"""Find flash-attn's variable-length self-attention calls (lowconv.compat.flash_attn) in a traced
region: each row attends within its segment of cu_seqlens, as window attention over windows given
by offsets does. Point Transformer V3's serialized-patch attention is one:

    flash_attn.flash_attn_varlen_qkvpacked_func(qkv.half().reshape(-1, 3, H, C // H), cu_seqlens,
                                                max_seqlen=patch_size, dropout_p=0, softmax_scale=scale)

Each call becomes a site whose op (ops/varlen_attention.py) takes the call's tensors and cu_seqlens.
What the window kernel does not compute is kept, with the reason: queries and keys in different
segments (cu_seqlens_q and cu_seqlens_k not one tensor), causal or sliding-window masks,
softcapping, ALiBi, dropout, the probabilities returned, a paged KV cache, a softmax_scale computed
at run time, keys and values of another head_dim. Keys and values with fewer heads (grouped-query
attention) are served to the queries' heads as flash-attn does.
"""
from __future__ import annotations

import torch.fx as fx

from lowconv.compat import flash_attn
from lowconv.passes.attention import attention_site
from lowconv.passes.fx_nodes import uncast
from lowconv.passes.trace import Region
from lowconv.site import AttentionInfo, Site, tensor_meta

# What the window kernel computes of each optional argument: its value there, and why another is kept.
COMPUTED = {
    "dropout_p": (0.0, "dropout (dropout_p = {}): the window-attention kernel has none"),
    "causal": (False, "a causal mask within each segment"),
    "window_size": ((-1, -1), "flash-attn's sliding window (window_size = {})"),
    "softcap": (0.0, "softcapped scores (softcap = {})"),
    "alibi_slopes": (None, "ALiBi slopes"),
    "return_attn_probs": (False, "it returns the attention probabilities too"),
    "block_table": (None, "a paged KV cache (block_table)"),
}


def find_varlen_attention_sites(region: Region, names: dict[str, set[str]] | None = None) -> list[Site]:
    """The flash-attn varlen calls of `region`; `names` as in find_attention_sites."""
    if region.graph is None:
        return []
    functions = flash_attn.varlen_functions()
    names = {} if names is None else names
    return [varlen_site(region, node, functions[node.target], names) for node in region.graph.graph.nodes
            if node.op == "call_function" and node.target in functions]


def varlen_site(region: Region, node: fx.Node, function: str, names: dict[str, set[str]]) -> Site:
    parameters = flash_attn.parameter_names(function)
    args = flash_attn.defaults(function) | dict(zip(parameters, node.args)) | node.kwargs
    problems = [f"flash-attn's {function} takes no argument {key!r}" for key in args if key not in parameters]
    problems += [f"it has no {name} argument" for name in parameters[:len(flash_attn.VARLEN_FUNCTIONS[function])]
                 if name not in args]
    if problems:
        return varlen_attention_site(region, node, None, AttentionInfo(form="varlen"), problems, (), names)
    tensors = [args[name] for name in flash_attn.TENSORS[function]]
    offsets = args.get("cu_seqlens", args.get("cu_seqlens_q"))
    if "cu_seqlens_k" in args and uncast(args["cu_seqlens_k"]) is not uncast(offsets):
        problems.append("queries and keys in segments of their own (cu_seqlens_q is not cu_seqlens_k)")
    for name, (value, why) in COMPUTED.items():
        if name in args and not same_constant(args[name], value):
            problems.append(why.format(args[name]))
    heads = [head_shape(t, packed) for t, packed in zip(tensors, flash_attn.PACKED[function])]
    if None not in heads and not serves_queries(heads):
        problems.append(f"keys or values whose (heads, head_dim) do not serve the queries' "
                        f"({', '.join(map(str, heads))}): the keys and values need the queries' head_dim and a "
                        f"number of heads that divides theirs")
    scale = args["softmax_scale"]
    if not (scale is None or isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        problems.append("a softmax_scale computed at run time")
        scale = None
    info = AttentionInfo(form="varlen", heads=heads[0][0] if heads[0] else None,
                         kv_heads=heads[-1][0] if heads[-1] else None, head_dim=heads[0][1] if heads[0] else None,
                         scale=None if scale is None else float(scale), causal=args["causal"] is True,
                         dropout=args["dropout_p"] if isinstance(args["dropout_p"], float) else 0.0)
    return varlen_attention_site(region, node, tensors[0], info, problems, (*tensors, offsets), names)


def serves_queries(heads: list[tuple[int, int]]) -> bool:
    """Whether the (heads, head_dim) of q[, kv or k, v] make attention flash-attn computes: keys and
    values alike, the queries' head_dim, heads that divide the queries' (grouped-query attention)."""
    (q_heads, head_dim), (kv_heads, _) = heads[0], heads[-1]
    return len(set(heads[1:])) <= 1 and all(d == head_dim for _, d in heads) and q_heads % kv_heads == 0


def head_shape(tensor, packed: bool) -> tuple[int, int] | None:
    """(heads, head_dim) of a call's tensor (T, h, d), or packed (T, 2 or 3, h, d); None if unknown."""
    meta = tensor_meta(tensor)
    return tuple(meta.shape[-2:]) if meta and meta.shape and len(meta.shape) == (4 if packed else 3) else None


def same_constant(value, expected) -> bool:
    """Whether an argument is the constant `expected` (a list for a tuple, 0 for 0.0: as written)."""
    if isinstance(value, fx.Node):
        return False
    if isinstance(expected, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == expected
    return value is expected if expected is None or isinstance(expected, bool) else value == expected


def varlen_attention_site(region: Region, node: fx.Node, first, info: AttentionInfo, problems: list[str], args,
                          names: dict[str, set[str]]) -> Site:
    """The site of one varlen call, `first` its first tensor."""
    return attention_site(region, node, names, info=info, input=tensor_meta(first), problems=problems,
                          args=tuple(args), nodes=[node])
