"""How one call of the attention op computes, whatever the site's form: the op's options, the
kernels a call runs (its CallPlan) and the masks' plans kept per mask.

The forms' modules (SparseAttention for SDPA and hand-written softmax(q k^T) v sites,
SparseMultiheadAttention for nn.MultiheadAttention) compute the core attention with
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
"""
from __future__ import annotations

import typing
import weakref
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from lowconv.kernels.block_attention import (BlockLayout, allows_whole_band, block_attention,
                                             block_attention_reference, block_attention_sdpa, block_layout,
                                             skips_tiles, triton_problem)
from lowconv.kernels.operands import needs_autograd
from lowconv.site import FLOAT_DTYPES

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
