"""`sparse_attention`: attention through lowconv's attention kernels, in a chosen dtype.

Functional sites (SDPA, hand-written softmax(q k^T) v) become a `SparseAttention` called with
the site's (q, k, v[, mask]); an nn.MultiheadAttention becomes a `SparseMultiheadAttention`
with the same parameters and state-dict names. Both compute the core attention with
`kernels.block_attention.attention`: q, k, v rounded to the compute dtype, fp32 accumulation
and softmax, probabilities and output rounded to the compute dtype, then cast back to q's dtype.

An SpTr window-attention chain (passes/window_attention.py) becomes a `SparseWindowAttention`, no
parameters, called with q, k, v, the windows and, with relative position, the model's tables and
what rel_idx was made from; it computes with `kernels.window_attention.window_attention` (Triton
on CUDA, the torch reference elsewhere), with the same numerics in the compute dtype. `check` keeps
a window site the Triton kernel cannot run (head_dim not a power of two >= 16, a float64 compute
dtype) when the site's model is on CUDA.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import reduce
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.compat import sptr
from lowconv.kernels.block_attention import attention
from lowconv.kernels.window_attention import TRITON_DTYPES, window_attention
from lowconv.ops.registry import Op, register
from lowconv.site import FLOAT_DTYPES, AttentionInfo, Site, dtype_name



@dataclass
class SparseAttentionOptions:
    # "auto": the dtype q arrives in (the site's input dtype when the model runs as traced).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"


def compute_dtype(options: SparseAttentionOptions) -> torch.dtype | None:
    return FLOAT_DTYPES.get(options.dtype)


class SparseAttention(nn.Module):
    """softmax(q k^T * scale + mask) v for a functional site; no parameters."""

    def __init__(self, mask: str = "none", causal: bool = False, scale: float | None = None,
                 dropout: float = 0.0, compute_dtype: torch.dtype | None = None,
                 mask_kind_from_dtype: bool = False):
        super().__init__()
        self.mask = mask  # the kind of the forward's mask argument, see AttentionInfo.mask
        # SDPA's rule, for SDPA sites: a bool mask keeps, any other is added, decided per call.
        self.mask_kind_from_dtype = mask_kind_from_dtype
        self.causal = causal
        self.scale = scale
        self.dropout = dropout
        self.compute_dtype = compute_dtype  # None: q's dtype

    def forward(self, q, k, v, mask=None):
        if mask is None:
            kind = "none"
        elif self.mask_kind_from_dtype:
            kind = "keep" if mask.dtype == torch.bool else "additive"
        else:
            kind = self.mask
        out = attention(q, k, v, mask, mask_kind=kind,
                        causal=self.causal, scale=self.scale,
                        dropout=self.dropout if self.training else 0.0,
                        dtype=self.compute_dtype or q.dtype)
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return (f"mask={self.mask}, causal={self.causal}, scale={self.scale}, "
                f"dropout={self.dropout}, compute_dtype={self.compute_dtype}")


class SparseMultiheadAttention(nn.Module):
    """nn.MultiheadAttention's parameters, state-dict names and forward; the core attention
    runs through the kernel. Attention weights are never computed: forward returns (out, None).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kdim: int | None = None,
                 vdim: int | None = None, bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, compute_dtype: torch.dtype | None = None,
                 device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.batch_first, self.dropout, self.compute_dtype = batch_first, dropout, compute_dtype
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
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal=True is a hint that attn_mask is causal: "
                               "pass attn_mask too")
        batch_dim = 0 if self.batch_first else 1
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (x.unsqueeze(batch_dim) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))

        q, k, v = self.project(query, key, value)
        n, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for x in (q, k, v))
        # As nn.MultiheadAttention: with no key padding, the is_causal hint replaces attn_mask.
        causal = is_causal and key_padding_mask is None
        mask, mask_kind = merge_masks(None if causal else attn_mask, key_padding_mask,
                                      n, self.num_heads, seq_q, seq_k, q.dtype)
        out = attention(q, k, v, mask, mask_kind=mask_kind, causal=causal,
                        dropout=self.dropout if self.training else 0.0,
                        dtype=self.compute_dtype or q.dtype)
        out = self.out_proj(out.to(q.dtype).transpose(1, 2).flatten(2))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out.squeeze(batch_dim) if unbatched else out), None

    def project(self, query, key, value):
        if self.packed:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        return (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


class SparseWindowAttention(nn.Module):
    """An SpTr chain (attention_step1 or dot_prod_with_idx_all, scatter_softmax_csr, attention_step2
    [_with_rel_pos_value]) as one call of the fused window-attention kernel: nothing of size M
    (the number of (query, key) pairs) is computed. No parameters: the tables stay the model's.

    The windows come as SpTr's pair layout, of which index_0_offsets (N+1) and each query's first
    entry of index_1 are read, or as `row_windows` = (start, end), each (N,), in place of those two:
    what the rewrite passes once no one else reads the pair layout (passes/window_rows.py).
    Relative position comes as what rel_idx was made from: the points' xyz with window_size,
    quant_size, quant_grid_length and shift_win (compat's relative_position_index), or `coords`, the
    per-point whole-number coordinates that SpTr's inline rel_idx differences, with quant_grid_length.
    """

    def __init__(self, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.compute_dtype = compute_dtype  # None: q's dtype

    def forward(self, q, k, v, index_0_offsets=None, index_1=None, xyz=None, window_size=None, quant_size=None,
                quant_grid_length=None, shift_win=False, table_q=None, table_k=None, table_v=None, coords=None,
                row_windows=None):
        if row_windows is None:
            row_windows = sptr.row_windows_from_pairs(index_0_offsets, index_1)
        tables = None
        if xyz is not None:
            coords = sptr.quantized_coordinates(xyz, window_size, quant_size, quant_grid_length, shift_win)
        elif coords is not None:
            coords = sptr.coordinates_in_window(coords, row_windows[0], quant_grid_length)
        if coords is not None:
            tables = table_rows_read(quant_grid_length, table_q, table_k, table_v)
        # The windows and coordinates are valid by construction: no check that reads them back.
        # (window_attention returns q's dtype.)
        return window_attention(q, k, v, row_windows=row_windows, scale=1.0, coords=coords,
                                tables=tables, dtype=self.compute_dtype or q.dtype,
                                validate=False)  # q is pre-scaled, as SpTr's

    def extra_repr(self) -> str:
        return f"compute_dtype={self.compute_dtype}"


def table_rows_read(quant_grid_length, *tables) -> tuple:
    """The first 2G-1 rows of each table: all that rel_idx, in [0, 2G-2], reads, and what the kernel
    takes (it reads G off the tables' length). Tables of fewer rows are refused, from their shapes
    (no device sync): the kernel runs unchecked (validate=False), and would read out-of-range
    coordinates and give wrong output, with no error on CUDA."""
    rows = 2 * quant_grid_length - 1
    lengths = [t.shape[0] for t in tables]
    if any(length < rows for length in lengths):
        raise ValueError(f"SparseWindowAttention: the relative position tables (query, key, value) have "
                         f"{', '.join(map(str, lengths))} rows; rel_idx needs 2G-1 = {rows} "
                         f"(G = quant_grid_length = {quant_grid_length})")
    return tuple(t[:rows] for t in tables)


def merge_masks(attn_mask, key_padding_mask, n, heads, seq_q, seq_k, dtype):
    """nn.MultiheadAttention's two masks as one (mask, kind) over (n, heads, seq_q, seq_k).

    Bool masks mean True = not allowed; float masks are added. All-bool masks stay bool
    ("drop"); otherwise bool ones become -inf/0 and everything is summed ("additive").
    """
    masks = []
    if attn_mask is not None:
        shape = (1, 1, seq_q, seq_k) if attn_mask.dim() == 2 else (n, heads, seq_q, seq_k)
        masks.append(attn_mask.reshape(shape))
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(n, 1, 1, seq_k))
    if not masks:
        return None, "none"
    if all(m.dtype == torch.bool for m in masks):
        return reduce(torch.logical_or, masks), "drop"
    additive = [torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
                if m.dtype == torch.bool else m for m in masks]
    return reduce(torch.add, additive), "additive"


def check(site: Site, options: SparseAttentionOptions) -> str | None:
    info = site.info
    if info.form == "mha" and None in (info.embed_dim, info.heads, info.batch_first):
        return "nn.MultiheadAttention site without embed_dim/heads/batch_first to rebuild it from"
    if info.form == "window" and site_may_run_on_cuda(site):
        return window_kernel_problem(info.head_dim, compute_dtype(options) or getattr(torch, site.compute_dtype()))
    return None


def window_kernel_problem(head_dim: int | None, dtype: torch.dtype) -> str | None:
    """Why the fused window kernel (Triton, what SparseWindowAttention runs on CUDA) cannot run a
    site, as kernels/window_attention.py's check_triton_inputs would say at run time; None if it can
    (an unknown head_dim is left to that check)."""
    if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"the window-attention kernel on CUDA needs head_dim a power of two >= 16 (got {head_dim})"
    if dtype not in TRITON_DTYPES:
        return (f"the window-attention kernel on CUDA computes in float32, float16 or bfloat16, not "
                f"{dtype_name(dtype)} (a recipe can set the op's dtype option)")
    return None


def site_may_run_on_cuda(site: Site) -> bool:
    """Whether the site's model is on CUDA, read from the parameters or buffers of the traced graph
    that holds the site (where its op module goes, as api.site_device places it); True when it has
    none or the site has no graph: the op is meant for the CUDA kernel. On the CPU it runs the torch
    reference, which takes any head_dim and float64."""
    graph = site.output_node.graph if site.output_node is not None else None
    module = graph.owning_module if graph is not None else None
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None) if module is not None else None
    return tensor is None or tensor.is_cuda


