"""Windowed (variable-length) self-attention with SpTr's contextual relative position.

Points are sorted by window; window w is rows offsets[w]:offsets[w+1] of q, k, v (N, h, d), and
each point attends to the points of its own window. The kernels read the windows per row, as
row_windows = (start, end), each (N,) int32: row i's window is rows start[i]:end[i]. With
relative position, each point has quantized in-window coordinates coords (N, 3) in [0, G-1], the
tables tq, tk, tv are (L, 3, h, d) with L = 2G-1, and the pair (i, j) uses
r_a = coords[i, a] - coords[j, a] + G - 1:

    s_ij  = <qs_i, k_j + sum_a tq[r_a, a]> + <k_j, sum_a tk[r_a, a]>,   qs = q * scale
    out_i = sum_j softmax_j(s_ij) (v_j + sum_a tv[r_a, a])

Numerics (compute dtype c = `dtype`, q's dtype if None):
- q, k, v and the tables are rounded to c; qs = q * scale is taken in fp32 and rounded to c
  (as if the caller had pre-scaled q, as SpTr's callers do); dq = scale * dqs.
- Every dot product accumulates in fp32 (fp32 operands use 3-pass tf32, about fp32 accuracy);
  the logits, their relative terms and the online softmax are fp32; lse (fp32) is saved.
- Triton: exp(s - running max) is rounded to c before its products with v and with the
  one-hot coordinate matrices that sum the value table (flash attention's P V rounding); the
  normalizer sums the unrounded values. The output is rounded to c, then returned in q's dtype.
- Backward (flash style): P = exp(s - lse) in fp32; P rounded to c for dv and dtv; dS = P (dP -
  delta) in fp32 with delta_i = <dO_i, O_i>, rounded to c for dq, dk, dtq and dtk.
- Per-tile sums by relative index (fp32) meet the tables and rows in MMAs of c split into a
  high and a low part (`_split_dot`: 16 mantissa bits for bf16, 22 for fp16); the table
  gradients are summed in fp32 and rounded to c at the end.
- The reference rounds the normalized probabilities to c instead, and not dS: the same
  error, not the same bits.

On CUDA the Triton kernels compute this (window_attention_triton.py; their relative-position terms,
in window_attention_rel_pos.py, avoid anything of size sum(n_w^2)); elsewhere the torch reference
below, over the pair list.
A split axis (SplitAxis) takes one axis's r from per-point values instead of coordinates:
r = first + #{thresholds <= values_i - values_j}, as SphereFormer's split function buckets its
radial axis; its tables may then have 2G rows.
"""
import os
from typing import NamedTuple

import torch

import lowconv.kernels.window_attention_triton  # noqa: F401 - registers torch.ops.lowconv.window_*
from lowconv.kernels.operands import as_operand

BACKENDS = ("auto", "triton", "reference")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# G on Triton. pack_coords keeps 10 bits per coordinate (G <= 1024), but the kernels' per-axis
# blocks grow with G and so does their compile: for sm_90 each kernel took 7-10 s at G = 64, 19-38 s
# at 128, and had not compiled after 5 minutes at 1024. SphereFormer uses G = 24; SpTr allows 25.
COORD_LIMIT = 128


class SplitAxis(NamedTuple):
    """One axis's relative index taken from per-point values instead of coordinates, as a split
    function computes it (SphereFormer's radial axis): buckets of the pair's difference,
    r_axis = first + #{t in thresholds : t <= values[i] - values[j]} for query i and key j, the
    difference in values' dtype. values (N,) floating in the rows' order, thresholds (T,)
    non-decreasing in values' dtype; the tables need first + T + 1 rows (and still 2G-1 for the
    other axes: L = 2G-1 or 2G)."""
    axis: int
    values: torch.Tensor
    thresholds: torch.Tensor
    first: int


