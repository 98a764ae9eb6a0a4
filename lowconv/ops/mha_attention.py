"""The attention op's module for an nn.MultiheadAttention site: a `SparseMultiheadAttention` with
its parameters and state-dict names, its core attention computed as attention_calls.py says."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.ops import attention_calls as calls
from lowconv.ops.attention_calls import SparseAttentionOptions, backend_note, compute_dtype, kernel_band
from lowconv.site import MhaInfo, Site


class SparseMultiheadAttention(nn.Module):
    """nn.MultiheadAttention's parameters, state-dict names and forward; the core attention
    runs through the kernel. Attention weights are not computed: forward returns (out, None),
    except with `weights_when_asked` (a module whose caller is not traced, which may read them):
    a call with need_weights=True then runs nn.MultiheadAttention's own computation.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kdim: int | None = None,
                 vdim: int | None = None, bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, compute_dtype: torch.dtype | None = None,
                 layout: str = "auto", window: int | None = None, device=None, dtype=None,
                 weights_when_asked: bool = False, backend: str = "auto"):
        super().__init__()
        self.weights_when_asked = weights_when_asked
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.batch_first, self.dropout, self.compute_dtype = batch_first, dropout, compute_dtype
        self.layout, self.window, self.backend = layout, window, backend
        # Read by nn.TransformerEncoderLayer; False also keeps it off its fused fast path,
        # which would bypass this module.
        self._qkv_same_embed_dim = False
        new = dict(device=device, dtype=dtype)
        # nn.MultiheadAttention packs the three projections when k and v have embed_dim features.
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        if self.packed:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **new))
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **new))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **new))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **new))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **new)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **new)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if need_weights and self.weights_when_asked:
            return self.with_weights(query, key, value, key_padding_mask, attn_mask, average_attn_weights, is_causal)
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal=True is a hint that attn_mask is causal: "
                               "pass attn_mask too")
        batch_dim = 0 if self.batch_first else 1
        unbatched = query.dim() == 2
        self_attention = query is key and key is value
        if unbatched:
            query, key, value = (x.unsqueeze(batch_dim) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))

        q, k, v = self.project(query, key, value, self_attention)
        n, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for x in (q, k, v))
        # As nn.MultiheadAttention: with no key padding and no weights asked for, the is_causal
        # hint replaces attn_mask (layout "dense" applies attn_mask instead: the same keys, as the
        # hint promises).
        causal = is_causal and key_padding_mask is None and not need_weights and self.layout != "dense"
        if causal:
            attn_mask = None
        dtype = self.compute_dtype or q.dtype
        dropout = self.dropout if self.training else 0.0
        band, listed = kernel_band(self.layout, self.window, causal)
        mask, padding = mha_kernel_masks(attn_mask, key_padding_mask, n, self.num_heads, seq_q, seq_k, q.dtype)
        plan = calls.plan_call(self.backend, q, k, v, dtype, dropout, band, self.window, listed, (mask, padding),
                               (attn_mask, key_padding_mask),
                               ("mha", band, self.window, n, self.num_heads, seq_q, seq_k, q.dtype))
        out = calls.attend(q, k, v, plan, band=band, window=self.window, mask=mask, key_padding_mask=padding,
                           scale=None, dropout=dropout, dtype=dtype)
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out.squeeze(batch_dim) if unbatched else out), None

    def plan_note(self) -> str:
        backend = backend_note(self.backend, self.layout, self.window, False, "per call")
        if not self.weights_when_asked:
            return backend
        return (f"{backend}; its caller is not traced and may read the attention weights: calls with "
                "need_weights=True (nn.MultiheadAttention's default) run nn.MultiheadAttention's own "
                "computation, which returns them; calls with need_weights=False run the kernel")

    def with_weights(self, query, key, value, key_padding_mask, attn_mask, average_attn_weights, is_causal):
        """nn.MultiheadAttention.forward with need_weights=True, on this module's parameters."""
        batched_first = self.batch_first and query.dim() == 3
        if batched_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        separate = {} if self.packed else dict(use_separate_proj_weight=True, q_proj_weight=self.q_proj_weight,
                                                k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight)
        out, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight if self.packed else None,
            self.in_proj_bias, None, None, False, self.dropout, self.out_proj.weight, self.out_proj.bias,
            training=self.training, key_padding_mask=key_padding_mask, need_weights=True, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal, **separate)
        return (out.transpose(0, 1) if batched_first else out), weights

    def project(self, query, key, value, self_attention):
        """q, k, v: for self-attention on packed weights one GEMM, as nn.MultiheadAttention does."""
        if self.packed and self_attention:
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        if self.packed:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        return (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def mha_kernel_masks(attn_mask, key_padding_mask, n, heads, seq_q, seq_k, dtype):
    """nn.MultiheadAttention's two masks as block_attention takes them: (mask, key_padding_mask),
    the mask over (n or 1, heads or 1, seq_q, seq_k), bool (True attends) or float (added), the
    padding bool (n, seq_k), True = padding. (nn.MultiheadAttention's bool masks mean True = not
    allowed.) A float key padding mask is added to the mask, in `dtype`, as the module does."""
    if attn_mask is not None:
        shape = (1, 1, seq_q, seq_k) if attn_mask.dim() == 2 else (n, heads, seq_q, seq_k)
        attn_mask = attn_mask.reshape(shape)
    if key_padding_mask is None or key_padding_mask.dtype == torch.bool:
        keep = ~attn_mask if attn_mask is not None and attn_mask.dtype == torch.bool else attn_mask
        return keep, key_padding_mask
    padding = key_padding_mask.reshape(n, 1, 1, seq_k).to(dtype)
    if attn_mask is None:
        return padding, None
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype,
                                device=attn_mask.device).masked_fill(attn_mask, float("-inf"))
    return attn_mask + padding, None


def mha_site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
    info: MhaInfo = site.info  # its causality and masks come per call
    if None in (info.embed_dim, info.heads, info.batch_first):
        return "nn.MultiheadAttention site without embed_dim/heads/batch_first to rebuild it from"
    return None


def mha_from_site(site: Site, options: SparseAttentionOptions, params: dict) -> SparseMultiheadAttention:
    info: MhaInfo = site.info
    weight = params.get("in_proj_weight", params.get("q_proj_weight"))
    module = SparseMultiheadAttention(
        info.embed_dim, info.heads,
        kdim=params["k_proj_weight"].shape[1] if "k_proj_weight" in params else None,
        vdim=params["v_proj_weight"].shape[1] if "v_proj_weight" in params else None,
        bias="in_proj_bias" in params, batch_first=info.batch_first, dropout=info.dropout,
        compute_dtype=compute_dtype(options), layout=options.layout, window=options.window,
        device=weight.device, dtype=weight.dtype, weights_when_asked=info.weights_unknown, backend=options.backend)
    module.load_state_dict(params)
    return module


def mha_empty(site: Site, options: SparseAttentionOptions) -> SparseMultiheadAttention:
    """As mha_from_site, uninitialized; the parameters take the site's input dtype."""
    info: MhaInfo = site.info
    return SparseMultiheadAttention(
        info.embed_dim, info.heads, kdim=info.kdim, vdim=info.vdim, bias=info.bias,
        batch_first=info.batch_first, dropout=info.dropout,
        compute_dtype=compute_dtype(options), layout=options.layout, window=options.window,
        dtype=getattr(torch, info.dtype), weights_when_asked=info.weights_unknown, backend=options.backend)
