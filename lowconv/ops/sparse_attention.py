"""`sparse_attention`: attention through lowconv's attention kernels, in a chosen dtype.

Functional sites (SDPA, hand-written softmax(q k^T) v) become a `SparseAttention` called with
the site's (q, k, v[, mask]); an nn.MultiheadAttention becomes a `SparseMultiheadAttention`
with the same parameters and state-dict names. Both compute the core attention with
`kernels.block_attention`, with its numerics: q, k, v rounded to the compute dtype, fp32
accumulation and softmax, probabilities and output rounded to the compute dtype, then cast back
to q's dtype. Off CUDA through its torch reference. On CUDA the `backend` option picks the kernels:
  auto    lowconv's flash-style Triton kernels (the custom ops torch.ops.lowconv.block_attention_*)
          where they skip tiles of the scores that SDPA would compute: a local layout's band; a
          mask that rules out whole tiles of the band. Everywhere else F.scaled_dot_product_attention,
          whose flash, cuDNN and efficient kernels compute the same thing at least as fast: a dense
          or causal band (the mask, if any, applied elementwise). Whether a mask rules out whole
          tiles is read from the mask (one device sync per mask, see PreparedMasks); a mask that
          lets every query see every key of the band goes away, and SDPA runs the band alone
          (flash). Under torch.compile and while a CUDA graph is captured the mask cannot be read:
          masked calls run SDPA with the mask.
  sdpa    SDPA always (a local band becomes part of its mask).
  triton  lowconv's Triton kernels always, where they can run, and the torch reference elsewhere.
The Triton kernels cannot run head_dim other than 16, 32, 64, 128; a float64 compute dtype; dropout
in training; q with other than 4 dims; a mask that needs a gradient: there "auto" runs SDPA.

The `layout` option says which tiles the kernel visits. The model's mask is always applied and a
causal site stays causal; only "local" and "causal" (on a site that is not causal) change what
the model computes, on purpose:
  auto    the site's own semantics, exactly: "mask" when a mask comes, else the site's band
  dense   every tile (the mask applied elementwise); refused on a causal site
  causal  the causal band (tiles above the diagonal never visited); the mask elementwise
  local   a window band of `window` W: on a causal site the query and the W - 1 keys before it,
          elsewhere the keys less than W away on either side; the mask elementwise
  mask    the site's band, less the tiles that the mask (and key padding) rule out entirely,
          listed once per mask (see PreparedMasks); refused on a site that takes no mask
nn.MultiheadAttention's causality is known per call (its is_causal hint, as it reads it).

An SpTr window-attention chain (passes/window_attention.py) becomes a `SparseWindowAttention`
(ops/window_attention.py).
"""
from __future__ import annotations

import typing
import weakref
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.kernels.block_attention import (BlockLayout, allows_whole_band, block_attention,
                                             block_attention_reference, block_attention_sdpa, block_layout,
                                             skips_tiles, triton_problem)
from lowconv.kernels.block_attention import check_inputs as check_attention_inputs
from lowconv.kernels.operands import needs_autograd
from lowconv.ops.registry import Op, register
from lowconv.ops.window_attention import SparseWindowAttention, window_site_problem
from lowconv.ops.window_rows import drop_pair_layouts
from lowconv.site import FLOAT_DTYPES, AttentionInfo, MhaInfo, Site



Layout = Literal["auto", "dense", "causal", "local", "mask"]
LAYOUT_CHOICES = typing.get_args(Layout)
Backend = Literal["auto", "sdpa", "triton"]
BACKEND_CHOICES = typing.get_args(Backend)
LOCAL_BANDS = ("local", "causal_local")


@dataclass
class SparseAttentionOptions:
    # "auto": the dtype q arrives in (the site's input dtype when the model runs as traced).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    layout: Layout = "auto"  # which tiles of the scores the kernel visits: see the module doc
    window: int | None = None  # W, the local layout's window (required with it, refused otherwise)
    backend: Backend = "auto"  # which kernels compute on CUDA: see the module doc

    def __post_init__(self):
        if self.layout not in LAYOUT_CHOICES:
            raise ValueError(f"must be one of {', '.join(map(repr, LAYOUT_CHOICES))} "
                             f"(got {self.layout!r})", "layout")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"must be one of {', '.join(map(repr, BACKEND_CHOICES))} "
                             f"(got {self.backend!r})", "backend")
        if self.layout != "local":
            if self.window is not None:
                raise ValueError(f'goes with layout = "local" only (layout is {self.layout!r})',
                                 "window")
        elif self.window is None:
            raise ValueError('is required with layout = "local": how many keys a query sees',
                             "window")
        elif isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"must be a whole number >= 1 (got {self.window!r})", "window")


