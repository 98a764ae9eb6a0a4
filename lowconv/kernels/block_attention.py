"""Attention with a chosen compute dtype: softmax(q k^T * scale + mask) v.

The numerics every backend of this file follows (the Triton kernels to come, and the torch
reference below, which is what runs on the CPU):
- q, k, v are rounded to the compute dtype;
- q k^T is accumulated in float32 (float64 when the compute dtype is float64), then scaled;
- masks and causality are applied and the softmax is taken in that accumulation dtype;
- the probabilities are rounded to the compute dtype, P V is accumulated like q k^T, and the
  output is rounded to the compute dtype, which is what is returned.
A query row with every key masked out gives zeros (as SDPA does), not NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_KINDS = ("none", "additive", "keep", "drop")  # keep: True attends; drop: True is masked out
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(q, k, v, mask=None, *, mask_kind="none", causal=False, scale=None, dropout=0.0,
              dtype=None):
    """softmax(q k^T * scale + mask) v over (..., heads, seq, head_dim) inputs.

    k and v may have fewer heads than q (GQA): each of their heads serves heads/kv_heads
    consecutive query heads. `mask` broadcasts to (..., heads, seq_q, seq_k). `causal` keeps
    key j for query i when j <= i (top-left aligned, as SDPA's is_causal). `scale` None is
    1/sqrt(head_dim). `dropout` is applied to the probabilities (pass 0 outside training).
    `dtype` None computes in q's dtype.
    """
    check_inputs(q, k, v, mask, mask_kind, causal, scale, dropout, dtype)
    return attention_reference(q, k, v, mask, mask_kind=mask_kind, causal=causal, scale=scale,
                               dropout=dropout, dtype=dtype)


def attention_reference(q, k, v, mask=None, *, mask_kind="none", causal=False, scale=None,
                        dropout=0.0, dtype=None):
    """The torch reference of `attention` (same arguments, no input checks)."""
    dtype = dtype or q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (t.to(dtype).to(acc) for t in (q, k, v))
    k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    scores = (q @ k.transpose(-2, -1)) * scale
    if mask_kind == "additive":
        scores = scores + mask.to(acc)
    allowed = allowed_keys(mask, mask_kind, causal, q.shape[-2], k.shape[-2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # Rows with no allowed key: softmax over zeros, then zeroed, so that neither the output
    # nor the gradient is NaN.
    dead = scores.amax(-1, keepdim=True) == float("-inf")
    probs = scores.masked_fill(dead, 0.0).softmax(-1).masked_fill(dead, 0.0)
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return (probs.to(dtype).to(acc) @ v).to(dtype)


def repeat_kv(x, heads):
    """k or v with its heads repeated up to `heads` (GQA: kv head i serves a run of q heads)."""
    kv_heads = x.shape[-3]
    return x if kv_heads == heads else x.repeat_interleave(heads // kv_heads, dim=-3)


def allowed_keys(mask, mask_kind, causal, seq_q, seq_k, device):
    """The boolean "may attend" matrix from bool masks and causality, or None if all may."""
    allowed = None
    if mask_kind == "keep":
        allowed = mask
    elif mask_kind == "drop":
        allowed = ~mask
    if causal:
        tril = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()
        allowed = tril if allowed is None else allowed & tril
    return allowed


def check_inputs(q, k, v, mask, mask_kind, causal, scale, dropout, dtype):
    """Raise ValueError naming what is wrong with attention's arguments."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"attention: {name} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() < 3:
            raise ValueError(f"attention: {name} must be (..., heads, seq, head_dim), got "
                             f"shape {tuple(t.shape)}")
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(f"attention: q, k, v must have the same number of dims, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.device == k.device == v.device:
        raise ValueError(f"attention: q, k, v are on different devices: {q.device}, "
                         f"{k.device}, {v.device}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (want q (..., H, Lq, D), k (..., Hk, Lk, D), "
                         f"v (..., Hk, Lk, Dv))")
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(f"attention: q's {q.shape[-3]} heads are not a multiple of k's and "
                         f"v's {k.shape[-3]}")
    check_mask(mask, mask_kind, (*q.shape[:-1], k.shape[-2]))
    if not isinstance(causal, bool):
        raise ValueError(f"attention: causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"attention: scale must be a number or None, got {type(scale).__name__}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"attention: dropout must be in [0, 1), got {dropout}")
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"attention: dtype must be one of {COMPUTE_DTYPES} or None, got {dtype}")


def check_mask(mask, mask_kind, scores_shape):
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"attention: mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if (mask is None) != (mask_kind == "none"):
        raise ValueError(f"attention: mask_kind={mask_kind!r} "
                         f"{'needs a mask' if mask is None else 'takes no mask'}")
    if mask is None:
        return
    if mask_kind == "additive" and not mask.is_floating_point():
        raise ValueError(f"attention: an additive mask must be floating-point, got {mask.dtype}")
    if mask_kind in ("keep", "drop") and mask.dtype != torch.bool:
        raise ValueError(f"attention: a {mask_kind!r} mask must be bool, got {mask.dtype}")
    try:
        fits = torch.broadcast_shapes(mask.shape, scores_shape) == torch.Size(scores_shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"the scores' shape {tuple(scores_shape)}")
