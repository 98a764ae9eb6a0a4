"""Attention with a chosen compute dtype: softmax(q k^T * scale + mask) v, dense or block-sparse.

The numerics every backend of this file follows (the Triton kernels, and the torch reference,
which is what runs on the CPU):
- q, k, v are rounded to the compute dtype;
- q k^T is accumulated in float32 (float64 when the compute dtype is float64), then scaled;
- masks and causality are applied and the softmax is taken in that accumulation dtype;
- the probabilities are rounded to the compute dtype, P V is accumulated like q k^T, and the
  output is rounded to the compute dtype, which is what is returned.
A query row with every key masked out gives zeros (as SDPA does), not NaN, and passes no
gradient. (An additive mask's -inf masks a key out; a finite value, however negative, does not.)

`block_attention` (below `attention_reference`) runs flash-attention Triton kernels on CUDA, forward and
backward, over (batch, heads, seq, head_dim) inputs, skipping the (BLOCK_M, BLOCK_N) tiles of the
score matrix that its layout rules out. The kernels are the custom ops
torch.ops.lowconv.block_attention_forward and _backward (block_attention_triton.py), so that
torch.compile takes them whole and CUDA graphs capture them. `block_attention_sdpa` computes the
same through F.scaled_dot_product_attention, for what SDPA's kernels serve (it visits every tile of
a dense or causal band). Where the Triton numerics differ from the above:
- fp32 operands multiply in 3-pass tf32 (about fp32 accuracy);
- the online softmax rounds exp(s - running max) to the compute dtype before P V (flash
  attention's rounding; the normalizer sums the unrounded values), where the reference rounds
  the normalized probabilities: the same error, not the same bits;
- backward (flash style): P = exp(s - m) / l in fp32 from each row's max m and sum l saved by
  the forward (not lse = m + log l: against a finite mask value such as torch.finfo.min, m + log l
  rounds to m), rounded to the compute dtype for dv; dS = P (dP - delta) in fp32 with
  delta_i = <dO_i, O_i>, rounded to the compute dtype for dq, dk.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from lowconv.kernels.block_attention_triton import TILES
from lowconv.kernels.operands import as_operand

MASK_KINDS = ("none", "additive", "keep", "drop")  # keep: True attends; drop: True is masked out
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("dense", "causal", "local", "causal_local")
BACKENDS = ("auto", "triton", "reference")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def attention_reference(q, k, v, mask=None, *, mask_kind="none", causal=False, scale=None,
                        dropout=0.0, dtype=None):
    """softmax(q k^T * scale + mask) v over (..., heads, seq, head_dim) inputs, in torch (what
    block_attention_reference computes with; check_inputs checks its arguments).

    k and v may have fewer heads than q (GQA): each of their heads serves heads/kv_heads
    consecutive query heads. `mask` broadcasts to (..., heads, seq_q, seq_k), read as
    `mask_kind` says. `causal` keeps key j for query i when j <= i (top-left aligned, as SDPA's
    is_causal). `scale` None is 1/sqrt(head_dim). `dropout` is applied to the probabilities
    (pass 0 outside training). `dtype` None computes in q's dtype.
    """
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
    # Rows with no allowed key (or no key at all): softmax over zeros, then zeroed, so that
    # neither the output nor the gradient is NaN.
    dead = (scores == float("-inf")).all(-1, keepdim=True)
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
    """Raise ValueError naming what is wrong with attention_reference's arguments."""
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


# ---------------------------------------------------------------------------------------------
# Block-sparse attention: layouts, the block layout, the entry point and its reference.
#
# A layout is a band of allowed offsets i - j (query i, key j), lower <= i - j <= upper:
#   dense          no band
#   causal         0 <= i - j                  (top-left aligned, as SDPA's is_causal)
#   local          -W < i - j < W              (W keys on each side, the query's own included)
#   causal_local   0 <= i - j < W              (the query and the W - 1 keys before it)
# A model's mask (bool: True attends; float: added to the scores, -inf masks out) and a key
# padding mask (bool (batch, seq_k): True is padding, as nn.MultiheadAttention's) narrow it
# further. Tiles outside the band are never visited (the kernels loop over the band's span);
# with a mask or padding, the tiles left are listed per row of tiles (BlockLayout) and those
# that the mask or padding rules out entirely are skipped as well. The tiles are
# block_attention_triton.TILES.


class BlockLayout(NamedTuple):
    """Which (BLOCK_M, BLOCK_N) tiles of the scores hold an allowed entry, listed both ways.
    Each is (batch or 1, heads or 1, rows of tiles, columns of tiles) int32: for tile row m,
    `count[..., m]` live tiles, their column indices first in `index[..., m, :]` (ascending);
    `count_t`, `index_t` the same for tile columns (the key tiles' live query tiles)."""
    count: torch.Tensor
    index: torch.Tensor
    count_t: torch.Tensor
    index_t: torch.Tensor


