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

How the relative terms avoid anything of size sum(n_w^2): on axis a, r depends only on the two
coordinates. Logits: the rows x of a tile's own side (the queries of a query tile, the keys of a
key tile) get x @ T[:, a]^T once, by r, re-indexed per row by the partner's coordinate to a
(rows, G) block (`_by_partner`), and each pair picks its entry with a register gather (tl.gather)
at the partner's coordinate (`_pick`). The partners' side, new at every step of the loop,
gathers each pair's entry straight from its products by r (`_pair_term`): re-indexing them
first would only add a gather. Products by r come as two (rows, L/2) halves
(`_products_by_relative`): one value per thread and row, where a (rows, L) block held two and
made every gather into a narrower block twice over. Sums over pairs (the value table's term,
the table gradients): P (or dS) @ the partners' one-hot coordinates gives a (rows, 4G) block by
partner coordinate, the three axes side by side (column a*GP + c, a fourth slot of zeros
padding it to a power of two); after the loop it splits into the three axes' (rows, G) blocks,
each re-indexed per row to (rows, L) by r (`_by_relative`), then multiplied with the table or
with the rows: per axis an (L, d) table-gradient block per tile, added with one relaxed fp32
atomic per element. The kernels read the coordinates packed one int per point (`pack_coords`).