def window_attention(q, k, v, offsets=None, *, row_windows=None, scale=None, coords=None,
                     tables=None, split=None, dtype=None, backend="auto", validate=True):
    """Self-attention within each window (see the module doc), differentiable for q, k, v and tables.

    The windows come as offsets (W+1,) integer (window w is rows offsets[w]:offsets[w+1], empty
    windows allowed) or as row_windows = (start, end), each (N,) integer; give one of them.
    coords (N, 3) integer in [0, G-1] and tables = (tq, tk, tv), each (L, 3, h, d) with
    L = 2G-1, turn on relative position (G <= 128 on Triton); pass both or neither. `split`
    (a SplitAxis, with relative position only) computes one axis's index from per-point values
    (float32 on Triton). `scale` None is d^-0.5.
    `dtype` None computes in q's dtype. `backend` "auto" runs Triton on CUDA and the torch
    reference elsewhere; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before import.
    `validate` checks the values of offsets, row_windows and coords, which reads them back from
    the device (a sync); a caller that built them itself can pass False (bad values then read
    out of bounds, or give wrong results: a coordinate outside [0, G-1] picks a wrong table row,
    and on Triton one outside [0, 1023] also corrupts the point's other coordinates, which are
    packed with it in 10 bits each).
    """
    check_inputs(q, k, v, offsets, row_windows, scale, coords, tables, split, dtype, backend)
    if validate:
        check_values(q.shape[0], offsets, row_windows, coords, tables)
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if not use_triton:
        return window_attention_reference(q, k, v, offsets, row_windows=row_windows, scale=scale,
                                          coords=coords, tables=tables, split=split, dtype=dtype)
    check_triton_inputs(q, dtype, tables, split)
    out_dtype, dtype = q.dtype, dtype or q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if offsets is None:
        start, end = (as_operand(t, torch.int32) for t in row_windows)
    else:
        start, end = launch_row_windows(offsets, q.shape[0])
    q, k, v = (as_operand(t, dtype) for t in (q, k, v))
    if tables is None:
        tq = tk = tv = None
    else:
        coords = pack_coords(coords)
        tq, tk, tv = (as_operand(t, dtype) for t in tables)
    values, thresholds, axis, first = (None, None, -1, 0) if split is None else (
        split.values.contiguous(), split.thresholds.contiguous(), split.axis, split.first)
    out, _ = torch.ops.lowconv.window_attention_forward(q, k, v, tq, tk, tv, start, end, coords, values, thresholds,
                                                        axis, first, scale)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def window_attention_reference(q, k, v, offsets=None, *, row_windows=None, scale=None,
                               coords=None, tables=None, split=None, dtype=None):
    """The torch reference of `window_attention` (same arguments, no checks), over the pair
    list: memory O(sum(n_w^2) * h * d), fine for tests and as the "SpTr in torch" baseline."""
    dtype = dtype or q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    query, key = window_pairs(*(row_windows if offsets is None else
                                row_windows_from_offsets(offsets, q.shape[0])))
    qs = (q.to(dtype).to(acc) * scale).to(dtype).to(acc)
    k, v = (t.to(dtype).to(acc) for t in (k, v))
    q_pair, k_pair, v_pair = qs[query], k[key], v[key]
    if tables is None:
        logits = (q_pair * k_pair).sum(-1)
    else:
        g = (tables[0].shape[0] + 1) // 2
        rel = (coords[query] - coords[key] + g - 1).long()
        if split is not None:
            difference = split.values[query] - split.values[key]
            rel[:, split.axis] = split.first + torch.searchsorted(split.thresholds, difference, right=True)
        tq, tk, tv = (relative_sum(t.to(dtype).to(acc), rel) for t in tables)
        logits = (q_pair * (k_pair + tq)).sum(-1) + (k_pair * tk).sum(-1)
        v_pair = v_pair + tv
    probs = segment_softmax(logits, query, q.shape[0]).to(dtype).to(acc)
    out = torch.zeros(q.shape[0], *v.shape[1:], dtype=acc, device=q.device)
    return out.index_add(0, query, probs[..., None] * v_pair).to(dtype).to(q.dtype)


def row_windows_from_offsets(offsets, n):
    """(start, end) int64 of each of the n sorted rows' window, from window offsets (W+1,)."""
    offsets = offsets.long()
    window = torch.repeat_interleave(torch.arange(len(offsets) - 1, device=offsets.device),
                                     offsets.diff(), output_size=n)
    return offsets[window], offsets[window + 1]


def window_pairs(start, end):
    """(query, key) row indices of every pair within a window, query-major (SpTr's layout)."""
    start, end = start.long(), end.long()
    pairs_per_query = end - start
    n_pairs = int(pairs_per_query.sum())
    query = torch.repeat_interleave(torch.arange(len(start), device=start.device), pairs_per_query,
                                    output_size=n_pairs)
    first_pair = pairs_per_query.cumsum(0) - pairs_per_query
    key = start[query] + torch.arange(n_pairs, device=start.device) - first_pair[query]
    return query, key


