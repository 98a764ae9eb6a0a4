"""The `sparse_attention` op's module for a flash-attn varlen call (passes/varlen_attention.py).

A call becomes a `VarlenAttention`, no parameters, called with the call's tensors (qkv; q, kv; or
q, k, v) and cu_seqlens; each segment is one window of `kernels.window_attention.window_attention`
(Triton on CUDA, the torch reference elsewhere), which computes in the op's dtype with fp32 sums, as
flash-attn does in fp16 and bf16; so it runs where flash-attn does not (the CPU, fp32, GPUs without
it) and under torch.compile. Keys and values with fewer heads are repeated to the queries' (as
flash-attn serves grouped-query attention). The output is (T, h, d) in the queries' dtype, flash-attn's.
"""
from __future__ import annotations

import torch
from torch import nn

from lowconv.kernels.window_attention import window_attention
from lowconv.ops.attention_calls import SparseAttentionOptions, compute_dtype
from lowconv.ops.window_attention import window_kernel_problem, window_options_problem
from lowconv.site import Site


class VarlenAttention(nn.Module):
    """softmax(q k^T * scale) v within each segment of cu_seqlens; `scale` None is head_dim^-0.5."""

    def __init__(self, scale: float | None = None, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.scale = scale
        self.compute_dtype = compute_dtype  # None: q's dtype

    def forward(self, *tensors_and_offsets: torch.Tensor) -> torch.Tensor:
        *tensors, cu_seqlens = tensors_and_offsets
        if len(tensors) == 1:  # qkv (T, 3, h, d)
            q, k, v = tensors[0].unbind(1)
        elif len(tensors) == 2:  # q, kv (T, 2, h, d)
            q, (k, v) = tensors[0], tensors[1].unbind(1)
        else:
            q, k, v = tensors
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves h / h_kv query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        # Rows past the last segment (flash-attn leaves them unwritten) make one window more; cu_seqlens
        # is the model's, as flash-attn takes it: not read back (no device sync) on CUDA.
        offsets = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), q.shape[0])])
        checked = not q.is_cuda and not torch.compiler.is_compiling()  # no sync, no graph break: the CPU, eagerly
        return window_attention(q, k, v, offsets, scale=self.scale, dtype=self.compute_dtype or q.dtype,
                                validate=checked)

    def plan_note(self) -> str:
        """registry.NotesThePlan: what the site runs."""
        return ("each cu_seqlens segment one window of the window-attention kernel (Triton on CUDA, its torch "
                "reference elsewhere)")

    def extra_repr(self) -> str:
        return f"scale={self.scale}, compute_dtype={self.compute_dtype}"


def varlen_site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
    """Why the op's options cannot convert a varlen site, or None."""
    # The kernel's limits wherever the model is converted: flash-attn runs on CUDA only, so will the model.
    dtype = compute_dtype(options) or getattr(torch, site.compute_dtype())
    return (window_options_problem(options, "a flash-attn varlen call", "its segments")
            or window_kernel_problem(site.info.head_dim, dtype))


def varlen_module(site: Site, options: SparseAttentionOptions, params: dict | None = None) -> VarlenAttention:
    """The site's module (no parameters: from_site and empty alike)."""
    return VarlenAttention(site.info.scale, compute_dtype(options))
