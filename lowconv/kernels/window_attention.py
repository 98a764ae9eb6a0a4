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
coordinates. Logits: a tile's rows get x @ T[:, a]^T once, a (rows, L) fp32 block by r,
re-indexed per row by the partner's coordinate to a (rows, G) block (`_by_partner`), and each
pair picks its entry with a register gather (tl.gather) at the partner's coordinate (`_pick`).
Sums over pairs (the value table's term, the table gradients): P (or dS) @ the partners' one-hot
coordinates gives a (rows, G) block by partner coordinate, re-indexed per row to (rows, L) by r
(`_by_relative`), then multiplied with the table or with the rows: an (L, d) table-gradient
block per tile, added with one fp32 atomic per element. Those blocks hold the three axes side
by side, column a*GP + c (a*LP + r), a fourth slot of zeros padding them to a power of two.
(Measured on the H100 with scripts/tune_window_attention.py, dense scene, G = 24, fp16, h = 4:
gathers from these (rows, G) blocks are 7-26% faster than from (rows, L) blocks by relative index,
2.1-2.3x faster than one-hot MMAs over the partner-indexed blocks, and 4-13x faster than gathers
from one (rows, 3L) block; BENCHMARKS.md.)
"""
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "triton", "reference")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def window_attention(q, k, v, offsets=None, *, row_windows=None, scale=None, coords=None,
                     tables=None, dtype=None, backend="auto", validate=True):
    """Self-attention within each window (see the module doc), differentiable for q, k, v and tables.

    The windows come as offsets (W+1,) integer (window w is rows offsets[w]:offsets[w+1], empty
    windows allowed) or as row_windows = (start, end), each (N,) integer; give one of them.
    coords (N, 3) integer in [0, G-1] and tables = (tq, tk, tv), each (L, 3, h, d) with
    L = 2G-1, turn on relative position; pass both or neither. `scale` None is d^-0.5.
    `dtype` None computes in q's dtype. `backend` "auto" runs Triton on CUDA and the torch
    reference elsewhere; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before import.
    `validate` checks the values of offsets, row_windows and coords, which reads them back from
    the device (a sync); a caller that built them itself can pass False (bad values then read
    out of bounds).
    """
    check_inputs(q, k, v, offsets, row_windows, scale, coords, tables, dtype, backend)
    if validate:
        check_values(q.shape[0], offsets, row_windows, coords, tables)
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if not use_triton:
        return window_attention_reference(q, k, v, offsets, row_windows=row_windows, scale=scale,
                                          coords=coords, tables=tables, dtype=dtype)
    check_triton_inputs(q, dtype)
    out_dtype, dtype = q.dtype, dtype or q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if offsets is None:
        start, end = (t.to(torch.int32).contiguous() for t in row_windows)
    else:
        start, end = launch_row_windows(offsets, q.shape[0])
    q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
    if tables is None:
        tq = tk = tv = None
    else:
        coords = coords.to(torch.int32).contiguous()
        tq, tk, tv = (t.to(dtype).contiguous() for t in tables)
    out = WindowAttention.apply(q, k, v, tq, tk, tv, start, end, coords, scale)
    return out.to(out_dtype)


def window_attention_reference(q, k, v, offsets=None, *, row_windows=None, scale=None,
                               coords=None, tables=None, dtype=None):
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


def check_inputs(q, k, v, offsets, row_windows, scale, coords, tables, dtype, backend):
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
    check_relative_position(q, coords, tables)


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


def check_relative_position(q, coords, tables):
    if (coords is None) != (tables is None):
        raise ValueError("window_attention: relative position needs both coords and tables "
                         f"(got {'coords' if tables is None else 'tables'} only)")
    if tables is None:
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
    if any(t.shape[0] != length for t in tables) or length % 2 == 0:
        raise ValueError(f"window_attention: the tables must share one odd L = 2G-1, got "
                         f"{[t.shape[0] for t in tables]}")


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


def check_triton_inputs(q, dtype):
    d = q.shape[-1]
    if (dtype or q.dtype) not in TRITON_DTYPES:
        raise ValueError(f"window_attention: the Triton backend computes in {TRITON_DTYPES}, "
                         f"got {dtype or q.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"window_attention: the Triton backend needs head_dim a power of two "
                         f">= 16, got {d}")
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
    offsets = offsets.to(torch.int32).contiguous()
    start = torch.empty(n, dtype=torch.int32, device=offsets.device)
    end = torch.empty_like(start)
    if n:
        windows = len(offsets) - 1
        block = 1024
        _row_windows_kernel[(triton.cdiv(n, block),)](
            offsets, start, end, n, windows, max(1, windows.bit_length()), BLOCK=block)
    return start, end


class WindowAttention(torch.autograd.Function):
    """The Triton kernels; inputs already in the compute dtype and contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, tq, tk, tv, start, end, coords, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        launch = Launch(q, tq, start, end, coords, scale)
        launch.run(_forward_kernel, q, k, v, out, lse, tq, tk, tv)
        ctx.save_for_backward(q, k, v, tq, tk, tv, start, end, coords, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, tq, tk, tv, start, end, coords, out, lse = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype).contiguous()
        delta = torch.empty_like(lse)  # written by the query kernel, read by the key kernel
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rel = tq is not None
        dtq, dtk, dtv = ((torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                          for t in (tq, tk, tv)) if rel else (None, None, None))
        launch = Launch(q, tq, start, end, coords, ctx.scale)
        launch.run(_backward_query_kernel, q, k, v, out, grad_out, lse, delta, dq,
                   tq, tk, tv, dtq, dtv)
        launch.run(_backward_key_kernel, q, k, v, grad_out, lse, delta, dk, dv,
                   tq, tk, tv, dtk)
        table_grads = (dtq.to(q.dtype), dtk.to(q.dtype), dtv.to(q.dtype)) if rel else (None,) * 3
        return dq, dk, dv, *table_grads, None, None, None, None


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int


def tile_config(kernel, rel):
    """The Tiles of a kernel: the fastest of those tried on an H100 at N = 268,720, h = 1 and 4,
    d = 16, G = 24, fp16 (scripts/tune_window_attention.py; BENCHMARKS.md); bf16 and fp32 use the
    same (fp32 without relative position measured the same order). Relative position holds
    per-axis fp32 blocks per row in registers, so it runs best on small tiles."""
    if rel:
        return Tiles(16, 32, 4) if kernel is _backward_key_kernel else Tiles(32, 16, 4)
    return Tiles(64, 64, 4) if kernel is _backward_key_kernel else Tiles(64, 32, 4)


def padded_widths(g):
    """GP and LP: G and L = 2G-1 padded to powers of two (at least 8: the compiler cannot lay out
    register gathers along narrower rows of our tiles), the widths of the kernels'
    per-axis blocks by coordinate and by relative index."""
    return {"GP": max(8, triton.next_power_of_2(g)), "LP": max(8, triton.next_power_of_2(2 * g - 1))}


class Launch:
    """The arguments and tile sizes every attention kernel of this file shares."""

    def __init__(self, q, tq, start, end, coords, scale):
        self.n, self.heads, self.head_dim = q.shape
        self.rel = tq is not None
        self.g = (tq.shape[0] + 1) // 2 if self.rel else 1
        self.shared = (start, end, coords)
        self.scale = scale
        # How dots of compute-dtype operands run (tf32 is ignored by fp16/bf16 operands).
        self.precision = {torch.float32: "tf32x3", torch.float16: "tf32",
                          torch.bfloat16: "tf32" if q.is_cuda else "upcast"}[q.dtype]

    def run(self, kernel, *tensors):
        """Launch `kernel` over its tiles (of queries, or of keys) and the heads."""
        if self.n == 0:
            return
        tiles = tile_config(kernel, self.rel)
        tile = tiles.block_n if kernel is _backward_key_kernel else tiles.block_m
        grid = (triton.cdiv(self.n, tile), self.heads)
        kernel[grid](*tensors, *self.shared, self.n, self.heads, self.g, self.scale,
                     D=self.head_dim, REL=self.rel, **padded_widths(self.g),
                     PRECISION=self.precision, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                     num_warps=tiles.num_warps)


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
    """The rows' coordinates on the three axes: a tuple of three int vectors."""
    return (tl.load(coords + rows * 3, mask=ok, other=0),
            tl.load(coords + rows * 3 + 1, mask=ok, other=0),
            tl.load(coords + rows * 3 + 2, mask=ok, other=0))


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
def _table_offsets(head, H, D: tl.constexpr, G, LP: tl.constexpr):
    """Offsets of the (4*LP, D) block of a table (L, 3, H, D) whose row a*LP + r is T[r, a]."""
    row = tl.arange(0, 4 * LP)[:, None]
    axis, r = row // LP, row % LP
    return _table_entry(r, axis, head, H, D), (axis < 3) & (r < 2 * G - 1)


@triton.jit
def _load_table(table, head, H, D: tl.constexpr, G, LP: tl.constexpr):
    offs, ok = _table_offsets(head, H, D, G, LP)
    return tl.load(table + offs, mask=ok, other=0.0)


@triton.jit
def _add_to_table(grad, head, H, D: tl.constexpr, G, LP: tl.constexpr, block):
    """One fp32 atomic add per element of a tile's (4*LP, D) table-gradient block."""
    offs, ok = _table_offsets(head, H, D, G, LP)
    tl.atomic_add(grad + offs, block, mask=ok)


@triton.jit
def _axis_columns(c, WIDTH: tl.constexpr):
    """For a (rows, 4*WIDTH) block with column a*WIDTH + t for axis a: each column's axis,
    its t, and each row's own coordinate on that column's axis."""
    col = tl.arange(0, 4 * WIDTH)[None, :]
    axis = col // WIDTH
    own = tl.where(axis == 0, c[0][:, None], tl.where(axis == 1, c[1][:, None], c[2][:, None]))
    return axis, col % WIDTH, own


@triton.jit
def _one_hot(c, GP: tl.constexpr, dtype: tl.constexpr):
    """(rows, 4*GP): 1 at column a*GP + c_a of each row's coordinates."""
    axis, t, own = _axis_columns(c, GP)
    return tl.where((axis < 3) & (own == t), 1.0, 0.0).to(dtype)


@triton.jit
def _axis_table(table, axis: tl.constexpr, head, H, D: tl.constexpr, G, LP: tl.constexpr):
    """T[:, axis] of a table (L, 3, H, D) for one head: (LP, D), zero past L = 2G-1."""
    r = tl.arange(0, LP)[:, None]
    return tl.load(table + _table_entry(r, axis, head, H, D), mask=r < 2 * G - 1, other=0.0)


@triton.jit
def _axis_tables(table, head, H, D: tl.constexpr, G, LP: tl.constexpr):
    """The three (LP, D) axis blocks of a table for one head."""
    return (_axis_table(table, 0, head, H, D, G, LP), _axis_table(table, 1, head, H, D, G, LP),
            _axis_table(table, 2, head, H, D, G, LP))


@triton.jit
def _by_partner_axis(x, table, own, IS_QUERY: tl.constexpr, G, GP: tl.constexpr,
                     PRECISION: tl.constexpr):
    """(rows, GP) fp32: column p holds <x_row, T[r, a]> (table: the (LP, D) block of axis a) for
    the relative index r of the row (coordinate `own`) and a partner at coordinate p:
    r = own - p + G-1 for a query row, p - own + G-1 for a key row; zero for p >= G."""
    x_by_r = _dot(x, tl.trans(table), PRECISION)  # (rows, LP), column r
    p = tl.arange(0, GP)[None, :]
    r = own[:, None] - p + G - 1 if IS_QUERY else p - own[:, None] + G - 1
    ok = p < G
    return tl.where(ok, tl.gather(x_by_r, tl.where(ok, r, 0), 1), 0.0)


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
def _pick(x_by_p, partner):
    """(rows, partners): sum over the axes of _pick_axis, e.g. <qs_i, sum_a tq[r_a, a]>."""
    return (_pick_axis(x_by_p[0], partner[0]) + _pick_axis(x_by_p[1], partner[1])
            + _pick_axis(x_by_p[2], partner[2]))


@triton.jit
def _relative_logits(q_by_p, k_by_p, qc, kc):
    """(queries, keys): <qs_i, sum_a tq[r_a, a]> + <k_j, sum_a tk[r_a, a]>."""
    return _pick(q_by_p, kc) + tl.trans(_pick(k_by_p, qc))


@triton.jit
def _by_relative(x, c, IS_QUERY: tl.constexpr, G, GP: tl.constexpr, LP: tl.constexpr):
    """(rows, 4*GP) indexed by the partner's coordinate p -> (rows, 4*LP) indexed by r, the
    relative index of the row (own coordinate x) and that partner: a query row has
    r = x - p + G-1, so p = x + G-1 - r; a key row has r = p - x + G-1, so p = r + x - (G-1)."""
    axis, r, own = _axis_columns(c, LP)
    partner = own - r + G - 1 if IS_QUERY else r + own - (G - 1)
    ok = (axis < 3) & (r < 2 * G - 1) & (partner >= 0) & (partner < G)
    return tl.where(ok, tl.gather(x, tl.where(ok, axis * GP + partner, 0), 1), 0.0)


@triton.jit
def _forward_kernel(q, k, v, out, lse, tq, tk, tv, start, end, coords, N, H, G, scale,
                    D: tl.constexpr, REL: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_M sorted query rows, one head: online softmax over the tile's key span."""
    dtype = q.dtype.element_ty
    head = tl.program_id(1)
    rows, row_ok, row_window, lo, hi = _tile(start, end, tl.program_id(0) * BLOCK_M, N, BLOCK_M, -1)
    qs = _load_scaled(q, rows, row_ok, head, H, D, scale)
    if REL:
        qc = _load_coords(coords, rows, row_ok)
        q_by_p = _by_partner(qs, _axis_tables(tq, head, H, D, G, LP), qc, True, G, GP, PRECISION)
        tk_axes = _axis_tables(tk, head, H, D, G, LP)
        v_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)  # sum_j p_ij [c_j = c], by column c
    m = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: masked rows never give inf - inf
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        cols, col_ok, col_window, kb, vb = _key_block(k, v, start, first, hi, head, H, D, BLOCK_N)
        s = _dot(qs, tl.trans(kb), PRECISION)
        if REL:
            kc = _load_coords(coords, cols, col_ok)
            k_hot = _one_hot(kc, GP, dtype)
            s += _relative_logits(q_by_p, _by_partner(kb, tk_axes, kc, False, G, GP, PRECISION), qc, kc)
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        p_rounded = p.to(dtype)
        acc = acc * alpha[:, None] + _dot(p_rounded, vb, PRECISION)
        if REL:
            v_rel = v_rel * alpha[:, None] + _dot(p_rounded, k_hot, PRECISION)
        m = m_new
    if REL:
        v_by_r = _by_relative(v_rel, qc, True, G, GP, LP)
        acc += _split_dot(v_by_r, _load_table(tv, head, H, D, G, LP), PRECISION)
    l = tl.where(l > 0, l, 1.0)  # only padding rows have no key
    _store_rows(out, rows, row_ok, head, H, D, acc / l[:, None])
    tl.store(lse + rows * H + head, m + tl.log(l), mask=row_ok)


@triton.jit
def _backward_query_kernel(q, k, v, o, do, lse, delta, dq, tq, tk, tv, dtq, dtv,
                           start, end, coords, N, H, G, scale,
                           D: tl.constexpr, REL: tl.constexpr, GP: tl.constexpr,
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
        q_by_p = _by_partner(qs, _axis_tables(tq, head, H, D, G, LP), qc, True, G, GP, PRECISION)
        do_by_p = _by_partner(dob, _axis_tables(tv, head, H, D, G, LP), qc, True, G, GP, PRECISION)
        tk_axes = _axis_tables(tk, head, H, D, G, LP)
        ds_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)
        p_rel = tl.zeros([BLOCK_M, 4 * GP], tl.float32)
    dqs = tl.zeros([BLOCK_M, D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        cols, col_ok, col_window, kb, vb = _key_block(k, v, start, first, hi, head, H, D, BLOCK_N)
        s = _dot(qs, tl.trans(kb), PRECISION)
        dp = _dot(dob, tl.trans(vb), PRECISION)
        if REL:
            kc = _load_coords(coords, cols, col_ok)
            k_hot = _one_hot(kc, GP, dtype)
            s += _relative_logits(q_by_p, _by_partner(kb, tk_axes, kc, False, G, GP, PRECISION), qc, kc)
            dp += _pick(do_by_p, kc)
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        p = tl.exp(s - row_lse[:, None])
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dqs += _dot(ds, kb, PRECISION)
        if REL:
            ds_rel += _dot(ds, k_hot, PRECISION)
            p_rel += _dot(p.to(dtype), k_hot, PRECISION)
    if REL:
        ds_by_r = _by_relative(ds_rel, qc, True, G, GP, LP)
        dqs += _split_dot(ds_by_r, _load_table(tq, head, H, D, G, LP), PRECISION)
        _add_to_table(dtq, head, H, D, G, LP, _split_dot(tl.trans(ds_by_r), qs, PRECISION))
        p_by_r = _by_relative(p_rel, qc, True, G, GP, LP)
        _add_to_table(dtv, head, H, D, G, LP, _split_dot(tl.trans(p_by_r), dob, PRECISION))
    _store_rows(dq, rows, row_ok, head, H, D, dqs * scale)


@triton.jit
def _backward_key_kernel(q, k, v, do, lse, delta, dk, dv, tq, tk, tv, dtk,
                         start, end, coords, N, H, G, scale,
                         D: tl.constexpr, REL: tl.constexpr, GP: tl.constexpr,
                         LP: tl.constexpr, PRECISION: tl.constexpr,
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
        k_by_p = _by_partner(kb, _axis_tables(tk, head, H, D, G, LP), kc, False, G, GP, PRECISION)
        tq_axes = _axis_tables(tq, head, H, D, G, LP)
        tv_axes = _axis_tables(tv, head, H, D, G, LP)
        ds_rel = tl.zeros([BLOCK_N, 4 * GP], tl.float32)
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
            s += _relative_logits(_by_partner(qs, tq_axes, qc, True, G, GP, PRECISION), k_by_p, qc, kc)
            dp += _pick(_by_partner(dob, tv_axes, qc, True, G, GP, PRECISION), kc)
        s = tl.where(row_window[:, None] == col_window[None, :], s, float("-inf"))
        p = tl.exp(s - row_lse[:, None])
        ds_t = tl.trans((p * (dp - row_delta[:, None])).to(dtype))
        dvb += _dot(tl.trans(p.to(dtype)), dob, PRECISION)
        dkb += _dot(ds_t, qs, PRECISION)
        if REL:
            ds_rel += _dot(ds_t, q_hot, PRECISION)
    if REL:
        ds_by_r = _by_relative(ds_rel, kc, False, G, GP, LP)
        dkb += _split_dot(ds_by_r, _load_table(tk, head, H, D, G, LP), PRECISION)
        _add_to_table(dtk, head, H, D, G, LP, _split_dot(tl.trans(ds_by_r), kb, PRECISION))
    _store_rows(dk, cols, col_ok, head, H, D, dkb)
    _store_rows(dv, cols, col_ok, head, H, D, dvb)
