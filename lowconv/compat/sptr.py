"""SparseTransformer (SpTr) in plain torch: window partition, pair layout, ops and module.

SpTr (dvlab-research/SparseTransformer, and the lh9171338 fork with FP16/BF16) is the sparse
window self-attention of SphereFormer. Its ops are CUDA extensions; these are torch functions
with the same names, argument orders, shapes and index layout, so SpTr-style models run on any
device and in any dtype, and train with correct gradients (SpTr's own backward of
attention_step2 and of the fused rel-pos ops is wrong in places).

The data (N points, h heads, d head_dim, windows of n_w points, M = sum n_w^2 pairs):
- points are sorted by window (`sort_idx`), windows contiguous; everything below is in that order;
- pairs are query-major per window: for the window starting at sorted position s with pairs from
  sq_off (exclusive cumsum of n_w^2), pair sq_off + i*n_w + t has query `index_0` = s + i and key
  `index_1` = s + t;
- `index_0_offsets` (N+1): CSR row pointer of each query's pairs (last = M);
- `index_1_offsets` (N): key j's pairs are at index_1_offsets[j] + i*n_w, i < n_w;
- `n_max`: the largest n_w; `rel_idx` (M, 3): quantized relative position of each pair;
- row windows (start, end), each (N,): each sorted point's window, what lowconv's fused kernel
  reads; row_windows_from_pairs takes them from the pair layout, get_window_rows builds them
  without it (what a converted model calls instead of get_indices_params).
Index tensors are int32 (sort_idx int64, as SpTr's). q is pre-scaled by the caller.

fx: the ops (SPTR_OPS) and the index helpers (SPTR_HELPERS) are `torch.fx.wrap`ped, so a
symbolic trace records each call as one call_function node whose target is the function here
(the helpers' bodies are data-dependent and would not trace; a pass wants the ops, not their
insides). sparse_self_attention and VarLengthMultiheadSA are traced through, to their chain of
ops. This holds for calls through this module's namespace (`sptr.attention_step1(...)`, and all
calls made here); a model that does `from ...sptr import attention_step1` binds the unpatched
function, and a tracer catches it only with `fx.Tracer(autowrap_functions=SPTR_OPS + SPTR_HELPERS)`.
A real SpTr install's ops (autograd Functions over its CUDA extension, which a Proxy cannot go
through) are kept single calls by lowconv's tracer too, and read by the passes as these
(sptr_install.py, which also says how the real package is laid out).
"""
from __future__ import annotations

import inspect
import numbers
import sys

import numpy as np
import torch
import torch.fx
from torch import nn

PE_TYPES = ("none", "contextual")


def install_as(package: str = "sptr") -> None:
    """Make `import <package>` give this module, so that a model written against SpTr's package runs
    on these ops with no CUDA build of SpTr: SphereFormer's model does
    `from third_party.SparseTransformer.sptr import to_3d_numpy, SparseTrTensor, ...`, which after
    `install_as("third_party.SparseTransformer.sptr")` imports them from here. The package itself
    only (SpTr's submodules, functional and utils, are not stood for). Call it before the model's
    code imports the package; a package already imported is refused by name."""
    this = sys.modules[__name__]
    loaded = sys.modules.get(package)
    if loaded is not None and loaded is not this:
        raise ValueError(f"install_as({package!r}): {package} is imported already ({loaded!r}); call it before "
                         f"the model's code imports {package}")
    sys.modules[package] = this


def to_3d(size) -> tuple[float, float, float]:
    """A window or quant size, a number or 3 numbers (list, tuple, numpy array, tensor), as 3 floats."""
    if isinstance(size, numbers.Number):
        return (float(size),) * 3
    values = tuple(float(s) for s in size)
    if len(values) != 3:
        raise ValueError(f"a size is a number or 3 numbers, not {len(values)}")
    return values


def to_3d_numpy(size) -> np.ndarray:
    """SpTr's name (SphereFormer imports it): a window or quant size as a numpy array of 3."""
    return np.array(to_3d(size))

def grid_length(window_size, quant_size) -> int:
    """G, the quant cells per window side (SpTr's formula, from the x axis); tables have 2G-1 rows."""
    return int((to_3d(window_size)[0] + 1e-4) / to_3d(quant_size)[0])


def coordinates(xyz: torch.Tensor) -> torch.Tensor:
    """xyz in at least float32: windows from half-precision coordinates would misplace points."""
    return xyz.to(torch.promote_types(xyz.dtype, torch.float32))