def from_site(site: Site, options: SparseAttentionOptions, params: dict) -> nn.Module:
    info: AttentionInfo = site.info
    if info.form != "mha":
        return functional_module(info, options)
    weight = params.get("in_proj_weight", params.get("q_proj_weight"))
    module = SparseMultiheadAttention(
        info.embed_dim, info.heads,
        kdim=params["k_proj_weight"].shape[1] if "k_proj_weight" in params else None,
        vdim=params["v_proj_weight"].shape[1] if "v_proj_weight" in params else None,
        bias="in_proj_bias" in params, batch_first=info.batch_first, dropout=info.dropout,
        compute_dtype=compute_dtype(options), device=weight.device, dtype=weight.dtype)
    module.load_state_dict(params)
    return module


def empty(site: Site, options: SparseAttentionOptions) -> nn.Module:
    """As from_site, uninitialized. An MHA's parameters take the site's input dtype."""
    info: AttentionInfo = site.info
    if info.form != "mha":
        return functional_module(info, options)
    dtype = getattr(torch, site.info.dtype)
    return SparseMultiheadAttention(
        info.embed_dim, info.heads, kdim=info.kdim, vdim=info.vdim, bias=info.bias,
        batch_first=info.batch_first, dropout=info.dropout,
        compute_dtype=compute_dtype(options), dtype=dtype)


def functional_module(info: AttentionInfo, options: SparseAttentionOptions) -> nn.Module:
    if info.form == "window":
        return SparseWindowAttention(compute_dtype(options))
    return SparseAttention(mask=info.mask, causal=info.causal, scale=info.scale,
                           dropout=info.dropout, compute_dtype=compute_dtype(options),
                           mask_kind_from_dtype=info.form == "sdpa")


SPARSE_ATTENTION = register(Op(
    name="sparse_attention",
    kind="attention",
    description="attention through lowconv's block-attention kernels in a chosen dtype "
                "(fp32 accumulation and softmax)",
    options=SparseAttentionOptions,
    check=check,
    from_site=from_site,
    empty=empty,
))