def band(layout, window, seq_q, seq_k):
    """(lower, upper): the layout's allowed offsets i - j; seq_k and seq_q stand for no bound."""
    lower = 0 if layout in ("causal", "causal_local") else -seq_k
    upper = window - 1 if layout in ("local", "causal_local") else seq_q
    if layout == "local":
        lower = 1 - window
    return lower, upper


def block_layout(seq_q, seq_k, *, layout="dense", window=None, mask=None, key_padding_mask=None):
    """The BlockLayout of a layout, a mask and key padding (see above), a few torch ops over the
    mask: compute it once per mask and pass it to block_attention's `blocks`."""
    if mask is None and key_padding_mask is None:
        raise ValueError("block_layout: give a mask or a key_padding_mask (a layout alone needs "
                         "no BlockLayout: the kernels loop over its band)")
    block_m, block_n = TILES.block_m, TILES.block_n
    device = (mask if mask is not None else key_padding_mask).device
    live = band_tiles(layout, window, seq_q, seq_k, device)
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
        while allowed.dim() < 4:
            allowed = allowed[None]
        allowed = allowed.expand(*allowed.shape[:2], seq_q, seq_k)
        live = live & tile_any(allowed, block_m, block_n)
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :].expand(-1, 1, block_m, -1)
        live = live & tile_any(keys, block_m, block_n)
    while live.dim() < 4:
        live = live[None]
    return BlockLayout(*listed(live), *listed(live.transpose(-2, -1)))


def band_tiles(layout, window, seq_q, seq_k, device):
    """(rows of tiles, columns of tiles) bool: the tiles of the layout's band, those whose range
    of offsets i - j meets [lower, upper]."""
    block_m, block_n = TILES.block_m, TILES.block_n
    lower, upper = band(layout, window, seq_q, seq_k)
    first_row = torch.arange(triton.cdiv(seq_q, block_m), device=device)[:, None] * block_m
    first_col = torch.arange(triton.cdiv(seq_k, block_n), device=device)[None, :] * block_n
    last_row = (first_row + block_m).clamp(max=seq_q) - 1
    last_col = (first_col + block_n).clamp(max=seq_k) - 1
    return (first_row - last_col <= upper) & (last_row - first_col >= lower)


def band_pairs(layout, window, seq_q, seq_k, device):
    """(seq_q, seq_k) bool: the pairs (query i, key j) of the layout's band."""
    lower, upper = band(layout, window, seq_q, seq_k)
    offset = torch.arange(seq_q, device=device)[:, None] - torch.arange(seq_k, device=device)[None, :]
    return (offset >= lower) & (offset <= upper)


def skips_tiles(blocks, layout, window, seq_q, seq_k):
    """Whether a BlockLayout (of the same layout) leaves out a tile of the band somewhere: the
    kernels then skip work that a dense or causal kernel does. A bool tensor on blocks' device."""
    return (blocks.count.sum(-1) < band_tiles(layout, window, seq_q, seq_k, blocks.count.device).sum()).any()


def allows_whole_band(mask, key_padding_mask, layout, window, seq_q, seq_k):
    """Whether a mask (bool: True attends; float: added) and key padding (True = padding), either
    None, let every query see every key of the layout's band and add nothing to those scores: the
    band alone then computes the same. A bool tensor on their device."""
    device = (mask if mask is not None else key_padding_mask).device
    whole = torch.ones((), dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        whole = ~key_padding_mask.any()
    if mask is not None:
        free = mask if mask.dtype == torch.bool else mask == 0
        whole = whole & (free | ~band_pairs(layout, window, seq_q, seq_k, device)).all()
    return whole


def tile_any(allowed, block_m, block_n):
    """(..., rows of tiles, columns of tiles): whether each tile of `allowed` (..., Lq, Lk)
    (padded with False to whole tiles) holds a True."""
    *lead, seq_q, seq_k = allowed.shape
    rows, cols = triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n)
    padded = F.pad(allowed, (0, cols * block_n - seq_k, 0, rows * block_m - seq_q))
    return padded.view(*lead, rows, block_m, cols, block_n).any(-1).any(-2)


