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
torch.ops.lowconv.block_attention_forward and _backward (at the end of the file), so that
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
import triton.language as tl

from lowconv.kernels.triton_ops import triton_op, wrap
from lowconv.kernels.operands import as_operand
from lowconv.kernels.window_attention_triton import _dot, dot_precision

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
# that the mask or padding rules out entirely are skipped as well.


class Tiles(NamedTuple):
    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int = 3  # software-pipelining depth (Triton's default)


# The tiles of a BlockLayout (a mask or key padding): one shape for the forward and both
# backward kernels, so that they share it. FlashAttention-2's usual 64 x 64 with 4 warps.
TILES = Tiles(64, 64, 4)

# Launches without a BlockLayout (a band alone: dense, causal, local) may run each kernel on its
# own tiles, by head_dim, for fp16 and bf16. Measured on the H100 (scripts/tune_block_attention.py,
# 8 x 16 x 4096, causal and local W = 256): 64 x 64 with 4 warps was the fastest or within noise
# for every kernel, 128-query tiles 10-100% slower; at head_dim 128 the backward kernels gain
# about 11% from 2 pipeline stages instead of 3.
BAND_TILES = {
    "_forward_kernel": {d: TILES for d in (16, 32, 64, 128)},
    "_backward_query_kernel": {16: TILES, 32: TILES, 64: TILES, 128: TILES._replace(num_stages=2)},
    "_backward_key_kernel": {16: TILES, 32: TILES, 64: TILES, 128: TILES._replace(num_stages=2)},
}


def pipeline_stages(dtype):
    """Software-pipelining depth on TILES: Triton's default 3, but 1 for fp32, whose tiles take
    twice the bytes (at head_dim 128, 2 stages of the backward key kernel need 289 KB of shared
    memory, beyond the H100's 227 KB; 1 stage needs 224 KB)."""
    return 1 if dtype == torch.float32 else 3


def kernel_tiles(kernel_name, head_dim, dtype, listed):
    """The tiles `kernel_name` runs on: TILES with a BlockLayout (listed) and for fp32, else
    its BAND_TILES."""
    if listed or dtype == torch.float32:
        return TILES._replace(num_stages=pipeline_stages(dtype))
    return BAND_TILES[kernel_name][head_dim]


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


def kernel_mask(mask, batch, heads, seq_q, seq_k):
    """The model's mask as the kernels read it: a (batch, heads, seq_q, seq_k) view (broadcast
    dimensions have stride 0), and its kind, "none", "bool" or "additive"."""
    if mask is None:
        return None, "none"
    while mask.dim() < 4:
        mask = mask[None]
    view = mask.expand(batch, heads, seq_q, seq_k)
    if mask.dtype == torch.bool:
        return view, "bool"
    return view, "additive"