A split axis (SplitAxis: SphereFormer's radial axis, as its split function computes it) takes
r from per-point values instead: r = first + #{thresholds <= values_i - values_j}, the difference
in fp32 and the count a binary search over the thresholds held in registers (`_split_index`), so
the tables may have 2G rows. Such an r depends on the pair, not on a coordinate of each point:
its logit terms gather each pair's entry from the products by r on both sides, and its sums over
pairs compare every pair with every r (`_histogram`, chunks of (rows, partners, LP/4)) where the
other axes take one MMA with the one-hot coordinates; the split kernels run on narrower tiles.
They are the custom ops torch.ops.lowconv.window_attention_forward, _backward and
window_row_windows (at the end of the file), which torch.compile takes whole.
(scripts/tune_window_attention.py measures the alternatives and what each of these choices gains.)
"""
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowconv.kernels.triton_ops import triton_op, wrap
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


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    maxnreg: int | None = None  # a cap on registers per thread (None: the compiler's choice)
    num_stages: int = 3  # Triton's software pipelining of the partner loop's loads (3: its default)


def tile_config(kernel, rel, split=False):
    """The Tiles of a kernel: the fastest of those tried on an H100 at N = 268,720, h = 1 and 4,
    d = 16, G = 24, fp16 (scripts/tune_window_attention.py; BENCHMARKS.md); bf16 and fp32 use the
    same (fp32 without relative position measured the same order). Relative position holds
    per-axis fp32 blocks per row in registers, so it runs best on small tiles; there the forward
    and the key kernel ran 6-7% faster capped at 168 registers (3 programs per SM, not 2; the
    spills it costs fall mostly outside the loop), the forward 1-4% faster without pipelining
    its loop (about 3 steps per tile), and the query kernel the same either way (within 2%).
    With a split axis, whose per-pair comparisons (_histogram) hold a (rows, partners, LP/4) block,
    narrower tiles: on an H200 (dense scene, h = 4, fp16, 47 thresholds) the forward took 5.6 ms at
    (16, 32, 2 warps) against 13.9 at the (32, 16) tile, forward and backward 24.5 ms against 48.8
    with the query kernel at (16, 32, 2 warps) and the key kernel at (32, 16)."""
    if split:
        return Tiles(32, 16, 4) if kernel is _backward_key_kernel else Tiles(16, 32, 2)
    if rel:
        if kernel is _backward_key_kernel:
            return Tiles(16, 32, 4, maxnreg=168)
        if kernel is _forward_kernel:
            return Tiles(32, 16, 4, maxnreg=168, num_stages=1)
        return Tiles(32, 16, 4)
    return Tiles(64, 64, 4) if kernel is _backward_key_kernel else Tiles(64, 32, 4)


def padded_widths(g, rows=None):
    """GP and LP: G and L (the tables' rows: 2G-1, or 2G with a split axis) padded to powers of
    two, the widths of the kernels' per-axis blocks by coordinate and by relative index; at least 8
    and 16: the compiler cannot lay out register gathers along narrower rows of our tiles, and
    those by relative index gather from two halves of LP/2 (_products_by_relative)."""
    return {"GP": max(8, triton.next_power_of_2(g)),
            "LP": max(16, triton.next_power_of_2(rows or 2 * g - 1))}


def split_widths(count, rows, lp):
    """TP, the split's thresholds padded to a power of two above their count (at least 16, for the
    register gathers of _split_index), and CHUNKS, _histogram's chunks of LP/4 that hold the L
    table rows."""
    return {"TP": max(16, triton.next_power_of_2(count + 1)), "CHUNKS": triton.cdiv(rows, lp // 4)}


class Launch:
    """The arguments and tile sizes every attention kernel of this file shares. `split` is a
    SplitAxis with float32 values and thresholds, or None."""

    def __init__(self, q, tq, start, end, coords, scale, split=None):
        self.n, self.heads, self.head_dim = q.shape
        self.rel = tq is not None
        self.rows = tq.shape[0] if self.rel else 1  # L
        self.g = (self.rows + 1) // 2
        values, thresholds = (None, None) if split is None else (split.values, split.thresholds)
        self.shared = (start, end, coords, values, thresholds)
        self.split = (-1, 0, 0) if split is None else (split.axis, len(split.thresholds), split.first)
        self.scale = scale
        self.precision = dot_precision(q.dtype, q.is_cuda)

    def run(self, kernel, *tensors, launcher=None):
        """Launch `kernel` over its tiles (of queries, or of keys) and the heads. The ops launch
        through `launcher`, triton_ops.wrap(kernel), which torch.compile can trace; else directly.
        A traced launch goes without the register cap (maxnreg): torch.compile's kernel wrapper
        takes num_warps and num_stages, not maxnreg, as launch options."""
        if self.n == 0:
            return
        tiles = tile_config(kernel, self.rel, self.split[0] >= 0)
        tile = tiles.block_n if kernel is _backward_key_kernel else tiles.block_m
        launcher = launcher or kernel
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        if launcher is kernel:
            options["maxnreg"] = tiles.maxnreg
        axis, count, first = self.split
        widths = padded_widths(self.g, self.rows)
        launcher[(triton.cdiv(self.n, tile), self.heads)](
            *tensors, *self.shared, self.n, self.heads, self.g, self.rows, count, first, self.scale, D=self.head_dim,
            REL=self.rel, SPLIT=axis, **split_widths(count, self.rows, widths["LP"]), **widths,
            PRECISION=self.precision, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **options)


@triton.jit
def _row_windows_kernel(offsets, start, end, N, W, STEPS, BLOCK: tl.constexpr):
    """start, end of each row: the last window w with offsets[w] <= row (non-empty, so
    offsets[w+1] > row), found by binary search over [0, W)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + W
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        below = tl.load(offsets + mid, mask=ok, other=0) <= rows
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    tl.store(start + rows, tl.load(offsets + lo, mask=ok), mask=ok)
    tl.store(end + rows, tl.load(offsets + lo + 1, mask=ok), mask=ok)


@triton.jit
def _load_rows(ptr, rows, ok, head, H, D: tl.constexpr):
    """The (len(rows), D) block of head `head` of an (N, H, D) tensor; zeros where not ok."""
    offs = (rows.to(tl.int64)[:, None] * H + head) * D + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=ok[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, rows, ok, head, H, D: tl.constexpr, block):
    offs = (rows.to(tl.int64)[:, None] * H + head) * D + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, block.to(ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _tile(start, end, first, N, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    """A tile of BLOCK sorted rows from `first`: rows, which exist, each row's window (its
    start; OTHER where the row does not exist), and the span [lo, hi) of partner rows its
    windows cover (from the first row's window start to the last row's window end)."""
    rows = first + tl.arange(0, BLOCK)
    ok = rows < N
    window = tl.load(start + rows, mask=ok, other=OTHER)
    lo = tl.load(start + first)
    hi = tl.load(end + tl.minimum(first + BLOCK, N) - 1)
    return rows, ok, window, lo, hi


@triton.jit
def _partners(start, rows, hi, OTHER: tl.constexpr):
    """A block of partner rows below hi: which exist, and each one's window."""
    ok = rows < hi
    return ok, tl.load(start + rows, mask=ok, other=OTHER)


@triton.jit
def _key_block(k, v, start, first, hi, head, H, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block of BLOCK_N key rows from `first` (below hi): rows, which exist, their windows,
    and their k and v."""
    cols = first + tl.arange(0, BLOCK_N)
    col_ok, col_window = _partners(start, cols, hi, -2)
    return (cols, col_ok, col_window, _load_rows(k, cols, col_ok, head, H, D),
            _load_rows(v, cols, col_ok, head, H, D))


@triton.jit
def _load_scaled(q, rows, ok, head, H, D: tl.constexpr, scale):
    """qs = q * scale in fp32, rounded to q's dtype."""
    return (_load_rows(q, rows, ok, head, H, D).to(tl.float32) * scale).to(q.dtype.element_ty)


@triton.jit
def _load_coords(coords, rows, ok):
    """The rows' coordinates on the three axes (a tuple of three int vectors), from pack_coords."""
    packed = tl.load(coords + rows, mask=ok, other=0)
    return packed & 1023, (packed >> 10) & 1023, packed >> 20


def dot_precision(dtype, is_cuda):
    """_dot's PRECISION for operands of `dtype`: tf32x3 for fp32 (about fp32 accuracy), else
    "tf32", which fp16/bf16 operands ignore; "upcast" for bf16 in the interpreter."""
    if dtype == torch.float32:
        return "tf32x3"
    return "tf32" if dtype == torch.float16 or is_cuda else "upcast"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. PRECISION "upcast" (the interpreter with bf16, whose dot
    multiplies bf16's raw bits) multiplies the same values in fp32, where their products are
    exact: the same numbers as a bf16 MMA."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _split_dot(x, y, PRECISION: tl.constexpr):
    """x @ y for fp32 x and y in the compute dtype (a table, rows): x is split into a high and a
    low part in y's dtype, so x keeps about twice that dtype's mantissa bits (16 for bf16, 22
    for fp16) while the MMAs stay half precision; fp32 uses tf32x3."""
    if y.dtype == tl.float32:
        return tl.dot(x, y, input_precision="tf32x3")
    high = x.to(y.dtype)
    low = (x - high.to(tl.float32)).to(y.dtype)
    return _dot(high, y, PRECISION) + _dot(low, y, PRECISION)


@triton.jit
def _table_entry(r, axis, head, H, D: tl.constexpr):
    """Offsets of rows T[r, axis] (r, axis: (rows, 1)) of a table (L, 3, H, D), for one head."""
    return ((r * 3 + axis) * H + head) * D + tl.arange(0, D)[None, :]


@triton.jit
def _add_to_table(grad, axis: tl.constexpr, head, H, D: tl.constexpr, L, LP: tl.constexpr, block):
    """One fp32 atomic add per element of a tile's (LP, D) gradient block of T[:, axis] (L rows),
    relaxed: nothing reads the sums before the kernel ends, so the adds need no ordering (acq_rel,
    the default, fences every one)."""
    r = tl.arange(0, LP)[:, None]
    tl.atomic_add(grad + _table_entry(r, axis, head, H, D), block, mask=r < L, sem="relaxed")


@triton.jit
def _one_hot(c, GP: tl.constexpr, dtype: tl.constexpr):
    """(rows, 4*GP): 1 at column a*GP + c_a of each row's coordinates. Built transposed, so the
    compiler spreads the rows over the threads: built as (rows, 4*GP) it gave every thread all
    the rows' coordinates (a quarter of the key loop's instructions, loads included)."""
    row = tl.arange(0, 4 * GP)[:, None]
    axis = row // GP
    own = tl.where(axis == 0, c[0][None, :], tl.where(axis == 1, c[1][None, :], c[2][None, :]))
    return tl.trans(tl.where((axis < 3) & (own == row % GP), 1.0, 0.0).to(dtype))


@triton.jit
def _axis_table(table, axis: tl.constexpr, head, H, D: tl.constexpr, L, ROWS: tl.constexpr,
                FIRST: tl.constexpr = 0):
    """T[FIRST:FIRST+ROWS, axis] of a table (L, 3, H, D) for one head: (ROWS, D), zero past L."""
    r = FIRST + tl.arange(0, ROWS)[:, None]
    return tl.load(table + _table_entry(r, axis, head, H, D), mask=r < L, other=0.0)


@triton.jit
def _halved_table(table, axis: tl.constexpr, head, H, D: tl.constexpr, L, LP: tl.constexpr):
    """T[:, axis] as its two (LP/2, D) halves."""
    return (_axis_table(table, axis, head, H, D, L, LP // 2),
            _axis_table(table, axis, head, H, D, L, LP // 2, LP // 2))


@triton.jit
def _halved_tables(table, head, H, D: tl.constexpr, L, LP: tl.constexpr):
    """_halved_table on the three axes."""
    return (_halved_table(table, 0, head, H, D, L, LP), _halved_table(table, 1, head, H, D, L, LP),
            _halved_table(table, 2, head, H, D, L, LP))


@triton.jit
def _products_by_relative(x, table, PRECISION: tl.constexpr):
    """x @ T[:, a]^T (table: the two (LP/2, D) halves of axis a, _halved_tables) as two
    (rows, LP/2) fp32 halves, columns r and r - LP/2: one value per thread and row each for the
    register gathers, where one (rows, LP) block held two per thread and, for gathers of
    narrower outputs, repeated every gather twice."""
    return _dot(x, tl.trans(table[0]), PRECISION), _dot(x, tl.trans(table[1]), PRECISION)


@triton.jit
def _gather_relative(x_by_r, r):
    """x_by_r (_products_by_relative) at column r of each row (r: any shape of rows)."""
    half = x_by_r[0].shape[1]
    return tl.where(r < half, tl.gather(x_by_r[0], r % half, 1), tl.gather(x_by_r[1], r % half, 1))


@triton.jit
def _by_partner_axis(x, table, own, IS_QUERY: tl.constexpr, G, GP: tl.constexpr,
                     PRECISION: tl.constexpr):
    """(rows, GP) fp32: column p holds <x_row, T[r, a]> (table: axis a of _halved_tables) for
    the relative index r of the row (coordinate `own`) and a partner at coordinate p:
    r = own - p + G-1 for a query row, p - own + G-1 for a key row; zero for p >= G."""
    p = tl.arange(0, GP)[None, :]
    r = own[:, None] - p + G - 1 if IS_QUERY else p - own[:, None] + G - 1
    ok = p < G
    x_by_r = _products_by_relative(x, table, PRECISION)
    return tl.where(ok, _gather_relative(x_by_r, tl.where(ok, r, 0)), 0.0)


@triton.jit
def _by_partner(x, tables, c, IS_QUERY: tl.constexpr, G, GP: tl.constexpr, PRECISION: tl.constexpr):
    """_by_partner_axis on the three axes: a tuple of three (rows, GP) blocks."""
    return (_by_partner_axis(x, tables[0], c[0], IS_QUERY, G, GP, PRECISION),
            _by_partner_axis(x, tables[1], c[1], IS_QUERY, G, GP, PRECISION),
            _by_partner_axis(x, tables[2], c[2], IS_QUERY, G, GP, PRECISION))


@triton.jit
def _pick_axis(x_by_p, partner):
    """(rows, partners): x_by_p[row, partner coordinate], one register gather per pair."""
    return tl.gather(x_by_p, tl.broadcast_to(partner[None, :], (x_by_p.shape[0], partner.shape[0])), 1)


@triton.jit
def _pick(x_by_p, partner, SPLIT: tl.constexpr):
    """(rows, partners): sum over the axes but SPLIT of _pick_axis, e.g. <qs_i, sum_a tq[r_a, a]>."""
    if SPLIT != 0:
        total = _pick_axis(x_by_p[0], partner[0])
    else:
        total = _pick_axis(x_by_p[1], partner[1])
    if SPLIT != 0 and SPLIT != 1:
        total += _pick_axis(x_by_p[1], partner[1])
    if SPLIT != 2:
        total += _pick_axis(x_by_p[2], partner[2])
    return total


@triton.jit
def _pair_term_axis(x, table, own, partner, IS_QUERY: tl.constexpr, G, PRECISION: tl.constexpr):
    """(rows, partners) fp32: <x_row, T[r, a]> (table: axis a of _halved_tables) at each pair's
    relative index r (own: the rows' coordinates, partner: the partners'), gathered straight
    from the products by r: for the partners' side of a tile, used once, re-indexing by
    partner coordinate first (_by_partner_axis) would only add a gather."""
    r = own[:, None] - partner[None, :] + G - 1 if IS_QUERY else partner[None, :] - own[:, None] + G - 1
    return _gather_relative(_products_by_relative(x, table, PRECISION), r)


@triton.jit
def _pair_term(x, tables, own, partner, IS_QUERY: tl.constexpr, G, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """(rows, partners): sum over the axes but SPLIT of _pair_term_axis (tables: _halved_tables),
    e.g. <k_j, sum_a tk[r_a, a]>."""
    if SPLIT != 0:
        total = _pair_term_axis(x, tables[0], own[0], partner[0], IS_QUERY, G, PRECISION)
    else:
        total = _pair_term_axis(x, tables[1], own[1], partner[1], IS_QUERY, G, PRECISION)
    if SPLIT != 0 and SPLIT != 1:
        total += _pair_term_axis(x, tables[1], own[1], partner[1], IS_QUERY, G, PRECISION)
    if SPLIT != 2:
        total += _pair_term_axis(x, tables[2], own[2], partner[2], IS_QUERY, G, PRECISION)
    return total


@triton.jit
def _split_index(values, thresholds, own_rows, own_ok, partner_rows, partner_ok, T, FIRST,
                 IS_QUERY: tl.constexpr, TP: tl.constexpr):
    """(own, partners) int32: the split axis's relative index of each pair, FIRST + the number of
    thresholds at or below d = values[query] - values[key] (fp32, as the split computed it): a
    binary search of log2(TP) steps over the T thresholds held in registers (padded to TP with
    +inf), one register gather per pair and step."""
    own = tl.load(values + own_rows, mask=own_ok, other=0.0)
    partner = tl.load(values + partner_rows, mask=partner_ok, other=0.0)
    d = own[:, None] - partner[None, :] if IS_QUERY else partner[None, :] - own[:, None]
    m = tl.arange(0, TP)
    sorted_thresholds = tl.load(thresholds + m, mask=m < T, other=float("inf"))
    table = tl.broadcast_to(sorted_thresholds[None, :], (d.shape[0], TP))
    count = tl.zeros(d.shape, tl.int32)  # thresholds[:count] are at or below d
    for i in tl.static_range(9):  # steps TP/2, TP/4, ..., 1 (TP <= 512)
        if (TP >> (i + 1)) > 0:  # sorted: thresholds[count + step - 1] <= d puts step more below d
            below = tl.gather(table, count + ((TP >> (i + 1)) - 1), 1) <= d
            count += tl.where(below, TP >> (i + 1), 0)
    return count + FIRST


@triton.jit
def _histogram_chunk(values, index, C: tl.constexpr, W: tl.constexpr, CHUNKS: tl.constexpr):
    """Chunk C of _histogram: (own, W), zeros for a chunk past the tables' rows."""
    if C < CHUNKS:
        w = C * W + tl.arange(0, W)[None, None, :]
        return tl.sum(tl.where(index == w, values, 0.0), 1)
    return tl.zeros([values.shape[0], W], tl.float32)


@triton.jit
def _histogram(x, r, LP: tl.constexpr, CHUNKS: tl.constexpr):
    """(own, LP) fp32 as four (own, LP/4) chunks: column w of chunk c sums x (own, partners) over
    the partners whose split index r is c * LP/4 + w; the first CHUNKS chunks hold the tables'
    rows, the others are zeros. A pair's index depends on the pair, not on its partner alone, so
    no one-hot matrix of the partners can sum it: each chunk compares every pair with LP/4 indices
    (chunks bound the registers of the (own, partners, LP/4) comparison)."""
    W: tl.constexpr = LP // 4
    values, index = x.to(tl.float32)[:, :, None], r[:, :, None]
    return (_histogram_chunk(values, index, 0, W, CHUNKS), _histogram_chunk(values, index, 1, W, CHUNKS),
            _histogram_chunk(values, index, 2, W, CHUNKS), _histogram_chunk(values, index, 3, W, CHUNKS))


@triton.jit
def _scaled_add(chunks, alpha, more):
    """chunks * alpha (per row) + more, chunk by chunk (_histogram's chunks)."""
    a = alpha[:, None]
    return (chunks[0] * a + more[0], chunks[1] * a + more[1], chunks[2] * a + more[2], chunks[3] * a + more[3])


@triton.jit
def _added(chunks, more):
    """chunks + more, chunk by chunk (_histogram's chunks)."""
    return chunks[0] + more[0], chunks[1] + more[1], chunks[2] + more[2], chunks[3] + more[3]


@triton.jit
def _side_by_side(a, b):
    """(rows, 2W): a's columns, then b's (both (rows, W))."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _joined(chunks):
    """_histogram's four (own, W) chunks as one (own, 4W) block, in order."""
    return _side_by_side(_side_by_side(chunks[0], chunks[1]), _side_by_side(chunks[2], chunks[3]))


@triton.jit
def _with_split(by_r, split_by_r, SPLIT: tl.constexpr):
    """by_r (three (rows, LP) blocks by relative index) with axis SPLIT's replaced, if any."""
    if SPLIT == 0:
        return split_by_r, by_r[1], by_r[2]
    if SPLIT == 1:
        return by_r[0], split_by_r, by_r[2]
    if SPLIT == 2:
        return by_r[0], by_r[1], split_by_r
    return by_r


@triton.jit
def _axis_blocks(x, GP: tl.constexpr):
    """The three (rows, GP) blocks of axes 0, 1, 2 of a (rows, 4*GP) block (column a*GP + c)."""
    x = tl.permute(tl.reshape(x, (x.shape[0], 2, 2, GP)), (0, 3, 1, 2))  # [row, c, a // 2, a % 2]
    even, odd = tl.split(x)
    axis0, axis2 = tl.split(even)
    axis1, _ = tl.split(odd)
    return axis0, axis1, axis2


@triton.jit
def _by_relative_axis(x, own, IS_QUERY: tl.constexpr, G, LP: tl.constexpr):
    """(rows, GP) indexed by the partner's coordinate p -> (rows, LP) indexed by r, the
    relative index of the row (coordinate `own`) and that partner: a query row has
    r = own - p + G-1, so p = own + G-1 - r; a key row has r = p - own + G-1, so
    p = r + own - (G-1)."""
    r = tl.arange(0, LP)[None, :]
    partner = own[:, None] - r + G - 1 if IS_QUERY else r + own[:, None] - (G - 1)
    ok = (r < 2 * G - 1) & (partner >= 0) & (partner < G)
    return tl.where(ok, tl.gather(x, tl.where(ok, partner, 0), 1), 0.0)


@triton.jit
def _by_relative(x, c, IS_QUERY: tl.constexpr, G, GP: tl.constexpr, LP: tl.constexpr):
    """_by_relative_axis on the three axes of a (rows, 4*GP) block: a tuple of three (rows, LP)
    blocks. Per axis, each gather reads a (rows, GP) block, one value per thread and row, where
    the whole (rows, 4*GP) block held four per thread and cost four shuffles per value."""
    x = _axis_blocks(x, GP)
    return (_by_relative_axis(x[0], c[0], IS_QUERY, G, LP),
            _by_relative_axis(x[1], c[1], IS_QUERY, G, LP),
            _by_relative_axis(x[2], c[2], IS_QUERY, G, LP))


@triton.jit
def _times_table(by_r, table, head, H, D: tl.constexpr, L, LP: tl.constexpr,
                 PRECISION: tl.constexpr):
    """sum_a by_r[a] @ T[:, a] (by_r: _by_relative's blocks): (rows, D)."""
    return (_split_dot(by_r[0], _axis_table(table, 0, head, H, D, L, LP), PRECISION)
            + _split_dot(by_r[1], _axis_table(table, 1, head, H, D, L, LP), PRECISION)
            + _split_dot(by_r[2], _axis_table(table, 2, head, H, D, L, LP), PRECISION))


@triton.jit
def _add_table_grad(grad, by_r, rows, head, H, D: tl.constexpr, L, LP: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Adds by_r[a]^T @ rows (by_r: _by_relative's blocks) to the gradient of T[:, a]."""
    _add_to_table(grad, 0, head, H, D, L, LP, _split_dot(tl.trans(by_r[0]), rows, PRECISION))
    _add_to_table(grad, 1, head, H, D, L, LP, _split_dot(tl.trans(by_r[1]), rows, PRECISION))
    _add_to_table(grad, 2, head, H, D, L, LP, _split_dot(tl.trans(by_r[2]), rows, PRECISION))


@triton.jit
def _forward_kernel(q, k, v, out, lse, tq, tk, tv, start, end, coords, split_values, thresholds, N, H, G, L, T,
                    FIRST, scale, D: tl.constexpr, REL: tl.constexpr, SPLIT: tl.constexpr, TP: tl.constexpr,
                    CHUNKS: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_M sorted query rows, one head: online softmax over the tile's key span.
    SPLIT >= 0: that axis's relative index is the split's (SplitAxis), per pair."""
    dtype = q.dtype.element_ty
    head = tl.program_id(1)
    rows, row_ok, row_window, lo, hi = _tile(start, end, tl.program_id(0) * BLOCK_M, N, BLOCK_M, -1)
    qs = _load_scaled(q, rows, row_ok, head, H, D, scale)
    if REL:
        qc = _load_coords(coords, rows, row_ok)
        tq_halves = _halved_tables(tq, head, H, D, L, LP)
        q_by_p = _by_partner(qs, tq_halves, qc, True, G, GP, PRECISION)
        tk_halves = _halved_tables(tk, head, H, D, L, LP)
        v_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)  # sum_j p_ij [c_j = c], by column c
        if SPLIT >= 0:
            q_by_r = _products_by_relative(qs, tq_halves[SPLIT], PRECISION)
            zero = tl.zeros([BLOCK_M, LP // 4], tl.float32)
            v_split = (zero, zero, zero, zero)  # sum_j p_ij [r_ij = r], by column r
    m = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: masked rows never give inf - inf
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        cols, col_ok, col_window, kb, vb = _key_block(k, v, start, first, hi, head, H, D, BLOCK_N)
        s = _dot(qs, tl.trans(kb), PRECISION)
        if REL:
            kc = _load_coords(coords, cols, col_ok)
            k_hot = _one_hot(kc, GP, dtype)
            s += _pick(q_by_p, kc, SPLIT) + tl.trans(_pair_term(kb, tk_halves, kc, qc, False, G, PRECISION, SPLIT))
            if SPLIT >= 0:
                r = _split_index(split_values, thresholds, rows, row_ok, cols, col_ok, T, FIRST, True, TP)
                k_by_r = _products_by_relative(kb, tk_halves[SPLIT], PRECISION)
                s += _gather_relative(q_by_r, r) + tl.trans(_gather_relative(k_by_r, tl.trans(r)))
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        p_rounded = p.to(dtype)
        acc = acc * alpha[:, None] + _dot(p_rounded, vb, PRECISION)
        if REL:
            v_rel = v_rel * alpha[:, None] + _dot(p_rounded, k_hot, PRECISION)
            if SPLIT >= 0:
                v_split = _scaled_add(v_split, alpha, _histogram(p_rounded, r, LP, CHUNKS))
        m = m_new
    if REL:
        by_r = _by_relative(v_rel, qc, True, G, GP, LP)
        if SPLIT >= 0:
            by_r = _with_split(by_r, _joined(v_split), SPLIT)
        acc += _times_table(by_r, tv, head, H, D, L, LP, PRECISION)
    l = tl.where(l > 0, l, 1.0)  # only padding rows have no key
    _store_rows(out, rows, row_ok, head, H, D, acc / l[:, None])
    tl.store(lse + rows * H + head, m + tl.log(l), mask=row_ok)


@triton.jit
def _backward_query_kernel(q, k, v, o, do, lse, delta, dq, tq, tk, tv, dtq, dtv,
                           start, end, coords, split_values, thresholds, N, H, G, L, T, FIRST, scale,
                           D: tl.constexpr, REL: tl.constexpr, SPLIT: tl.constexpr, TP: tl.constexpr,
                           CHUNKS: tl.constexpr, GP: tl.constexpr,
                           LP: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq for one query tile and head, the tile's share of dtq and dtv, and the tile's
    delta = <dO, O> per row (stored for the key kernel)."""
    dtype = q.dtype.element_ty
    head = tl.program_id(1)
    rows, row_ok, row_window, lo, hi = _tile(start, end, tl.program_id(0) * BLOCK_M, N, BLOCK_M, -1)
    qs = _load_scaled(q, rows, row_ok, head, H, D, scale)
    dob = _load_rows(do, rows, row_ok, head, H, D)
    row_delta = tl.sum(dob.to(tl.float32) * _load_rows(o, rows, row_ok, head, H, D).to(tl.float32), 1)
    tl.store(delta + rows * H + head, row_delta, mask=row_ok)
    row_lse = tl.load(lse + rows * H + head, mask=row_ok, other=0.0)
    if REL:
        qc = _load_coords(coords, rows, row_ok)
        tq_halves = _halved_tables(tq, head, H, D, L, LP)
        tv_halves = _halved_tables(tv, head, H, D, L, LP)
        q_by_p = _by_partner(qs, tq_halves, qc, True, G, GP, PRECISION)
        do_by_p = _by_partner(dob, tv_halves, qc, True, G, GP, PRECISION)
        tk_halves = _halved_tables(tk, head, H, D, L, LP)
        ds_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)
        p_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)
        if SPLIT >= 0:
            q_by_r = _products_by_relative(qs, tq_halves[SPLIT], PRECISION)
            do_by_r = _products_by_relative(dob, tv_halves[SPLIT], PRECISION)
            zero = tl.zeros([BLOCK_M, LP // 4], tl.float32)
            ds_split, p_split = (zero, zero, zero, zero), (zero, zero, zero, zero)
    dqs = tl.zeros([BLOCK_M, D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        cols, col_ok, col_window, kb, vb = _key_block(k, v, start, first, hi, head, H, D, BLOCK_N)
        s = _dot(qs, tl.trans(kb), PRECISION)
        dp = _dot(dob, tl.trans(vb), PRECISION)
        if REL:
            kc = _load_coords(coords, cols, col_ok)
            k_hot = _one_hot(kc, GP, dtype)
            s += _pick(q_by_p, kc, SPLIT) + tl.trans(_pair_term(kb, tk_halves, kc, qc, False, G, PRECISION, SPLIT))
            dp += _pick(do_by_p, kc, SPLIT)
            if SPLIT >= 0:
                r = _split_index(split_values, thresholds, rows, row_ok, cols, col_ok, T, FIRST, True, TP)
                k_by_r = _products_by_relative(kb, tk_halves[SPLIT], PRECISION)
                s += _gather_relative(q_by_r, r) + tl.trans(_gather_relative(k_by_r, tl.trans(r)))
                dp += _gather_relative(do_by_r, r)
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        p = tl.exp(s - row_lse[:, None])
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dqs += _dot(ds, kb, PRECISION)
        if REL:
            ds_rel += _dot(ds, k_hot, PRECISION)
            p_rel += _dot(p.to(dtype), k_hot, PRECISION)
            if SPLIT >= 0:
                ds_split = _added(ds_split, _histogram(ds, r, LP, CHUNKS))
                p_split = _added(p_split, _histogram(p.to(dtype), r, LP, CHUNKS))
    if REL:
        ds_by_r = _by_relative(ds_rel, qc, True, G, GP, LP)
        p_by_r = _by_relative(p_rel, qc, True, G, GP, LP)
        if SPLIT >= 0:
            ds_by_r = _with_split(ds_by_r, _joined(ds_split), SPLIT)
            p_by_r = _with_split(p_by_r, _joined(p_split), SPLIT)
        dqs += _times_table(ds_by_r, tq, head, H, D, L, LP, PRECISION)
        _add_table_grad(dtq, ds_by_r, qs, head, H, D, L, LP, PRECISION)
        _add_table_grad(dtv, p_by_r, dob, head, H, D, L, LP, PRECISION)
    _store_rows(dq, rows, row_ok, head, H, D, dqs * scale)


@triton.jit
def _backward_key_kernel(q, k, v, do, lse, delta, dk, dv, tq, tk, tv, dtk,
                         start, end, coords, split_values, thresholds, N, H, G, L, T, FIRST, scale,
                         D: tl.constexpr, REL: tl.constexpr, SPLIT: tl.constexpr, TP: tl.constexpr,
                         CHUNKS: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv for one tile of BLOCK_N keys and one head (its query span, mirrored), and the
    tile's share of dtk."""
    dtype = q.dtype.element_ty
    head = tl.program_id(1)
    cols, col_ok, col_window, lo, hi = _tile(start, end, tl.program_id(0) * BLOCK_N, N, BLOCK_N, -2)
    kb = _load_rows(k, cols, col_ok, head, H, D)
    vb = _load_rows(v, cols, col_ok, head, H, D)
    if REL:
        kc = _load_coords(coords, cols, col_ok)
        tk_halves = _halved_tables(tk, head, H, D, L, LP)
        k_by_p = _by_partner(kb, tk_halves, kc, False, G, GP, PRECISION)
        tq_halves = _halved_tables(tq, head, H, D, L, LP)
        tv_halves = _halved_tables(tv, head, H, D, L, LP)
        ds_rel = tl.zeros([BLOCK_N, 4 * GP], tl.float32)
        if SPLIT >= 0:
            k_by_r = _products_by_relative(kb, tk_halves[SPLIT], PRECISION)
            zero = tl.zeros([BLOCK_N, LP // 4], tl.float32)
            ds_split = (zero, zero, zero, zero)
    dkb = tl.zeros([BLOCK_N, D], tl.float32)
    dvb = tl.zeros([BLOCK_N, D], tl.float32)
    for first in range(lo, hi, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        row_ok, row_window = _partners(start, rows, hi, -1)
        qs = _load_scaled(q, rows, row_ok, head, H, D, scale)
        dob = _load_rows(do, rows, row_ok, head, H, D)
        row_lse = tl.load(lse + rows * H + head, mask=row_ok, other=0.0)
        row_delta = tl.load(delta + rows * H + head, mask=row_ok, other=0.0)
        s = _dot(qs, tl.trans(kb), PRECISION)
        dp = _dot(dob, tl.trans(vb), PRECISION)
        if REL:
            qc = _load_coords(coords, rows, row_ok)
            q_hot = _one_hot(qc, GP, dtype)
            s += _pair_term(qs, tq_halves, qc, kc, True, G, PRECISION, SPLIT) + tl.trans(_pick(k_by_p, qc, SPLIT))
            dp += _pair_term(dob, tv_halves, qc, kc, True, G, PRECISION, SPLIT)
            if SPLIT >= 0:
                r_t = _split_index(split_values, thresholds, cols, col_ok, rows, row_ok, T, FIRST, False, TP)
                r = tl.trans(r_t)
                s += (_gather_relative(_products_by_relative(qs, tq_halves[SPLIT], PRECISION), r)
                      + tl.trans(_gather_relative(k_by_r, r_t)))
                dp += _gather_relative(_products_by_relative(dob, tv_halves[SPLIT], PRECISION), r)
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        p = tl.exp(s - row_lse[:, None])
        ds_t = tl.trans((p * (dp - row_delta[:, None])).to(dtype))
        dvb += _dot(tl.trans(p.to(dtype)), dob, PRECISION)
        dkb += _dot(ds_t, qs, PRECISION)
        if REL:
            ds_rel += _dot(ds_t, q_hot, PRECISION)
            if SPLIT >= 0:
                ds_split = _added(ds_split, _histogram(ds_t, r_t, LP, CHUNKS))
    if REL:
        ds_by_r = _by_relative(ds_rel, kc, False, G, GP, LP)
        if SPLIT >= 0:
            ds_by_r = _with_split(ds_by_r, _joined(ds_split), SPLIT)
        dkb += _times_table(ds_by_r, tk, head, H, D, L, LP, PRECISION)
        _add_table_grad(dtk, ds_by_r, kb, head, H, D, L, LP, PRECISION)
    _store_rows(dk, cols, col_ok, head, H, D, dkb)
    _store_rows(dv, cols, col_ok, head, H, D, dvb)


# ---------------------------------------------------------------------------------------------
# The kernels as custom ops (kernels/triton_ops.py): q, k, v (N, h, d) and the tables (L, 3, h, d) or
# three Nones in the compute dtype, contiguous; the row windows (start, end) int32 (N,); the packed
# coordinates (pack_coords) or None; the scale.


@triton_op("lowconv::window_row_windows", mutates_args=())
def window_row_windows(offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """launch_row_windows's kernel: offsets (W+1,) int32, contiguous."""
    start = offsets.new_empty(n)
    end = torch.empty_like(start)
    if n:
        windows = len(offsets) - 1
        block = 1024
        wrap(_row_windows_kernel)[(triton.cdiv(n, block),)](
            offsets, start, end, n, windows, max(1, windows.bit_length()), BLOCK=block)
    return start, end


@triton_op("lowconv::window_attention_forward", mutates_args=())
def window_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tq: torch.Tensor | None,
                             tk: torch.Tensor | None, tv: torch.Tensor | None, start: torch.Tensor, end: torch.Tensor,
                             coords: torch.Tensor | None, split_values: torch.Tensor | None,
                             thresholds: torch.Tensor | None, split_axis: int, split_first: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: out, and each row's log-sum-exp (N, h) fp32, which the backward reads;
    autograd (register_autograd below) gives q, k, v and the tables their gradients. A split axis
    comes as its values and thresholds (float32, contiguous), axis and first bucket (else Nones)."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
    Launch(q, tq, start, end, coords, scale, split_axis_of(split_values, thresholds, split_axis, split_first)).run(
        _forward_kernel, q, k, v, out, lse, tq, tk, tv, launcher=wrap(_forward_kernel))
    return out, lse


def split_axis_of(values, thresholds, axis, first) -> SplitAxis | None:
    return None if values is None else SplitAxis(axis, values, thresholds, first)


@triton_op("lowconv::window_attention_backward", mutates_args=())
def window_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              tq: torch.Tensor | None, tk: torch.Tensor | None, tv: torch.Tensor | None,
                              start: torch.Tensor, end: torch.Tensor, coords: torch.Tensor | None,
                              split_values: torch.Tensor | None, thresholds: torch.Tensor | None, split_axis: int,
                              split_first: int, out: torch.Tensor, lse: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the tables' gradients (empty tensors without tables), from the forward's
    inputs, output and lse and the output's gradient (in the compute dtype, contiguous)."""
    delta = torch.empty_like(lse)  # written by the query kernel, read by the key kernel
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rel = tq is not None
    # The kernels add to the table gradients with fp32 atomics.
    dtq, dtk, dtv = ((torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (tq, tk, tv))
                     if rel else (None, None, None))
    launch = Launch(q, tq, start, end, coords, scale, split_axis_of(split_values, thresholds, split_axis, split_first))
    launch.run(_backward_query_kernel, q, k, v, out, grad_out, lse, delta, dq, tq, tk, tv, dtq, dtv,
               launcher=wrap(_backward_query_kernel))
    launch.run(_backward_key_kernel, q, k, v, grad_out, lse, delta, dk, dv, tq, tk, tv, dtk,
               launcher=wrap(_backward_key_kernel))
    if not rel:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0), q.new_empty(0)
    return dq, dk, dv, dtq.to(q.dtype), dtk.to(q.dtype), dtv.to(q.dtype)


def save_for_backward(ctx, inputs, output):
    *tensors, split_axis, split_first, scale = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.split, ctx.scale = (split_axis, split_first), scale
    ctx.mark_non_differentiable(output[1])


def attention_backward(ctx, grad_out, _):
    q, k, v, tq, tk, tv, start, end, coords, split_values, thresholds, out, lse = ctx.saved_tensors
    dq, dk, dv, *table_grads = torch.ops.lowconv.window_attention_backward(
        as_operand(grad_out, q.dtype), q, k, v, tq, tk, tv, start, end, coords, split_values, thresholds,
        *ctx.split, out, lse, ctx.scale)
    return dq, dk, dv, *(table_grads if tq is not None else (None,) * 3), *(None,) * 8


window_attention_forward.register_autograd(attention_backward, setup_context=save_for_backward)