def relative_sum(table, rel):
    """sum_a table[rel[:, a], a] for each pair: (M, h, d) from table (L, 3, h, d), rel (M, 3)."""
    return table[rel[:, 0], 0] + table[rel[:, 1], 1] + table[rel[:, 2], 2]


def segment_softmax(logits, query, n):
    """Softmax of (M, h) pair logits over the pairs of each query."""
    index = query[:, None].expand_as(logits)
    row_max = torch.full((n, logits.shape[1]), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
    row_max = row_max.scatter_reduce(0, index, logits.detach(), "amax")  # any shift is exact
    e = (logits - row_max[query]).exp()
    return e / torch.zeros_like(row_max).index_add(0, query, e)[query]


def check_inputs(q, k, v, offsets, row_windows, scale, coords, tables, split, dtype, backend):
    """Raise ValueError naming what is wrong with window_attention's arguments (their types,
    shapes and devices; check_values reads the values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 3:
            raise ValueError(f"window_attention: {name} must be a floating-point (N, h, d) "
                             f"tensor, got {describe(t)}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"window_attention: q, k, v must have one shape (N, h, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.device == k.device == v.device:
        raise ValueError(f"window_attention: q, k, v are on different devices: {q.device}, "
                         f"{k.device}, {v.device}")
    check_windows(q, offsets, row_windows)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"window_attention: scale must be a number or None, got "
                         f"{type(scale).__name__}")
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"window_attention: dtype must be one of {COMPUTE_DTYPES} or None, "
                         f"got {dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"window_attention: backend must be one of {BACKENDS}, got {backend!r}")
    check_relative_position(q, coords, tables, split)


def check_windows(q, offsets, row_windows):
    if (offsets is None) == (row_windows is None):
        raise ValueError("window_attention: give the windows as offsets or as row_windows, "
                         "one of the two")
    if offsets is not None:
        if not is_int_tensor(offsets) or offsets.dim() != 1 or len(offsets) < 1:
            raise ValueError(f"window_attention: offsets must be a 1-D integer tensor (W+1,), "
                             f"got {describe(offsets)}")
        if offsets.device != q.device:
            raise ValueError(f"window_attention: offsets is on {offsets.device}, q on {q.device}")
        return
    n = q.shape[0]
    if not isinstance(row_windows, (tuple, list)) or len(row_windows) != 2 or not all(
            is_int_tensor(t) and tuple(t.shape) == (n,) and t.device == q.device
            for t in row_windows):
        got = ", ".join(map(describe, row_windows)) if isinstance(row_windows, (tuple, list)) \
            else describe(row_windows)
        raise ValueError(f"window_attention: row_windows must be (start, end), two integer "
                         f"({n},) tensors on {q.device}, got {got}")


def check_relative_position(q, coords, tables, split=None):
    if (coords is None) != (tables is None):
        raise ValueError("window_attention: relative position needs both coords and tables "
                         f"(got {'coords' if tables is None else 'tables'} only)")
    if tables is None:
        if split is not None:
            raise ValueError("window_attention: a split axis needs relative position (coords and tables)")
        return
    n, h, d = q.shape
    if not is_int_tensor(coords) or tuple(coords.shape) != (n, 3) or coords.device != q.device:
        raise ValueError(f"window_attention: coords must be an integer ({n}, 3) tensor on "
                         f"{q.device}, got {describe(coords)}")
    if not isinstance(tables, (tuple, list)) or len(tables) != 3:
        raise ValueError("window_attention: tables must be a (tq, tk, tv) tuple")
    for name, t in zip(("tq", "tk", "tv"), tables):
        if (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4
                or tuple(t.shape[1:]) != (3, h, d) or t.device != q.device):
            raise ValueError(f"window_attention: table {name} must be a floating-point "
                             f"(L, 3, {h}, {d}) tensor on {q.device}, got {describe(t)}")
    length = tables[0].shape[0]
    if any(t.shape[0] != length for t in tables) or (length % 2 == 0 and split is None):
        raise ValueError(f"window_attention: the tables must share one odd L = 2G-1, got "
                         f"{[t.shape[0] for t in tables]}")
    if split is not None:
        check_split(q, split, length)


def check_split(q, split, length):
    if not isinstance(split, SplitAxis) or split.axis not in (0, 1, 2):
        raise ValueError(f"window_attention: split must be a SplitAxis on axis 0, 1 or 2, got {split!r}")
    n = q.shape[0]
    values, thresholds = split.values, split.thresholds
    if (not isinstance(values, torch.Tensor) or not values.is_floating_point() or tuple(values.shape) != (n,)
            or values.device != q.device):
        raise ValueError(f"window_attention: split.values must be a floating-point ({n},) tensor on "
                         f"{q.device}, got {describe(values)}")
    if (not isinstance(thresholds, torch.Tensor) or thresholds.dtype != values.dtype or thresholds.dim() != 1
            or thresholds.device != q.device):
        raise ValueError(f"window_attention: split.thresholds must be a 1-D {values.dtype} tensor on "
                         f"{q.device}, got {describe(thresholds)}")
    last = split.first + len(thresholds)
    if split.first < 0 or last >= length:
        raise ValueError(f"window_attention: the split's buckets {split.first} to {last} are not table rows "
                         f"(L = {length})")


def check_values(n, offsets, row_windows, coords, tables):
    """The data-dependent checks, read back from the device in one transfer."""
    if offsets is not None:
        failures = {
            f"offsets must start at 0 and end at N = {n}": (offsets[0] != 0) | (offsets[-1] != n),
            "offsets must be non-decreasing": (offsets.diff() < 0).any(),
        }
    else:
        start, end = (t.long() for t in row_windows)
        row = torch.arange(n, device=start.device)
        new = start[1:] != start[:-1]  # row i+1 opens a window: the previous one ends there
        failures = {
            "row_windows must hold each row: 0 <= start[i] <= i < end[i] <= N":
                ((start < 0) | (start > row) | (end <= row) | (end > n)).any(),
            "row_windows must be contiguous windows (rows of a window share start and end)":
                (new & ((start[1:] != row[1:]) | (end[:-1] != row[1:]))
                 | ~new & (end[1:] != end[:-1])).any(),
        }
    if coords is not None:
        g = (tables[0].shape[0] + 1) // 2
        failures[f"coords must lie in [0, {g - 1}] (G = (L+1)/2 from the tables)"] = (
            (coords < 0) | (coords >= g)).any()
    failed = torch.stack(list(failures.values())).tolist()
    for message, bad in zip(failures, failed):
        if bad:
            raise ValueError(f"window_attention: {message}")


def check_triton_inputs(q, dtype, tables, split=None):
    d = q.shape[-1]
    if split is not None and split.values.dtype != torch.float32:
        raise ValueError(f"window_attention: the Triton backend takes a split axis of float32 values "
                         f"(differences in their own dtype), got {split.values.dtype}")
    if (dtype or q.dtype) not in TRITON_DTYPES:
        raise ValueError(f"window_attention: the Triton backend computes in {TRITON_DTYPES}, "
                         f"got {dtype or q.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"window_attention: the Triton backend needs head_dim a power of two "
                         f">= 16, got {d}")
    if tables is not None and tables[0].shape[0] > 2 * COORD_LIMIT - 1:
        raise ValueError(f"window_attention: the Triton backend takes G <= {COORD_LIMIT} coordinates "
                         f"per axis (tables of L = 2G-1 <= {2 * COORD_LIMIT - 1} rows), got "
                         f"L = {tables[0].shape[0]}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("window_attention: the Triton backend on CPU tensors needs "
                         "TRITON_INTERPRET=1 set before triton is imported")


def is_int_tensor(t):
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() \
        and t.dtype != torch.bool


def describe(t):
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def launch_row_windows(offsets, n):
    """(start, end) int32 of each row's window from offsets, in one kernel (a binary search per
    row), so the Triton path needs no host sync and no chain of small torch ops."""
    return torch.ops.lowconv.window_row_windows(offsets.to(torch.int32).contiguous(), n)


def pack_coords(coords):
    """(N,) int32 from coords (N, 3): a point's three coordinates in one int, 10 bits each
    (`_load_coords` unpacks them), so the kernels load one int per row where three loads of
    (N, 3) and their copies in every layout that uses them were a sixth of the key loop."""
    c = coords.to(torch.int32)
    return (c[:, 0] | (c[:, 1] << 10) | (c[:, 2] << 20)).contiguous()