class Launch:
    """The arguments and tile sizes every kernel of this family shares (the ops' arguments, see
    block_attention_forward)."""

    def __init__(self, q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale):
        self.batch, self.heads, self.seq_q, self.head_dim = q.shape
        self.kv_heads, self.seq_k = k.shape[1], k.shape[2]
        self.runs_nothing = 0 in (self.batch, self.heads, self.seq_q, self.seq_k)
        self.listed, self.dtype = count is not None, q.dtype
        mask, kind = kernel_mask(mask, self.batch, self.heads, self.seq_q, self.seq_k)
        # The arguments after the tensors and each kernel's lists (query tiles' lists, then key
        # tiles'), built once for the three launches.
        self.args = (self.heads, self.heads // self.kv_heads, self.seq_q, self.seq_k, lower, upper,
                     scale, *(mask.stride() if mask is not None else (0, 0, 0, 0)))
        self.lists = ((None, None, 0, 0),) * 2 if count is None else (
            tile_lists(count, index), tile_lists(count_t, index_t))
        self.options = dict(D=self.head_dim, BANDED=banded, MASK=kind, PADDING=padding is not None,
                            LISTED=self.listed, PRECISION=dot_precision(q.dtype, q.is_cuda))
        self.masks = (mask, padding)

    def new_like(self, t: torch.Tensor) -> torch.Tensor:
        """An output the kernels fill; zeros where they run no program (no query or no key: the
        output and every gradient are 0, as SDPA's)."""
        return torch.zeros_like(t) if self.runs_nothing else torch.empty_like(t)

    def run(self, kernel, *tensors, transposed, launcher=None):
        """Launch `kernel` over its tiles (of queries, or with `transposed` of keys) and the batch
        and its heads (kv heads when transposed: a program sums over its group). The ops launch
        through `launcher`, triton_ops.wrap(kernel), which torch.compile can trace; else directly."""
        if self.runs_nothing:
            return
        tiles = kernel_tiles(kernel.__name__, self.head_dim, self.dtype, self.listed)
        launcher = launcher or kernel
        if transposed:
            grid = (triton.cdiv(self.seq_k, tiles.block_n), self.batch * self.kv_heads)
        else:
            grid = (triton.cdiv(self.seq_q, tiles.block_m), self.batch * self.heads)
        count, index, list_sb, list_sh = self.lists[transposed]
        launcher[grid](*tensors, *self.masks, count, index, *self.args, list_sb, list_sh, **self.options,
                       BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                       num_stages=tiles.num_stages)


def tile_lists(count, index):
    """A BlockLayout's (count, index) for one direction and count's (batch, head) strides, 0
    where it broadcasts."""
    strides = (0 if size == 1 else stride for size, stride in zip(count.shape[:2], count.stride()[:2]))
    return (count, index, *strides)


# The row statistics' buffer (stats): row_max and row_inv_sum, each (batch, heads, seq_q).
STATS = 2

# The band's bounds change with the window and the sequence: one compile for all of them (Triton
# would otherwise compile again for a bound that is 1 or a multiple of 16).
BAND_ARGS = ("lower", "upper")


@triton.jit
def _load_rows(ptr, base, rows, n, D: tl.constexpr):
    """Rows `rows` (zeros at n and past) of the (seq, D) matrix of one head at ptr + base."""
    offs = base + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=(rows < n)[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, base, rows, n, D: tl.constexpr, block):
    offs = base + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, block.to(ptr.dtype.element_ty), mask=(rows < n)[:, None])


@triton.jit
def _span(first, last, n, lo_offset, hi_offset, BLOCK: tl.constexpr):
    """The partners p of rows first..last with lo_offset <= p - row <= hi_offset, below n: the
    first (rounded down to a whole BLOCK, for aligned loads) and the number of BLOCKs."""
    lo = tl.maximum(first + lo_offset, 0) // BLOCK * BLOCK
    hi = tl.minimum(last + hi_offset + 1, n)
    return lo, tl.maximum(tl.cdiv(hi - lo, BLOCK), 0)


@triton.jit
def _partner_tiles(tile, first, last, n, lo_offset, hi_offset, count, list_row,
                   LISTED: tl.constexpr, BLOCK: tl.constexpr):
    """Where the partner tiles of a tile start and how many there are: the band's span, or
    with LISTED the live tiles of its BlockLayout row (list_row: the row's offset in count)."""
    lo, n_tiles = _span(first, last, n, lo_offset, hi_offset, BLOCK)
    if LISTED:
        n_tiles = tl.load(count + list_row + tile)
    return lo, n_tiles


@triton.jit
def _partner_start(i, lo, index, list_row, tile, TILES_PER_ROW, LISTED: tl.constexpr,
                   BLOCK: tl.constexpr):
    """The first partner of the i-th partner tile."""
    if LISTED:
        return tl.load(index + (list_row + tile) * TILES_PER_ROW + i) * BLOCK
    return lo + i * BLOCK