@torch.fx.wrap
def window_partition(xyz, batch, window_size, shift_win=False):
    """The window of each point, and the points sorted by window.

    A window is a cell of size `window_size` over xyz (N, 3) counted from xyz's minimum over all
    points, separately per batch index (batch (N,), non-negative); shifted windows add
    window_size/2 first. Windows are numbered in (batch, z, y, x) order, as SpTr's voxel grid
    numbers them; within a window, points keep their input order.

    Returns window_index (N,) int64 in input order, sort_idx (N,) int64 (input position of each
    sorted point) and window_offsets (W+1,) int32: window w is sorted positions
    window_offsets[w] to window_offsets[w+1].
    """
    n_points = xyz.shape[0]
    if n_points == 0:  # min/max over no points would raise
        empty = torch.zeros(0, dtype=torch.int64, device=xyz.device)
        return empty, empty, torch.zeros(1, dtype=torch.int32, device=xyz.device)
    xyz = coordinates(xyz)
    size = xyz.new_tensor(to_3d(window_size))
    shift = size / 2 if shift_win else torch.zeros_like(size)
    cell = torch.floor((xyz - xyz.amin(0) + shift) / size).long()
    extent = cell.amax(0) + 1
    key = ((batch.long() * extent[2] + cell[:, 2]) * extent[1] + cell[:, 1]) * extent[0] + cell[:, 0]
    sort_idx = torch.argsort(key, stable=True)
    sorted_key = key[sort_idx]
    starts = torch.ones_like(sorted_key, dtype=torch.bool)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    window_index = torch.empty_like(sort_idx)
    window_index[sort_idx] = starts.cumsum(0) - 1
    ends = torch.tensor([n_points], device=xyz.device)
    window_offsets = torch.cat([starts.nonzero().squeeze(1), ends]).int()
    return window_index, sort_idx, window_offsets


@torch.fx.wrap
def precompute_all(N, n, n_max, counts):
    """SpTr's pair layout for n windows of `counts` points each (N points in all, n_max the most
    in one window). Returns (index_0_offsets, index_1_offsets, index_0, index_1), int32."""
    device = counts.device
    counts = counts.long()
    zero = counts.new_zeros(1)
    offsets = torch.cat([zero, counts.cumsum(0)])
    sq_offsets = torch.cat([zero, (counts * counts).cumsum(0)])
    n_pairs = int(sq_offsets[-1])
    if n_pairs >= 2 ** 31:
        raise ValueError(f"{n_pairs} pairs do not fit SpTr's int32 indices")
    window = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=N)
    window_size = counts[window]  # points in each point's window
    rank = torch.arange(N, device=device) - offsets[window]  # position of each point in its window
    row_start = sq_offsets[window] + rank * window_size
    index_0 = torch.repeat_interleave(torch.arange(N, device=device), window_size, output_size=n_pairs)
    index_1 = (index_0 - rank[index_0]) + (torch.arange(n_pairs, device=device) - row_start[index_0])
    index_0_offsets = torch.cat([row_start, sq_offsets[-1:]])
    index_1_offsets = sq_offsets[window] + rank
    return index_0_offsets.int(), index_1_offsets.int(), index_0.int(), index_1.int()


@torch.fx.wrap
def get_indices_params(xyz, batch, window_size, shift_win: bool):
    """Window partition and pair layout of points xyz (N, 3), batch (N,), as SpTr returns them:
    (index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx)."""
    _, sort_idx, window_offsets = window_partition(xyz, batch, window_size, shift_win)
    counts = window_offsets.diff()
    n_max = int(counts.max()) if len(counts) else 0
    index_0_offsets, index_1_offsets, index_0, index_1 = precompute_all(len(sort_idx), len(counts), n_max, counts)
    return index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx


@torch.fx.wrap
def get_window_rows(xyz, batch, window_size, shift_win: bool):
    """What a model converted by lowconv reads of get_indices_params, without its pair layout
    (nothing of size M): (sort_idx, window_start, window_end), sorted point i's window being sorted
    positions window_start[i] to window_end[i] (int32, as row_windows_from_pairs gives them).
    The same window_partition call, so the same windows and sort_idx; its host sync is the only one."""
    window_index, sort_idx, window_offsets = window_partition(xyz, batch, window_size, shift_win)
    window = window_index[sort_idx]  # each sorted point's window
    return sort_idx, window_offsets[window], window_offsets[window + 1]