def compute_dtype(options: SparseAttentionOptions) -> torch.dtype | None:
    return FLOAT_DTYPES.get(options.dtype)


def layout_problem(layout: str, causal: bool, has_mask: bool) -> str | None:
    """Why `layout` cannot keep a functional site's semantics where it promises to, or None."""
    if layout == "dense" and causal:
        return ('layout "dense" would let a causal site attend to later keys: '
                'use "auto" or "causal"')
    if layout == "mask" and not has_mask:
        return 'layout "mask" needs a site that takes a mask; this one takes none'
    return None


def kernel_band(layout: str, window: int | None, causal: bool) -> tuple[str, bool]:
    """The op's layout at a call (causal or not) as the kernel's band (block_attention's
    layouts) and whether the tiles that the mask rules out are listed and skipped."""
    if layout == "local":
        return ("causal_local" if causal else "local"), False
    if layout == "causal":
        return "causal", False
    return ("causal" if causal else "dense"), layout in ("auto", "mask")


def runs_on_kernel_device(q) -> bool:
    """Whether q is where the Triton kernels run (CUDA; tests set it for the interpreter)."""
    return q.is_cuda


def kernel_runs(q, v, dtype, dropout, masks=()) -> bool:
    """Whether the Triton kernels can run this call: they have no dropout, take (batch, heads,
    seq, head_dim) only with v's head_dim q's, and pass no gradient to a mask (a learned bias given
    as the mask gets its gradient from SDPA's or the reference's autograd)."""
    learned = needs_autograd(*masks)
    return (runs_on_kernel_device(q) and q.dim() == 4 and v.shape[-1] == q.shape[-1] and dropout == 0.0
            and not learned and triton_problem(q.shape[-1], dtype) is None)


class CallPlan(NamedTuple):
    """How a call computes: its backend ("triton", "sdpa" or "reference"), the Triton kernels'
    BlockLayout where they list the tiles a mask leaves, and whether the masks go in (False: they
    let every query see every key of the band, which SDPA then runs alone)."""
    backend: str
    blocks: BlockLayout | None = None
    masked: bool = True


def plan_call(option, q, k, v, dtype, dropout, band, window, listed, masks, given, context) -> CallPlan:
    """The CallPlan of a call (the module doc says which backend runs where). `masks` are (mask,
    key_padding_mask) as block_attention takes them, `given` the masks the model passed (their
    identity keys the plan per mask), `context` what else the plan depends on."""
    if not runs_on_kernel_device(q):
        return CallPlan("reference")
    kernel = kernel_runs(q, v, dtype, dropout, given)
    if option == "sdpa" or (option == "auto" and not kernel):
        return CallPlan("sdpa")
    if not kernel:  # "triton" where the kernels cannot run
        return CallPlan("reference")
    masked = listed and any(m is not None for m in masks)
    if option == "triton" or band in LOCAL_BANDS:
        if not masked:
            return CallPlan("triton")
        return prepared(q, given, ("triton", *context),
                        lambda: CallPlan("triton", block_layout(q.shape[-2], k.shape[-2], layout=band, window=window,
                                                                mask=masks[0], key_padding_mask=masks[1])))
    if not masked or traced(q):
        return CallPlan("sdpa")
    return prepared(q, given, ("auto", *context), lambda: mask_plan(q.shape[-2], k.shape[-2], band, window, *masks))


def mask_plan(seq_q, seq_k, band, window, mask, key_padding_mask) -> CallPlan:
    """The plan that the masks decide (backend "auto", a mask or key padding over a dense or causal
    band): SDPA on the band alone where they allow all of it, the Triton kernels where their
    BlockLayout leaves out a tile of the band, else SDPA with the masks. One read from the device."""
    blocks = block_layout(seq_q, seq_k, layout=band, window=window, mask=mask, key_padding_mask=key_padding_mask)
    whole, skips = torch.stack([allows_whole_band(mask, key_padding_mask, band, window, seq_q, seq_k),
                                skips_tiles(blocks, band, window, seq_q, seq_k)]).tolist()
    if whole:
        return CallPlan("sdpa", masked=False)
    return CallPlan("triton", blocks) if skips else CallPlan("sdpa")


