"""nn.MultiheadAttention re-stated in traceable torch, so that a recipe's linear rules reach its
projections.

nn.MultiheadAttention's forward reads in_proj_weight and out_proj.weight itself (in
F.multi_head_attention_forward, or torch's fused inference kernel), so no linear op can take the
place of either. Where a recipe would convert them, the module is replaced before tracing by
ExpandedMultiheadAttention, which holds the same parameters as nn.Linear modules (`in_proj`, or
`q_proj`, `k_proj`, `v_proj` when k and v have their own widths, and the MHA's own `out_proj`) and
computes what F.multi_head_attention_forward computes: F.scaled_dot_product_attention (an sdpa
attention site, which an attention rule may convert too) or, for a call that asks for the
attention weights, the explicit softmax. The plan lists the modules replaced (`expanded_mha`), and
load and compare replace them again before tracing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.passes.mha import mha_problem
from lowconv.passes.rewrite import leave_fused_paths, set_module
from lowconv.passes.trace import has_hooks, join_fqn
from lowconv.site import Site, class_names


class ExpandedMultiheadAttention(nn.Module):
    """nn.MultiheadAttention (without add_bias_kv and add_zero_attn) with nn.Linear projections."""

    # Read by nn.TransformerEncoder(Layer) when choosing their fused paths: False keeps them off
    # those, which would read in_proj_weight instead of calling the projections. They read it from
    # a traced layer too: the layer's graph module holds this module as itself (trace.py).
    _qkv_same_embed_dim = False
    READ_FROM_OUTSIDE_GRAPH = True

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = mha.embed_dim, mha.num_heads, mha.head_dim
        self.batch_first, self.dropout = mha.batch_first, mha.dropout
        self.packed = mha._qkv_same_embed_dim
        bias = mha.in_proj_bias
        if self.packed:
            self.in_proj = linear_of(mha.in_proj_weight, bias)
        else:
            biases = bias.chunk(3) if bias is not None else (None,) * 3
            self.q_proj, self.k_proj, self.v_proj = (
                linear_of(w, b if b is None else nn.Parameter(b.detach().clone(), b.requires_grad))
                for w, b in zip((mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight), biases))
        self.out_proj = mha.out_proj

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """What nn.TransformerEncoderLayer checks for None before its fused path."""
        return (self.in_proj if self.packed else self.q_proj).bias

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        self_attention = query is key and key is value
        if not self.batch_first:
            given = query
            query, key, value = (batch_first_of(x) for x in (query, key, value))
        q, k, v = self.project(query, key, value, self_attention)
        q, k, v = (x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3) for x in (q, k, v))
        causal = is_causal and key_padding_mask is None and not need_weights  # the hint replaces the mask
        masked = not causal and (attn_mask is not None or key_padding_mask is not None)
        mask = additive_mask(attn_mask, key_padding_mask, q, self.num_heads) if masked else None
        dropout = self.dropout if self.dropout and self.training else 0.0
        if need_weights:
            scores = (q * self.head_dim ** -0.5) @ k.transpose(-2, -1)
            weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            weights = F.dropout(weights, dropout) if dropout else weights
            out = weights @ v
            weights = weights.mean(dim=-3) if average_attn_weights else weights
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
            weights = None
        out = self.out_proj(out.transpose(-2, -3).flatten(-2))
        return (out if self.batch_first else seq_first_like(out, given)), weights

    def project(self, query, key, value, self_attention):
        """q, k, v (..., seq, embed_dim): one GEMM for self-attention on packed weights, as
        nn.MultiheadAttention; otherwise three, on slices of in_proj's weight (no linear site).
        Pieces are taken by index: iterating a traced value would be a branch decided at tracing."""
        if not self.packed:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self_attention:
            qkv = self.in_proj(query).chunk(3, -1)
            return qkv[0], qkv[1], qkv[2]
        weights, bias = self.in_proj.weight.chunk(3), self.in_proj.bias
        biases = bias.chunk(3) if bias is not None else None
        return tuple(F.linear(x, weights[i], None if biases is None else biases[i])
                     for i, x in enumerate((query, key, value)))


def linear_of(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An nn.Linear holding these very parameters."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


# The helpers below branch on their inputs' rank and dtype: each is traced as one call (torch.fx.wrap),
# so the graph holds no branch that tracing would decide by the example inputs.
@torch.fx.wrap
def batch_first_of(x: torch.Tensor) -> torch.Tensor:
    """A sequence-first input (seq, batch, embed) as (batch, seq, embed); an unbatched one as it is."""
    return x.transpose(0, 1) if x.dim() == 3 else x


@torch.fx.wrap
def seq_first_like(out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The output in the layout of the sequence-first input it was `given`."""
    return out.transpose(0, 1) if given.dim() == 3 else out


@torch.fx.wrap
def additive_mask(attn_mask, key_padding_mask, q: torch.Tensor, heads: int):
    """attn_mask and key_padding_mask as one float mask in q's dtype, added to the scores (bool:
    True rules the key out, as nn.MultiheadAttention reads it), broadcastable to q's (..., heads,
    seq_q, seq_k); None without either."""
    mask = None
    if attn_mask is not None:
        mask = as_additive(attn_mask, q.dtype)
        if mask.dim() == 3 and q.dim() == 4:  # (batch * heads, seq_q, seq_k) of a batched call
            mask = mask.unflatten(0, (-1, heads))
    if key_padding_mask is not None:
        padding = as_additive(key_padding_mask, q.dtype).unsqueeze(-2).unsqueeze(-2)
        mask = padding if mask is None else mask + padding
    return mask


def as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask


def projection_sites(fqn: str, mha: nn.MultiheadAttention) -> list[Site]:
    """The linear sites its expansion would have (names and classes: what recipe rules match)."""
    names = ["in_proj"] if mha._qkv_same_embed_dim else ["q_proj", "k_proj", "v_proj"]
    linear = class_names(nn.Linear)
    return [Site("linear", join_fqn(fqn, name), "", linear, None) for name in names] + [
        Site("linear", join_fqn(fqn, "out_proj"), "", class_names(type(mha.out_proj)), None)]


def mha_to_expand(model: nn.Module, converts) -> list[str]:
    """FQNs of the nn.MultiheadAttention modules to expand: those of torch's own forward, without
    hooks or an unsupported configuration, of which `converts(site)` says a projection converts."""
    return [fqn for fqn, module in model.named_modules()
            if isinstance(module, nn.MultiheadAttention) and type(module).forward is nn.MultiheadAttention.forward
            and not has_hooks(module) and mha_problem(module) is None
            and any(converts(site) for site in projection_sites(fqn, module))]


def expand_mha(model: nn.Module, fqns: list[str]) -> nn.Module:
    """`model` with the nn.MultiheadAttention at each FQN replaced, in place, by its expansion."""
    expanded = []
    for fqn in fqns:
        mha = model.get_submodule(fqn)
        if not isinstance(mha, nn.MultiheadAttention):
            raise ValueError(f"{fqn} is a {type(mha).__name__}, not the nn.MultiheadAttention to expand")
        expanded.append(ExpandedMultiheadAttention(mha).train(mha.training))
        model = set_module(model, fqn, expanded[-1])
    leave_fused_paths(model, expanded)
    return model