@triton.jit
def _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                   mask_sb, mask_sh, mask_sq, mask_sk,
                   BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr):
    """Scores s (rows, cols) with the model's additive mask added and -inf where a key is not
    allowed: past the ends, outside the band, padding, or False in a bool mask."""
    allowed = (rows[:, None] < Lq) & (cols[None, :] < Lk)
    if BANDED:
        offset = rows[:, None] - cols[None, :]
        allowed = allowed & (offset >= lower) & (offset <= upper)
    if PADDING:
        is_padding = tl.load(padding + b.to(tl.int64) * Lk + cols, mask=cols < Lk, other=1)
        allowed = allowed & (is_padding == 0)[None, :]
    if MASK != "none":
        offs = (b.to(tl.int64) * mask_sb + h.to(tl.int64) * mask_sh
                + rows.to(tl.int64)[:, None] * mask_sq + cols.to(tl.int64)[None, :] * mask_sk)
        if MASK == "bool":
            allowed = allowed & (tl.load(mask + offs, mask=allowed, other=0) != 0)
        else:
            s += tl.load(mask + offs, mask=allowed, other=0.0).to(tl.float32)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _stat_rows(stat, bh, rows, Lq, BH):
    """Where the rows' statistic `stat` (0 max, 1 1 / sum) lies in stats, a (STATS, BH, Lq)
    buffer."""
    return (stat * BH + bh).to(tl.int64) * Lq + rows


@triton.jit
def _row_softmax(stats, bh, rows, Lq, BH):
    """The rows' softmax max and 1 / sum (0 past Lq: no probability there)."""
    ok = rows < Lq
    return (tl.load(stats + _stat_rows(0, bh, rows, Lq, BH), mask=ok, other=0.0),
            tl.load(stats + _stat_rows(1, bh, rows, Lq, BH), mask=ok, other=0.0))


@triton.jit
def _row_stats(stats, delta, bh, rows, Lq, BH):
    """The rows' softmax max, 1 / sum and delta (0 past Lq; delta is (BH, Lq))."""
    m, inv_l = _row_softmax(stats, bh, rows, Lq, BH)
    return m, inv_l, tl.load(delta + bh.to(tl.int64) * Lq + rows, mask=rows < Lq, other=0.0)