def traced(q) -> bool:
    """Whether this call is being traced (torch.compile) or captured into a CUDA graph: what it
    computes from the masks must then be computed on each call, inside the graph."""
    return torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing())


class PreparedMasks:
    """What calls make from their masks (a CallPlan), kept for the last few masks seen by any
    module (the layers of a model share their mask): made once per mask, not per call. (The masks'
    kernel form is made on every call: cheap, and it keeps a learned mask's autograd link.)

    A mask is "the same" when it is the same tensor, or a view at the same place of the same
    tensor, unwritten since: the key is the tensor that owns the memory (a view's `_base`, held by
    a weak reference, so that the cache keeps no mask alive and a freed mask's id cannot pass for
    another tensor's), the view's offset, shape and strides, and the version counter that torch
    bumps on every in-place write (shared by views and detach()), with what else the value depends
    on. Not seen: writes that torch does not count (through .data, numpy, DLPack). Inference
    tensors have no version counter: theirs are made on every call.
    """

    def __init__(self, entries: int = 8):
        self.entries, self.limit = [], entries  # (key, weak references to the owners, value), newest last

    def get(self, masks: tuple, context: tuple, prepare):
        if all(m is None for m in masks) or any(m is not None and m.is_inference() for m in masks):
            return prepare()
        owners = tuple(None if m is None else owner_of(m) for m in masks)
        key = (context, *map(mask_key, masks))
        for entry_key, refs, value in self.entries:
            if entry_key == key and all(owner is None if ref is None else ref() is owner
                                        for ref, owner in zip(refs, owners)):
                return value
        value = prepare()
        refs = tuple(None if owner is None else weakref.ref(owner) for owner in owners)
        self.entries = [*self.entries, (key, refs, value)][-self.limit:]
        return value


MASK_PLANS = PreparedMasks()


def prepared(q, masks: tuple, context: tuple, prepare):
    """prepare() for these masks of a call on q: from MASK_PLANS, or made on each call while traced."""
    return prepare() if traced(q) else MASK_PLANS.get(masks, context, prepare)