@torch.fx.wrap
def quantized_coordinates(xyz, window_size, quant_size, quant_grid_length, shift_win=False):
    """qxyz (N, 3) int64: each point's quant cell inside its window,
    floor(((xyz - min + shift) mod window_size) / quant_size) (torch.div's floor division, as SpTr),
    in [0, G-1] with G = quant_grid_length."""
    xyz = coordinates(xyz)
    size = xyz.new_tensor(to_3d(window_size))
    shift = size / 2 if shift_win else torch.zeros_like(size)
    least = xyz.amin(0) if len(xyz) else torch.zeros_like(size)  # no points: nothing to quantize
    in_window = torch.remainder(xyz - least + shift, size)
    # SpTr's floor division: floor(a / q) of the rounded quotient differs where a / q rounds up to
    # a whole number. Rounding can put a point a hair past the last quant cell; SpTr then fails its
    # L > rel_idx assert.
    cells = torch.div(in_window, xyz.new_tensor(to_3d(quant_size)), rounding_mode="floor")
    return cells.long().clamp_(0, quant_grid_length - 1)


@torch.fx.wrap
def relative_position_index(xyz, index_0, index_1, window_size, quant_size, quant_grid_length,
                            shift_win=False):
    """rel_idx (M, 3) int32 of each pair, from xyz (N, 3) in window (sorted) order:
    rel_idx = qxyz[index_0] - qxyz[index_1] + G - 1, in [0, 2G-2] (see quantized_coordinates)."""
    qxyz = quantized_coordinates(xyz, window_size, quant_size, quant_grid_length, shift_win)
    return (qxyz[index_0.long()] - qxyz[index_1.long()] + quant_grid_length - 1).int()


@torch.fx.wrap
def row_windows_from_pairs(index_0_offsets, index_1):
    """(start, end) int32 of each sorted point's window, from SpTr's pair layout without a host
    sync: a query's first pair's key is the first point of its window, and it has one pair per
    point of the window."""
    start = index_1.index_select(0, index_0_offsets[:-1].long())
    return start.int(), (start + index_0_offsets.diff()).int()


@torch.fx.wrap
def coordinates_in_window(coords, window_start, quant_grid_length):
    """Whole-number coordinates (N, 3) in window (sorted) order as the kernel takes them, int64 in
    [0, G-1]: each less the least of its window (window_start (N,): the first sorted point of each
    point's window). rel_idx reads only differences within a window, which this keeps while a
    window's coordinates spread over at most G-1 (G cells). A wider spread (SpTr's coordinates reach
    G only by float rounding, and its rel_idx then leaves the tables) is clamped here, per point:
    SpTr's split path instead clamps rel_idx, per pair, to [0, 2G-1], so for the pairs of such a
    point the two differ (the conversion reads other table rows than the original)."""
    coords, window_start = coords.long(), window_start.long()
    least = torch.zeros_like(coords).scatter_reduce_(0, window_start[:, None].expand_as(coords), coords, "amin",
                                                     include_self=False)
    return (coords - least[window_start]).clamp_(0, quant_grid_length - 1)


def table_rows(table, rel_idx):
    """sum over axes a of table[rel_idx[:, a], a]: (M, h, d) from a table (L, 3, h, d)."""
    return sum(table[:, axis].index_select(0, rel_idx[:, axis]) for axis in range(3))


@torch.fx.wrap
def attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max):
    """attn (M, h): attn[m] = <q[index_0[m]], k[index_1[m]]> per head; q, k (N, h, d)."""
    return (q.index_select(0, index_0) * k.index_select(0, index_1)).sum(-1)


@torch.fx.wrap
def scatter_softmax_csr(src, indptr, dim=-1):
    """Softmax of src (M, h) over each query's row of pairs, rows given by the CSR pointer indptr
    (N+1). As in SpTr (whose segment_csr ignores it), `dim` is accepted and the rows run along dim 0."""
    lengths = indptr.diff()
    # The row maximum only keeps exp() in range; the softmax does not depend on it, so no gradient.
    row_max = torch.segment_reduce(src.detach(), "max", offsets=indptr)
    exp = (src - row_max.repeat_interleave(lengths, 0, output_size=src.shape[0])).exp()
    row_sum = torch.segment_reduce(exp, "sum", offsets=indptr)
    return exp / row_sum.repeat_interleave(lengths, 0, output_size=src.shape[0])


