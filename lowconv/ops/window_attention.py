"""The `sparse_attention` op's module for an SpTr window-attention chain (passes/window_attention.py).

A chain becomes a `SparseWindowAttention`, no parameters, called with q, k, v, the windows and,
with relative position, the model's tables and what rel_idx was made from; it computes with
`kernels.window_attention.window_attention` (Triton on CUDA, the torch reference elsewhere), with
the same numerics in the compute dtype. `window_site_problem` keeps a window site the Triton
kernel cannot run (head_dim not a power of two >= 16, a float64 compute dtype) when the site's
model is on CUDA.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from lowconv.compat import sptr
from lowconv.kernels.window_attention import TRITON_DTYPES, SplitAxis, window_attention
from lowconv.ops.attention_calls import SparseAttentionOptions, compute_dtype
from lowconv.site import Site, dtype_name, tensor_meta


# Where forward takes split_values and split (passes/window_attention.py builds the args).
SPLIT_VALUES_ARG, SPLIT_ARG = 14, 15


class SparseWindowAttention(nn.Module):
    """An SpTr chain (attention_step1 or dot_prod_with_idx_all, scatter_softmax_csr, attention_step2
    [_with_rel_pos_value]) as one call of the fused window-attention kernel: nothing of size M
    (the number of (query, key) pairs) is computed. No parameters: the tables stay the model's.

    The windows come as SpTr's pair layout, of which index_0_offsets (N+1) and each query's first
    entry of index_1 are read, or as `row_windows` = (start, end), each (N,), in place of those two:
    what the rewrite passes once no one else reads the pair layout (window_rows.py).
    Relative position comes as what rel_idx was made from: the points' xyz with window_size,
    quant_size, quant_grid_length and shift_win (compat's relative_position_index), or `coords`, the
    per-point whole-number coordinates that SpTr's inline rel_idx differences, with quant_grid_length.
    Where a split function rewrote one column, `split` = (axis, first, thresholds) and `split_values`
    (N,) give it as buckets of split_values' pair differences (kernels.window_attention.SplitAxis).
    """

    def __init__(self, compute_dtype: torch.dtype | None = None, split_thresholds: tuple[float, ...] | None = None):
        super().__init__()
        self.compute_dtype = compute_dtype  # None: q's dtype
        # A split's thresholds on the module's device, as the bits of float64s (which hold any float32
        # threshold exactly): integers, so that model.half() leaves them whole. Not in the state
        # dict: the plan's site holds them.
        thresholds = torch.tensor(split_thresholds or (), dtype=torch.float64).view(torch.int64)
        self.register_buffer("split_thresholds", thresholds if split_thresholds is not None else None,
                             persistent=False)

    def forward(self, q, k, v, index_0_offsets=None, index_1=None, xyz=None, window_size=None, quant_size=None,
                quant_grid_length=None, shift_win=False, table_q=None, table_k=None, table_v=None, coords=None,
                split_values=None, split=None, row_windows=None):
        if row_windows is None:
            row_windows = sptr.row_windows_from_pairs(index_0_offsets, index_1)
        tables = None
        if xyz is not None:
            coords = sptr.quantized_coordinates(xyz, window_size, quant_size, quant_grid_length, shift_win)
        elif coords is not None:
            coords = sptr.coordinates_in_window(coords, row_windows[0], quant_grid_length)
        if split is not None:
            axis, first, _ = split  # the thresholds are the module's
            thresholds = self.split_thresholds.view(torch.float64).to(split_values.dtype)
            split = SplitAxis(axis, split_values, thresholds, first)
        if coords is not None:
            last = None if split is None else split.first + len(split.thresholds)
            tables = table_rows_read(quant_grid_length, last, table_q, table_k, table_v)
        # The windows and coordinates are valid by construction: no check that reads them back.
        # (window_attention returns q's dtype.)
        return window_attention(q, k, v, row_windows=row_windows, scale=1.0, coords=coords,
                                tables=tables, split=split, dtype=self.compute_dtype or q.dtype,
                                validate=False)  # q is pre-scaled, as SpTr's

    def extra_repr(self) -> str:
        return f"compute_dtype={self.compute_dtype}"


def table_rows_read(quant_grid_length, split_last, *tables) -> tuple:
    """The first 2G-1 rows of each table (2G where a split's last bucket is 2G-1): all that rel_idx,
    in [0, 2G-2], reads, and what the kernel takes (it reads G off the tables' length). Tables of
    fewer rows are refused, from their shapes (no device sync): the kernel runs unchecked
    (validate=False), and would read out-of-range coordinates and give wrong output, with no error
    on CUDA. So is a split whose buckets pass 2G-1."""
    rows = 2 * quant_grid_length - 1
    if split_last is not None:
        if split_last > rows:
            raise ValueError(f"SparseWindowAttention: the split's last bucket is {split_last}, past 2G-1 = {rows} "
                             f"(G = quant_grid_length = {quant_grid_length})")
        rows = max(rows, split_last + 1)
    lengths = [t.shape[0] for t in tables]
    if any(length < rows for length in lengths):
        raise ValueError(f"SparseWindowAttention: the relative position tables (query, key, value) have "
                         f"{', '.join(map(str, lengths))} rows; rel_idx needs "
                         f"{f'2G-1 = {rows}' if rows == 2 * quant_grid_length - 1 else rows} "
                         f"(G = quant_grid_length = {quant_grid_length})")
    return tuple(t[:rows] for t in tables)


def window_options_problem(options: SparseAttentionOptions, site: str, keeps: str) -> str | None:
    """Why options for ordinary attention sites cannot serve a `site` ("an SpTr window chain") that
    the window-attention kernels run and that `keeps` its windows ("its windows"), or None."""
    if options.layout != "auto":
        return f'layout {options.layout!r} is for ordinary attention sites; {site} keeps {keeps} (use layout "auto")'
    if options.backend == "sdpa":
        return (f'backend "sdpa" is for ordinary attention sites; {site} runs the window-attention kernels (use '
                f'backend "auto" or "triton")')
    return None


def window_site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
    """Why the op's options cannot convert a window site, or None."""
    problem = window_options_problem(options, "an SpTr window chain", "its windows")
    if problem:
        return problem
    if site_may_run_on_cuda(site):
        values = tensor_meta(site.args[SPLIT_VALUES_ARG]) if split_of(site) is not None else None
        if values is not None and values.dtype != "float32":
            return (f"the window-attention kernel on CUDA takes a split function's values in float32 (it "
                    f"buckets their differences as float32), not {values.dtype}")
        return window_kernel_problem(site.info.head_dim, compute_dtype(options) or getattr(torch, site.compute_dtype()))
    return None


def window_module(site: Site, options: SparseAttentionOptions, params: dict | None = None) -> SparseWindowAttention:
    """The site's module (no parameters: from_site and empty alike)."""
    split = split_of(site)
    return SparseWindowAttention(compute_dtype(options), None if split is None else split[2])


def split_of(site: Site) -> tuple | None:
    """The site's split (axis, first, thresholds), where a split function rewrote its rel_idx."""
    return site.args[SPLIT_ARG] if len(site.args) > SPLIT_ARG else None


def window_kernel_problem(head_dim: int | None, dtype: torch.dtype) -> str | None:
    """Why the fused window kernel (Triton, what SparseWindowAttention runs on CUDA) cannot run a
    site, as kernels/window_attention.py's check_triton_inputs would say at run time; None if it can
    (an unknown head_dim is left to that check, and so is its grid limit G <= 128, which SpTr's
    tables of L <= 50 rows never reach)."""
    if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"the window-attention kernel on CUDA needs head_dim a power of two >= 16 (got {head_dim})"
    if dtype not in TRITON_DTYPES:
        return (f"the window-attention kernel on CUDA computes in float32, float16 or bfloat16, not "
                f"{dtype_name(dtype)} (a recipe can set the op's dtype option)")
    return None


def site_may_run_on_cuda(site: Site) -> bool:
    """Whether the site's model is on CUDA, read from the parameters or buffers of the traced graph
    that holds the site (where its op module goes, as build.site_device places it); True when it has
    none or the site has no graph: the op is meant for the CUDA kernel. On the CPU it runs the torch
    reference, which takes any head_dim and float64."""
    graph = site.output_node.graph if site.output_node is not None else None
    module = graph.owning_module if graph is not None else None
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None) if module is not None else None
    return tensor is None or tensor.is_cuda