@triton.jit
def _query_tile(H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D: tl.constexpr,
                LISTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query tile of one (batch, head): (tile, bh, b, h, q_base, kv_base (its kv
    head's), rows, list_row, and lo, n_tiles of the key tiles of the band i - upper <= j <= i - lower)."""
    # Last tiles first: under a causal band they have the most keys, and the short ones then
    # fill the machine at the end of the launch.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_base = bh.to(tl.int64) * Lq * D
    kv_base = (b * (H // GROUP) + h // GROUP).to(tl.int64) * Lk * D
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    list_row = b * list_sb + h * list_sh
    lo, n_tiles = _partner_tiles(tile, tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, Lk, -upper,
                                 -lower, count, list_row, LISTED, BLOCK_N)
    return tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles


@triton.jit
def _interior(first, last, lo, n_tiles, n, lo_offset, hi_offset, BANDED: tl.constexpr,
              MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """The partner tiles [start, end) (of the n_tiles from lo, see _span) that need no masking:
    each of their pairs in the band, each partner below n. The tiles before and after are the
    band's edges. With MASKED (a model mask or padding: masking everywhere) there are none."""
    if MASKED:
        return n_tiles, n_tiles
    end = tl.minimum(tl.maximum(n - lo, 0) // BLOCK, n_tiles)
    if BANDED:
        # partner - row >= lo_offset for the last row, <= hi_offset for the first.
        start = tl.cdiv(tl.maximum(last + lo_offset - lo, 0), BLOCK)
        end = tl.minimum(end, tl.maximum(first + hi_offset - lo + 1, 0) // BLOCK)
        return tl.minimum(start, end), end
    return 0, end


@triton.jit
def _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk, lower, upper,
                     scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk, D: tl.constexpr,
                     BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr,
                     LISTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                     EDGE: tl.constexpr):
    """The query tile's i-th key tile: its k and v rows and the scaled scores, masked on an EDGE
    tile (interior ones need none)."""
    first = _partner_start(i, lo, index, list_row, tile, tl.cdiv(Lk, BLOCK_N), LISTED, BLOCK_N)
    cols = first + tl.arange(0, BLOCK_N)
    kb = _load_rows(k, kv_base, cols, Lk, D)
    vb = _load_rows(v, kv_base, cols, Lk, D)
    s = _dot(qb, tl.trans(kb), PRECISION) * scale
    if EDGE:
        s = _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                           mask_sb, mask_sh, mask_sq, mask_sk, BANDED, MASK, PADDING)
    return kb, vb, s


@triton.jit
def _forward_tiles(start, end, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
                   Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                   D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                   PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr, EDGE: tl.constexpr):
    """The online softmax (m, l, acc) over key tiles start..end-1."""
    dtype = qb.dtype
    for i in range(start, end):
        kb, vb, s = _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk,
                                     lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                                     D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, EDGE)
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = m_new
        if EDGE:  # a row can still be all -inf here
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(dtype), vb, PRECISION)
        m = m_new
    return m, l, acc


@triton.jit(do_not_specialize=BAND_ARGS)
def _forward_kernel(q, k, v, out, stats, mask, padding, count, index,
                    H, GROUP, Lq, Lk, lower, upper, scale,
                    mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                    D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                    PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_M queries of one (batch, head): online softmax over its key tiles, the
    band's edge tiles masked, the interior ones not."""
    scale = tl.cast(scale, tl.float32)  # fp32 as launched directly; wrapped by inductor, a Python float arrives as fp64
    tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles = _query_tile(
        H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D, LISTED, BLOCK_M, BLOCK_N)
    start, end = _interior(tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, lo, n_tiles, Lk, -upper, -lower,
                           BANDED, MASK != "none" or PADDING, BLOCK_N)
    qb = _load_rows(q, q_base, rows, Lq, D)
    # m starts at -inf and exp() is taken against 0 while a row has seen nothing but -inf, so
    # a row whose keys are all masked so far keeps l = 0 (and a finite mask value still counts).
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m, l, acc = _forward_tiles(0, start, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    m, l, acc = _forward_tiles(start, end, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, False)
    m, l, acc = _forward_tiles(end, n_tiles, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    # A row with no allowed key: output 0, and 1 / sum = 0 so that backward's P is 0 there.
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    _store_rows(out, q_base, rows, Lq, D, acc * inv_l[:, None])
    BH = tl.num_programs(1)
    tl.store(stats + _stat_rows(0, bh, rows, Lq, BH), tl.where(m == float("-inf"), 0.0, m), mask=rows < Lq)
    tl.store(stats + _stat_rows(1, bh, rows, Lq, BH), inv_l, mask=rows < Lq)


@triton.jit
def _dq_tiles(start, end, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile,
              rows, b, h, Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
              D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr,
              LISTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
              EDGE: tl.constexpr):
    """dq accumulated over key tiles start..end-1."""
    dtype = qb.dtype
    for i in range(start, end):
        kb, vb, s = _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk,
                                     lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                                     D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, EDGE)
        p = tl.exp(s - m[:, None]) * inv_l[:, None]
        dp = _dot(dob, tl.trans(vb), PRECISION)
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dqb += _dot(ds, kb, PRECISION)
    return dqb


@triton.jit(do_not_specialize=BAND_ARGS)
def _backward_query_kernel(q, k, v, do, out, stats, delta, dq, mask, padding, count, index,
                           H, GROUP, Lq, Lk, lower, upper, scale,
                           mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                           D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                           PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq for one tile of BLOCK_M queries of one (batch, head), over the forward's key tiles; and
    the tile's delta (<dO_i, O_i>, fp32, into `delta`), which the key kernel reads."""
    scale = tl.cast(scale, tl.float32)
    tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles = _query_tile(
        H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D, LISTED, BLOCK_M, BLOCK_N)
    start, end = _interior(tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, lo, n_tiles, Lk, -upper, -lower,
                           BANDED, MASK != "none" or PADDING, BLOCK_N)
    qb = _load_rows(q, q_base, rows, Lq, D)
    dob = _load_rows(do, q_base, rows, Lq, D)
    BH = tl.num_programs(1)
    m, inv_l = _row_softmax(stats, bh, rows, Lq, BH)
    row_delta = tl.sum(dob.to(tl.float32) * _load_rows(out, q_base, rows, Lq, D).to(tl.float32), 1)
    tl.store(delta + bh.to(tl.int64) * Lq + rows, row_delta, mask=rows < Lq)
    dqb = tl.zeros([BLOCK_M, D], tl.float32)
    dqb = _dq_tiles(0, start, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    dqb = _dq_tiles(start, end, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, False)
    dqb = _dq_tiles(end, n_tiles, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    _store_rows(dq, q_base, rows, Lq, D, dqb * scale)


@triton.jit
def _dkdv_tiles(start, end, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH, q_base, bh, lo,
                index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
                mask_sb, mask_sh, mask_sq, mask_sk, D: tl.constexpr, BANDED: tl.constexpr,
                MASK: tl.constexpr, PADDING: tl.constexpr, LISTED: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr):
    """dk, dv of a key tile accumulated over one query head's query tiles start..end-1."""
    dtype = kb.dtype
    for i in range(start, end):
        first = _partner_start(i, lo, index, list_row, tile, tl.cdiv(Lq, BLOCK_M), LISTED, BLOCK_M)
        rows = first + tl.arange(0, BLOCK_M)
        qb = _load_rows(q, q_base, rows, Lq, D)
        dob = _load_rows(do, q_base, rows, Lq, D)
        m, inv_l, row_delta = _row_stats(stats, delta, bh, rows, Lq, BH)
        s = _dot(qb, tl.trans(kb), PRECISION) * scale
        if EDGE:
            s = _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                               mask_sb, mask_sh, mask_sq, mask_sk, BANDED, MASK, PADDING)
        p = tl.exp(s - m[:, None]) * inv_l[:, None]
        dvb += _dot(tl.trans(p.to(dtype)), dob, PRECISION)
        dp = _dot(dob, tl.trans(vb), PRECISION)
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dkb += _dot(tl.trans(ds), qb, PRECISION)
    return dkb, dvb


@triton.jit(do_not_specialize=BAND_ARGS)
def _backward_key_kernel(q, k, v, do, stats, delta, dk, dv, mask, padding, count, index,
                         H, GROUP, Lq, Lk, lower, upper, scale,
                         mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                         D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                         PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv for one tile of BLOCK_N keys of one (batch, kv head): the sum over the GROUP query
    heads it serves (in one program, so no atomics) of each head's live query tiles (`count`,
    `index`: the BlockLayout's transposed lists)."""
    scale = tl.cast(scale, tl.float32)
    tile = tl.program_id(0)
    bkv = tl.program_id(1)
    b = bkv // (H // GROUP)
    kv_base = bkv.to(tl.int64) * Lk * D
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = _load_rows(k, kv_base, cols, Lk, D)
    vb = _load_rows(v, kv_base, cols, Lk, D)
    dkb = tl.zeros([BLOCK_N, D], tl.float32)
    dvb = tl.zeros([BLOCK_N, D], tl.float32)
    BH = tl.num_programs(1) * GROUP  # the grid is over kv heads
    for g in range(GROUP):
        h = bkv % (H // GROUP) * GROUP + g
        bh = b * H + h
        q_base = bh.to(tl.int64) * Lq * D
        list_row = b * list_sb + h * list_sh
        # Queries i of the band: j + lower <= i <= j + upper.
        lo, n_tiles = _partner_tiles(tile, tile * BLOCK_N, tile * BLOCK_N + BLOCK_N - 1, Lq,
                                     lower, upper, count, list_row, LISTED, BLOCK_M)
        start, end = _interior(tile * BLOCK_N, tile * BLOCK_N + BLOCK_N - 1, lo, n_tiles, Lq, lower, upper,
                               BANDED, MASK != "none" or PADDING, BLOCK_M)
        dkb, dvb = _dkdv_tiles(0, start, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            True)
        dkb, dvb = _dkdv_tiles(start, end, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            False)
        dkb, dvb = _dkdv_tiles(end, n_tiles, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            True)
    _store_rows(dk, kv_base, cols, Lk, D, dkb * scale)
    _store_rows(dv, kv_base, cols, Lk, D, dvb)


# ---------------------------------------------------------------------------------------------
# The kernels as custom ops (kernels/triton_ops.py): q, k, v in the compute dtype and contiguous; the
# model's mask as block_attention takes it (bool: True attends; float: added); the key padding
# contiguous bool (batch, seq_k), True = padding; a BlockLayout's four lists or four Nones; the
# band's bounds (lower, upper), whether it bounds anything (not dense), and the scale.


@triton_op("lowconv::block_attention_forward", mutates_args=())
def block_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            padding: torch.Tensor | None, count: torch.Tensor | None, index: torch.Tensor | None,
                            count_t: torch.Tensor | None, index_t: torch.Tensor | None, lower: int, upper: int,
                            banded: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: the output, and per query row (STATS, batch, heads, seq_q) the max its
    softmax's exp() was taken against and 1 / the sum, which the backward reads (one buffer:
    fewer allocations and kernel arguments). count_t, index_t are for the backward; autograd
    (register_autograd below) gives q, k, v their gradients."""
    launch = Launch(q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale)
    out = launch.new_like(q)
    stats = q.new_empty((STATS, *q.shape[:3]), dtype=torch.float32)
    launch.run(_forward_kernel, q, k, v, out, stats, transposed=False, launcher=wrap(_forward_kernel))
    return out, stats


@triton_op("lowconv::block_attention_backward", mutates_args=())
def block_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, stats: torch.Tensor, mask: torch.Tensor | None,
                             padding: torch.Tensor | None, count: torch.Tensor | None, index: torch.Tensor | None,
                             count_t: torch.Tensor | None, index_t: torch.Tensor | None, lower: int, upper: int,
                             banded: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the forward's inputs, output and stats and the output's gradient (in the
    compute dtype, contiguous)."""
    launch = Launch(q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale)
    dq, dk, dv = (launch.new_like(t) for t in (q, k, v))
    # delta_i = <dO_i, O_i>: the query kernel writes it (from the tiles it loads anyway), the key
    # kernel, launched after it, reads it.
    delta = q.new_empty(q.shape[:3], dtype=torch.float32)
    launch.run(_backward_query_kernel, q, k, v, grad_out, out, stats, delta, dq, transposed=False,
               launcher=wrap(_backward_query_kernel))
    launch.run(_backward_key_kernel, q, k, v, grad_out, stats, delta, dk, dv, transposed=True,
               launcher=wrap(_backward_key_kernel))
    return dq, dk, dv


def save_for_backward(ctx, inputs, output):
    q, k, v, *masks_and_lists, lower, upper, banded, scale = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *masks_and_lists)
    ctx.band = (lower, upper, banded, scale)
    ctx.mark_non_differentiable(stats)


def attention_backward(ctx, grad_out, _):
    q, k, v, out, stats, *masks_and_lists = ctx.saved_tensors
    grads = torch.ops.lowconv.block_attention_backward(as_operand(grad_out, q.dtype), q, k, v, out, stats,
                                                       *masks_and_lists, *ctx.band)
    return *grads, *(None,) * (len(masks_and_lists) + len(ctx.band))


block_attention_forward.register_autograd(attention_backward, setup_context=save_for_backward)
