"""The attention op's module for a functional site (SDPA, hand-written softmax(q k^T) v): a
`SparseAttention` called with the site's (q, k, v[, mask]), computed as attention_calls.py says."""
from __future__ import annotations

import torch
from torch import nn

from lowconv.kernels.block_attention import check_inputs as check_attention_inputs
from lowconv.ops import attention_calls as calls
from lowconv.ops.attention_calls import SparseAttentionOptions, backend_note, compute_dtype, kernel_band, layout_problem
from lowconv.site import AttentionInfo, Site


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
        plan = calls.plan_call(self.backend, q, k, v, dtype, dropout, band, self.window, listed, (kernel_mask, None),
                               (mask,), ("functional", kind, band, self.window, q.shape[-2], k.shape[-2]))
        out = calls.attend(q, k, v, plan, band=band, window=self.window, mask=kernel_mask, key_padding_mask=None,
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


def functional_site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
    return layout_problem(options.layout, site.info.causal, site.info.mask != "none")


def functional_module(site: Site, options: SparseAttentionOptions, params: dict | None = None) -> SparseAttention:
    """The site's module (no parameters: from_site and empty alike)."""
    info: AttentionInfo = site.info
    return SparseAttention(mask=info.mask, causal=info.causal, scale=info.scale,
                           dropout=info.dropout, compute_dtype=compute_dtype(options),
                           mask_kind_from_dtype=info.form == "sdpa", layout=options.layout,
                           window=options.window, causal_from_mask=info.causal_from_mask,
                           finite_fill=info.finite_fill, backend=options.backend)