@torch.fx.wrap
def attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max):
    """(N, h, d): out[i] = sum over i's pairs m of attn[m] * v[index_1[m]]; attn (M, h), v (N, h, d)."""
    weighted = attn.unsqueeze(-1) * v.index_select(0, index_1)
    return torch.segment_reduce(weighted, "sum", offsets=index_0_offsets)  # a query's pairs are one CSR row


@torch.fx.wrap
def dot_prod_with_idx_all(q, index_0, index_0_offsets, k, index_1, index_1_offsets, table_q, table_k,
                          rel_idx, n_max):
    """attn (M, h) with contextual relative position, tables (L, 3, h, d), rel_idx (M, 3):
    attn[m] = <q_i, k_j + sum_a table_q[r_a, a]> + <k_j, sum_a table_k[r_a, a]>, in q's dtype (as
    SpTr's kernels, which take the tables in it: float32 tables with half q under AMP)."""
    q_i, k_j = q.index_select(0, index_0), k.index_select(0, index_1)
    table_q, table_k = table_q.to(q.dtype), table_k.to(q.dtype)
    return (q_i * (k_j + table_rows(table_q, rel_idx))).sum(-1) + (k_j * table_rows(table_k, rel_idx)).sum(-1)


@torch.fx.wrap
def dot_prod_with_idx(q, index_0, index_0_offsets, k, index_1, index_1_offsets, table_q, table_k, rel_idx, n_max):
    """attn (M, h): dot_prod_with_idx_all's relative-position terms alone, as SpTr's kernel of this
    name computes them (no q.k term): <q_i, sum_a table_q[r_a, a]> + <k_j, sum_a table_k[r_a, a]>."""
    q_i, k_j = q.index_select(0, index_0), k.index_select(0, index_1)
    table_q, table_k = table_q.to(q.dtype), table_k.to(q.dtype)
    return (q_i * table_rows(table_q, rel_idx)).sum(-1) + (k_j * table_rows(table_k, rel_idx)).sum(-1)


@torch.fx.wrap
def attention_step2_with_rel_pos_value(attn, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                                       table_v, rel_idx):
    """(N, h, d): out[i] = sum over i's pairs m of attn[m] * (v[index_1[m]] + sum_a table_v[r_a, a]).
    Note n_max is the 5th argument here, as in SpTr. In v's dtype, as dot_prod_with_idx_all."""
    weighted = attn.unsqueeze(-1) * (v.index_select(0, index_1) + table_rows(table_v.to(v.dtype), rel_idx))
    return torch.segment_reduce(weighted, "sum", offsets=index_0_offsets)


SPTR_OPS = (attention_step1, scatter_softmax_csr, attention_step2, dot_prod_with_idx, dot_prod_with_idx_all,
            attention_step2_with_rel_pos_value)
SPTR_HELPERS = (window_partition, precompute_all, get_indices_params, get_window_rows, relative_position_index,
                quantized_coordinates, row_windows_from_pairs, coordinates_in_window)