def owner_of(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask._base is None else mask._base


def mask_key(mask):
    """Where the mask lies in its owner and how often it was written (the owner: see get)."""
    if mask is None:
        return None
    return mask.storage_offset(), mask.shape, mask.stride(), mask._version


def attend(q, k, v, plan, *, band, window, mask, key_padding_mask, scale, dropout, dtype, validate=True):
    """block_attention as the plan says; q's dtype out. validate=False: the caller checked the
    arguments (kernel_runs checked what the kernels need)."""
    if plan.backend == "triton":
        return block_attention(q, k, v, layout=band, window=window, mask=mask, key_padding_mask=key_padding_mask,
                               scale=scale, dtype=dtype, blocks=plan.blocks, skip_masked_tiles=False,
                               backend="triton", validate=validate)
    if not plan.masked:
        mask = key_padding_mask = None
    compute = block_attention_sdpa if plan.backend == "sdpa" else block_attention_reference
    return compute(q, k, v, layout=band, window=window, mask=mask, key_padding_mask=key_padding_mask,
                   scale=scale, dtype=dtype, dropout=dropout)


def backend_note(option, layout, window, causal, masks) -> str:
    """Which kernels a site runs on CUDA and why, for the plan (the module doc has the rules; off
    CUDA the torch reference runs). `masks`: "none", "given" (every call has one) or "per call"."""
    if option == "sdpa":
        return 'on CUDA: SDPA (backend "sdpa")'
    if option == "triton":
        return "on CUDA: lowconv's Triton kernels (backend \"triton\"; the torch reference where they cannot run)"
    band, listed = kernel_band(layout, window, causal)
    if band in LOCAL_BANDS:
        return (f"on CUDA: lowconv's Triton kernels: they visit only the tiles of the local band (window {window}), "
                "where SDPA would compute every tile (SDPA, the band as its mask, where they cannot run)")
    shape = "causal" if band == "causal" else "dense"
    if listed and masks != "none":
        per_mask = ("lowconv's Triton kernels where the mask rules out whole tiles (they skip them), else SDPA (on "
                    "the band alone where the mask allows all of it); under torch.compile and CUDA graph capture, "
                    "which cannot read the mask, SDPA with the mask")
        if masks == "given":
            return f"on CUDA: per mask, on a {shape} band: {per_mask}"
        return f"on CUDA: SDPA on a {shape} band, no tile to skip; calls with a mask or key padding, per mask: {per_mask}"
    return f"on CUDA: SDPA: a {shape} band{', the mask elementwise' if masks != 'none' else ''}, no tile to skip"


def mean_where_all_masked(out: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`out` with the query rows where `allowed` (True attends) has no key replaced by the mean of v
    over the keys: the softmax of scores that a finite masked_fill set all to one value."""
    empty = ~allowed.any(-1, keepdim=True)  # (..., Lq, 1): broadcasts as the mask does
    mean = v.mean(-2, keepdim=True)
    if v.shape[-3] != out.shape[-3]:  # grouped heads: each kv head serves H / Hk query heads
        mean = mean.repeat_interleave(out.shape[-3] // v.shape[-3], dim=-3)
    return torch.where(empty, mean.to(out.dtype), out)


class SparseAttention(nn.Module):
    """softmax(q k^T * scale + mask) v for a functional site; no parameters."""

    def __init__(self, mask: str = "none", causal: bool = False, scale: float | None = None,
                 dropout: float = 0.0, compute_dtype: torch.dtype | None = None,
                 mask_kind_from_dtype: bool = False, layout: str = "auto",
                 window: int | None = None, causal_from_mask: bool = False, finite_fill: bool = False,
                 backend: str = "auto"):
        super().__init__()
        try:  # the checks a recipe's options get; forward then skips block_attention's
            SparseAttentionOptions(layout=layout, window=window, backend=backend)
        except ValueError as error:
            message, option = error.args
            raise ValueError(f"SparseAttention: {option} {message}") from None
        problem = layout_problem(layout, causal, mask != "none")
        if problem:
            raise ValueError(f"SparseAttention: {problem}")
        self.mask = mask  # the kind of the forward's mask argument, see AttentionInfo.mask
        # SDPA's rule, for SDPA sites: a bool mask keeps, any other is added, decided per call.
        self.mask_kind_from_dtype = mask_kind_from_dtype
        self.causal, self.causal_from_mask = causal, causal_from_mask  # see AttentionInfo
        self.finite_fill = finite_fill  # see AttentionInfo
        self.scale = scale
        self.dropout = dropout
        self.compute_dtype = compute_dtype  # None: q's dtype
        self.layout, self.window, self.backend = layout, window, backend

    def forward(self, q, k, v, mask=None, *, is_causal: bool | None = None, scale: float | None = None,
                dropout: float | None = None):
        """The site's attention. Given is_causal, the call brings its own causality, scale and
        dropout (transformers' attention interface decides them per call, passes/hf_attention.py),
        and its mask's kind is read from its dtype, as SDPA reads it."""
        per_call = is_causal is not None
        if mask is None:
            kind = "none"
        elif self.mask_kind_from_dtype or per_call:
            kind = "keep" if mask.dtype == torch.bool else "additive"
        else:
            kind = self.mask
        dtype = self.compute_dtype or q.dtype
        if per_call:
            self.check_call(q, k, is_causal)
            causal = is_causal
        else:
            causal = self.causal and not self.one_query_of_many_keys(q, k)
            scale, dropout = self.scale, self.dropout if self.training else 0.0
        check_attention_inputs(q, k, v, mask, kind, causal, scale, dropout, dtype)
        band, listed = kernel_band(self.layout, self.window, causal)
        kernel_mask = ~mask if kind == "drop" else mask  # block_attention's: True attends
        plan = plan_call(self.backend, q, k, v, dtype, dropout, band, self.window, listed, (kernel_mask, None),
                         (mask,), ("functional", kind, band, self.window, q.shape[-2], k.shape[-2]))
        out = attend(q, k, v, plan, band=band, window=self.window, mask=kernel_mask, key_padding_mask=None,
                     scale=scale, dropout=dropout, dtype=dtype, validate=False)
        if self.finite_fill and not per_call and kind in ("keep", "drop"):
            out = mean_where_all_masked(out, v, kernel_mask)
        return out

    def check_call(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
        """What the layout cannot do on a call that brings its own causality: attend past a causal
        call's diagonal (dense), or place a window where queries and keys differ in number (a
        decoding step with a KV cache): the band is aligned at the first key, the cache's end is not."""
        problem = layout_problem(self.layout, causal, True)
        if problem:
            raise ValueError(f"attention: {problem}")
        if self.layout == "local" and q.shape[-2] != k.shape[-2]:
            raise ValueError(f'attention: layout "local" aligns its window at the first key; a call with '
                             f"{q.shape[-2]} queries and {k.shape[-2]} keys (a step over a KV cache) needs it "
                             f"at the last: convert with another layout to decode")

    def one_query_of_many_keys(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a causal mask made for as many queries as keys meets one query and more keys
        (a decoding step with a KV cache), where the original's (1, 1) slice of it broadcasts:
        the query sees every key. Other counts that differ do not broadcast in the original."""
        if not self.causal_from_mask or q.shape[-2] == k.shape[-2]:
            return False
        if q.shape[-2] != 1:
            raise ValueError(f"attention: the causal mask of this site was sliced to as many queries as keys; "
                             f"{q.shape[-2]} queries and {k.shape[-2]} keys do not fit it (nor the original model)")
        return True

    def plan_note(self) -> str:
        return backend_note(self.backend, self.layout, self.window, self.causal,
                            "none" if self.mask == "none" else "given")

    def extra_repr(self) -> str:
        return (f"mask={self.mask}, causal={self.causal}, scale={self.scale}, "
                f"dropout={self.dropout}, compute_dtype={self.compute_dtype}, "
                f"layout={self.layout}, window={self.window}, backend={self.backend}")


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
        plan = plan_call(self.backend, q, k, v, dtype, dropout, band, self.window, listed, (mask, padding),
                         (attn_mask, key_padding_mask),
                         ("mha", band, self.window, n, self.num_heads, seq_q, seq_k, q.dtype))
        out = attend(q, k, v, plan, band=band, window=self.window, mask=mask, key_padding_mask=padding,
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


def site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
    info = site.info
    if info.form == "mha" and None in (info.embed_dim, info.heads, info.batch_first):
        return "nn.MultiheadAttention site without embed_dim/heads/batch_first to rebuild it from"
    if info.form == "window":
        return window_site_problem(site, options.layout, options.backend, compute_dtype(options))
    if info.form != "mha":  # an MHA's causality and masks come per call
        return layout_problem(options.layout, info.causal, info.mask != "none")
    return None


def from_site(site: Site, options: SparseAttentionOptions, params: dict) -> nn.Module:
    info: AttentionInfo | MhaInfo = site.info
    if info.form != "mha":
        return functional_module(info, options)
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


def empty(site: Site, options: SparseAttentionOptions) -> nn.Module:
    """As from_site, uninitialized. An MHA's parameters take the site's input dtype."""
    info: AttentionInfo | MhaInfo = site.info
    if info.form != "mha":
        return functional_module(info, options)
    dtype = getattr(torch, site.info.dtype)
    return SparseMultiheadAttention(
        info.embed_dim, info.heads, kdim=info.kdim, vdim=info.vdim, bias=info.bias,
        batch_first=info.batch_first, dropout=info.dropout,
        compute_dtype=compute_dtype(options), layout=options.layout, window=options.window,
        dtype=dtype, weights_when_asked=info.weights_unknown, backend=options.backend)


def functional_module(info: AttentionInfo, options: SparseAttentionOptions) -> nn.Module:
    if info.form == "window":
        return SparseWindowAttention(compute_dtype(options))
    return SparseAttention(mask=info.mask, causal=info.causal, scale=info.scale,
                           dropout=info.dropout, compute_dtype=compute_dtype(options),
                           mask_kind_from_dtype=info.form == "sdpa", layout=options.layout,
                           window=options.window, causal_from_mask=info.causal_from_mask,
                           finite_fill=info.finite_fill, backend=options.backend)


SPARSE_ATTENTION = register(Op(
    name="sparse_attention",
    kind="attention",
    description="attention in a chosen dtype (fp32 accumulation and softmax) and tile layout (auto, dense, "
                "causal, local, mask); on CUDA through SDPA, or lowconv's block-attention kernels where they "
                "skip tiles of the scores that SDPA computes",
    options=SparseAttentionOptions,
    site_problem=site_problem,
    from_site=from_site,
    empty=empty,
    rewrite_graph=drop_pair_layouts,
))