def listed(live):
    """(count, index) of each row of `live`: how many True, and their columns first, ascending."""
    count = live.sum(-1, dtype=torch.int32).contiguous()
    index = torch.argsort((~live).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
    return count, index


def block_attention(q, k, v, *, layout="dense", window=None, mask=None, key_padding_mask=None,
                    scale=None, dtype=None, blocks=None, skip_masked_tiles=True, backend="auto",
                    validate=True):
    """softmax(q k^T * scale + mask) v over q (batch, heads, seq_q, head_dim) and k, v (batch,
    kv_heads, seq_k, head_dim), kv_heads dividing heads (GQA, MQA), differentiable for q, k, v.

    `layout` is one of LAYOUTS (see above) and `window` W >= 1 goes with the local ones. `mask`
    broadcasts to (batch, heads, seq_q, seq_k): bool (True attends) or float (added; no gradient
    on the Triton path). `key_padding_mask` (batch, seq_k) bool marks padding keys True.
    `scale` None is head_dim^-0.5; `dtype` None computes in q's dtype; the output is in q's
    dtype. `blocks` is block_layout(...) of the same layout, mask and padding, made once per mask
    (None: made here when there is a mask or padding, unless `skip_masked_tiles` is False: then
    every tile of the layout's band is visited and the mask and padding apply elementwise, with
    no pass over the mask). `backend` "auto" runs Triton on CUDA and
    the torch reference elsewhere; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before
    import. A query row with no allowed key gives zeros. `validate` False skips the argument
    checks, for a caller that made them (a call's host time counts at small sizes).
    """
    if validate:
        check_block_inputs(q, k, v, layout, window, mask, key_padding_mask, scale, dtype, backend)
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if not use_triton:
        return block_attention_reference(q, k, v, layout=layout, window=window, mask=mask,
                                         key_padding_mask=key_padding_mask, scale=scale,
                                         dtype=dtype)
    if validate:
        check_triton_inputs(q, dtype)
    out_dtype, dtype = q.dtype, dtype or q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if blocks is None and skip_masked_tiles and (mask is not None or key_padding_mask is not None):
        blocks = block_layout(q.shape[-2], k.shape[-2], layout=layout, window=window, mask=mask,
                              key_padding_mask=key_padding_mask)
    q, k, v = (as_operand(t, dtype) for t in (q, k, v))
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.contiguous()
    lower, upper = band(layout, window, q.shape[2], k.shape[2])
    lists = (None,) * 4 if blocks is None else tuple(blocks)
    out, _ = torch.ops.lowconv.block_attention_forward(q, k, v, mask, key_padding_mask, *lists, lower, upper,
                                                       layout != "dense", scale)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def block_attention_reference(q, k, v, *, layout="dense", window=None, mask=None,
                              key_padding_mask=None, scale=None, dtype=None, dropout=0.0):
    """The torch reference of `block_attention` (same arguments, no checks): `attention_reference`
    with the layout and padding folded into the mask. Memory O(batch heads seq_q seq_k). Also
    takes what the kernels do not: leading dims other than (batch, heads) without key padding,
    and `dropout` on the probabilities (pass 0 outside training)."""
    allowed = band_pairs(layout, window, q.shape[-2], k.shape[-2], q.device)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if mask is None or mask.dtype == torch.bool:
        if mask is not None:
            allowed = allowed & mask
        out = attention_reference(q, k, v, allowed, mask_kind="keep", scale=scale,
                                  dropout=dropout, dtype=dtype)
    else:
        additive = mask.masked_fill(~allowed, float("-inf"))
        out = attention_reference(q, k, v, additive, mask_kind="additive", scale=scale,
                                  dropout=dropout, dtype=dtype)
    return out.to(q.dtype)


def block_attention_sdpa(q, k, v, *, layout="dense", window=None, mask=None, key_padding_mask=None,
                         scale=None, dtype=None, dropout=0.0):
    """`block_attention` through F.scaled_dot_product_attention (same arguments, no checks; like
    the reference it takes other leading dims without key padding, and `dropout`): q, k, v rounded
    to the compute dtype, in which SDPA's kernels compute (fp32 accumulation and softmax, the
    probabilities rounded to it before P V), the output cast back to q's dtype. The band and the
    key padding join the mask (sdpa_mask); a causal band alone is SDPA's is_causal, which with no
    mask runs its flash or cuDNN kernels. An additive mask is rounded to the compute dtype, the
    dtype SDPA takes it in (finite values beyond its range become -inf). A query row with no
    allowed key gives zeros, as everywhere in this file: set here, since not every SDPA kernel
    keeps that rule (on the H100, torch 2.11, fp16 and bf16 with a bool mask did not)."""
    out_dtype, dtype = q.dtype, dtype or q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    attn_mask = sdpa_mask(mask, key_padding_mask, layout, window, q.shape[-2], k.shape[-2], dtype, q.device)
    causal = layout == "causal" and attn_mask is None
    gqa = q.shape[-3] != k.shape[-3]
    if gqa and not flash_takes(q, k, v, attn_mask, causal) and groups_as_rows(q, attn_mask, causal):
        groups = q.shape[-3] // k.shape[-3]
        rows = q.unflatten(-3, (k.shape[-3], groups)).flatten(-3, -2)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale)
        out = out.unflatten(-2, (groups, q.shape[-2])).flatten(-4, -3)
    else:
        if gqa and not flash_takes(q, k, v, attn_mask, causal):
            k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)
    if attn_mask is not None:
        keyless = ~attn_mask.any(-1, keepdim=True) if attn_mask.dtype == torch.bool else (
            attn_mask == float("-inf")).all(-1, keepdim=True)
        out = out.masked_fill(keyless, 0)
    return out.to(out_dtype)