def sparse_self_attention(query, key, value, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                          sort_idx, window_size, shift_win, pe_type="none", rel_query=False, rel_key=False,
                          rel_value=False, quant_size=None, quant_grid_length=None, relative_pos_query_table=None,
                          relative_pos_key_table=None, relative_pos_value_table=None, split_func=None, dtype=None):
    """SpTr's window self-attention of query, key, value (N, h, d) in input order (query
    pre-scaled), with indices from get_indices_params; returns (N, h, d) in input order.

    Not wrapped: a trace records its chain of ops. `split_func(xyz, index_0, index_1, rel_idx)`
    rewrites rel_idx (SphereFormer's exponential split of the radial axis), which is then clamped
    to [0, 2G-1] as in SpTr; where its fifth parameter has no default, it gets quant_grid_length
    there too (the lh9171338 fork's convention; SphereFormer's split functions default theirs).
    `dtype` (the fork's): q, k and v are computed in it, and the output returned in query's own.
    Contextual position needs rel_query and rel_key together (SpTr's fused op).
    """
    contextual = pe_type == "contextual"
    if contextual and rel_query != rel_key:
        raise ValueError("contextual position needs rel_query and rel_key together (SpTr's fused op)")
    given_dtype = query.dtype
    if dtype is not None:
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))}, got {dtype}")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    query, key, value, xyz = query[sort_idx], key[sort_idx], value[sort_idx], xyz[sort_idx]
    if contextual and (rel_query or rel_value):
        rel_idx = relative_position_index(xyz, index_0, index_1, window_size, quant_size, quant_grid_length,
                                          shift_win)
        if split_func is not None:
            grid = (quant_grid_length,) if takes_grid_length(split_func) else ()
            rel_idx = split_func(xyz, index_0, index_1, rel_idx.clone(), *grid).clamp(0, 2 * quant_grid_length - 1).int()
    if contextual and rel_query:
        attn = dot_prod_with_idx_all(query, index_0, index_0_offsets, key, index_1, index_1_offsets,
                                     relative_pos_query_table, relative_pos_key_table, rel_idx, n_max)
    else:
        attn = attention_step1(query, key, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    attn = scatter_softmax_csr(attn, index_0_offsets, dim=0)
    if contextual and rel_value:
        x = attention_step2_with_rel_pos_value(attn, value, index_0, index_0_offsets, n_max, index_1,
                                               index_1_offsets, relative_pos_value_table, rel_idx)
    else:
        x = attention_step2(attn, value, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    out = torch.empty_like(x).index_copy(0, sort_idx, x)  # back to input order
    return out if dtype is None else out.to(given_dtype)


COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the fork's `dtype` choices


def takes_grid_length(split_func) -> bool:
    """Whether a split function's fifth positional parameter is required: the lh9171338 fork passes
    quant_grid_length there, SpTr and SphereFormer pass four arguments."""
    try:
        parameters = list(inspect.signature(split_func).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: SpTr's four arguments
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 5 and positional[4].default is inspect.Parameter.empty


class SparseTrTensor:
    """SpTr's SparseTrTensor: what its VarLengthMultiheadSA takes and returns.

    query_indices (N, 4): each point's batch index in column 0, then its xyz (integer voxel
    coordinates or float positions); query_feats (N, C). key_feats and value_feats, where given,
    are the keys' and values' features at the same points (SpTr's attention reads them in place of
    query_feats; key_indices it keeps and never reads). indice_dict caches the window layout per
    indice_key, for the layers that share one and are given the same tensor.
    """

    def __init__(self, query_feats, query_indices, spatial_shape, batch_size, key_feats=None, value_feats=None,
                 key_indices=None):
        self.query_feats, self.key_feats, self.value_feats = query_feats, key_feats, value_feats
        self.query_indices, self.key_indices = query_indices, key_indices
        self.spatial_shape, self.batch_size = spatial_shape, batch_size
        self.indice_dict = {}

    @property
    def spatial_size(self):
        return np.prod(self.spatial_shape)

    def find_indice_params(self, key):
        return None if key is None else self.indice_dict.get(key)


class VarLengthMultiheadSA(nn.Module):
    """SpTr's VarLengthMultiheadSA: multi-head self-attention within windows of points.

    Constructor as SpTr's, its positional arguments in its order (the tenth is `algo`, SpTr's choice
    among its own CUDA kernels: compat has one implementation, so any value computes the same), and
    the keyword arguments SpTr reads from **kwargs (quant_size, rel_query, rel_key, rel_value)
    spelled out; another keyword is an error, not ignored. Differences from SpTr, on purpose:
    - forward takes SpTr's SparseTrTensor and returns one (the attended query features, the
      indices, spatial shape and batch size carried; no cached layout, as SpTr's), and also plain
      tensors, (feats (N, C), xyz (N, 3), batch (N,)) -> (N, C). Given a SparseTrTensor, the
      window layout is cached in it under `indice_key` (as SpTr caches it), else computed in
      forward (one fx node, get_indices_params).
    - pe_type="contextual" really uses its three tables. SpTr silently runs plain attention:
      its forward never passes pe_type on to sparse_self_attention, whose default is "none".
    - no float32 cast: it computes in the dtype of its projections' output (AMP reaches the ops).
    - `dropout` applies to the output projection; SpTr also builds an attention dropout it never
      applies, which is left out.
    Only pe_type "none" and "contextual" (SpTr's "sine"/"fourier" are not supported).
    """

    def __init__(self, embed_dim, num_heads, indice_key, window_size, shift_win=False, pe_type="none",
                 dropout=0.0, qk_scale=None, qkv_bias=True, algo="native", *, quant_size=None, rel_query=True,
                 rel_key=True, rel_value=True):
        super().__init__()
        if pe_type not in PE_TYPES:
            raise ValueError(f"pe_type {pe_type!r} is not one of {PE_TYPES}")
        self.embed_dim, self.num_heads, self.indice_key, self.algo = embed_dim, num_heads, indice_key, algo
        self.window_size, self.shift_win, self.pe_type = to_3d(window_size), shift_win, pe_type
        head_dim = embed_dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        if pe_type == "contextual":
            if not (rel_query and rel_key and rel_value):
                raise ValueError("pe_type='contextual' needs rel_query, rel_key and rel_value (as SpTr asserts)")
            if quant_size is None:
                raise ValueError("pe_type='contextual' needs quant_size")
            self.rel_query, self.rel_key, self.rel_value = rel_query, rel_key, rel_value
            self.quant_size = to_3d(quant_size)
            self.quant_grid_length = grid_length(self.window_size, self.quant_size)
            table_shape = (2 * self.quant_grid_length - 1, 3, num_heads, head_dim)
            self.relative_pos_query_table = nn.Parameter(nn.init.trunc_normal_(torch.zeros(table_shape), std=0.02))
            self.relative_pos_key_table = nn.Parameter(nn.init.trunc_normal_(torch.zeros(table_shape), std=0.02))
            self.relative_pos_value_table = nn.Parameter(nn.init.trunc_normal_(torch.zeros(table_shape), std=0.02))
        self.q = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.k = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.v = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, feats, xyz=None, batch=None):
        """(feats, xyz, batch) -> (N, C) features; or SpTr's call, a SparseTrTensor -> a SparseTrTensor."""
        if isinstance(feats, SparseTrTensor):
            return self.forward_sparse_tr(feats)
        layout = get_indices_params(xyz, batch, self.window_size, self.shift_win)
        return self.attend(feats, feats, feats, xyz, layout)

    def forward_sparse_tr(self, tensor: SparseTrTensor) -> SparseTrTensor:
        indices = tensor.query_indices
        xyz, batch = indices[:, 1:], indices[:, 0]
        cached = tensor.find_indice_params(self.indice_key)
        if cached is None:
            layout = get_indices_params(xyz, batch, self.window_size, self.shift_win)
            # the layout kept whole, not unpacked: tracing would guard its length
            tensor.indice_dict[self.indice_key] = (layout, self.window_size, self.shift_win)
        else:
            layout, window_size, shift_win = cached
            if (window_size, shift_win) != (self.window_size, self.shift_win):
                raise ValueError(f"indice_key {self.indice_key!r}: the SparseTrTensor holds windows of size "
                                 f"{window_size} (shift_win={shift_win}) and this layer's are {self.window_size} "
                                 f"(shift_win={self.shift_win}); layers that share an indice_key share their windows")
        query = tensor.query_feats
        key = query if tensor.key_feats is None else tensor.key_feats
        value = query if tensor.value_feats is None else tensor.value_feats
        x = self.attend(query, key, value, xyz, layout)
        return SparseTrTensor(x, indices, tensor.spatial_shape, tensor.batch_size)

    def attend(self, query_feats, key_feats, value_feats, xyz, layout):
        """Multi-head attention within the windows of `layout` (get_indices_params' tuple)."""
        N, C = query_feats.shape
        query = self.q(query_feats).reshape(N, self.num_heads, C // self.num_heads) * self.scale
        key = self.k(key_feats).reshape(N, self.num_heads, C // self.num_heads)
        value = self.v(value_feats).reshape(N, self.num_heads, C // self.num_heads)
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = layout
        rel_pos = {}
        if self.pe_type == "contextual":
            rel_pos = dict(rel_query=self.rel_query, rel_key=self.rel_key, rel_value=self.rel_value,
                           quant_size=self.quant_size, quant_grid_length=self.quant_grid_length,
                           relative_pos_query_table=self.relative_pos_query_table.to(query.dtype),
                           relative_pos_key_table=self.relative_pos_key_table.to(query.dtype),
                           relative_pos_value_table=self.relative_pos_value_table.to(query.dtype))
        x = sparse_self_attention(query, key, value, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                                  sort_idx, self.window_size, self.shift_win, pe_type=self.pe_type, **rel_pos)
        return self.proj_drop(self.proj(x.reshape(N, C)))