def sdpa_mask(mask, key_padding_mask, layout, window, seq_q, seq_k, dtype, device):
    """The attn_mask SDPA takes for a call: the model's mask with the band and the key padding
    folded in (bool: True attends; float: in `dtype`, -inf where the band or the padding rule a
    key out), or None where there is nothing to mask (a dense band) or only a causal band (SDPA's
    is_causal)."""
    allowed = None
    if layout != "dense" and (layout != "causal" or mask is not None or key_padding_mask is not None):
        allowed = band_pairs(layout, window, seq_q, seq_k, device)
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask if allowed is None else mask & allowed
    mask = mask.to(dtype)
    return mask if allowed is None else mask.masked_fill(~allowed, float("-inf"))


def groups_as_rows(q, attn_mask, causal) -> bool:
    """Whether a GQA call can run as one with as many heads as k and v, each kv head's group of
    query heads as rows of its queries (what a decode step's grouped attention needs: the repeat
    of k and v would copy the whole cache, four times its size at 32 / 8 heads, on every step).
    The rows of a group then share the mask's row: one query, a mask the same for every head,
    and no causal band (its diagonal would move with the row)."""
    mask_heads_one = attn_mask is None or attn_mask.dim() < 3 or attn_mask.shape[-3] == 1
    return q.dim() == 4 and q.shape[-2] == 1 and mask_heads_one and not causal


def flash_takes(q, k, v, attn_mask, causal) -> bool:
    """Whether SDPA can run this call on its flash kernel, which takes k and v with fewer heads than
    q (enable_gqa). SDPA's other fused kernel (efficient) does not, and with enable_gqa where flash
    cannot run SDPA falls back to its math kernel (O(seq^2) memory): k and v are repeated instead.
    The conditions are those of torch's sdp_utils (2.11): no mask, fp16 or bf16, one head_dim
    for q, k, v, a multiple of 8 up to 256, (batch, heads, seq, head_dim) tensors, and causal
    only with as many queries as keys (flash aligns a causal band bottom-right)."""
    head_dim = q.shape[-1]
    return (attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.dim() == 4
            and head_dim == v.shape[-1] and head_dim % 8 == 0 and head_dim <= 256
            and not (causal and q.shape[-2] != k.shape[-2]))


def check_block_inputs(q, k, v, layout, window, mask, key_padding_mask, scale, dtype, backend):
    """Raise ValueError naming what is wrong with block_attention's arguments."""
    mask_kind = "none" if mask is None else "keep" if mask.dtype == torch.bool else "additive"
    check_inputs(q, k, v, mask, mask_kind, False, scale, 0.0, dtype)
    if q.dim() != 4:
        raise ValueError(f"block_attention: q, k, v must be (batch, heads, seq, head_dim), got "
                         f"q of shape {tuple(q.shape)}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"block_attention: v's head_dim {v.shape[-1]} differs from q's and k's "
                         f"{q.shape[-1]}")
    if layout not in LAYOUTS:
        raise ValueError(f"block_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    local = layout in ("local", "causal_local")
    if local and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"block_attention: layout {layout!r} needs a window >= 1, got {window!r}")
    if not local and window is not None:
        raise ValueError(f"block_attention: window goes with the local layouts, not {layout!r}")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or
                                         key_padding_mask.shape != (q.shape[0], k.shape[-2])):
        raise ValueError(f"block_attention: key_padding_mask must be bool (batch, seq_k) = "
                         f"{(q.shape[0], k.shape[-2])}, got {key_padding_mask.dtype} of shape "
                         f"{tuple(key_padding_mask.shape)}")
    if backend not in BACKENDS:
        raise ValueError(f"block_attention: backend must be one of {BACKENDS}, got {backend!r}")


def triton_problem(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run this head_dim and compute dtype; None if they can."""
    if head_dim not in (16, 32, 64, 128):
        return f"the Triton kernels take head_dim 16, 32, 64 or 128, got {head_dim}"
    if dtype not in TRITON_DTYPES:
        return f"the Triton kernels compute in {TRITON_DTYPES}, got {dtype}"
    return None


def check_triton_inputs(q, dtype):
    problem = triton_problem(q.shape[-1], dtype or q.dtype)
    if problem:
        raise ValueError(f"block_attention: {problem}")
