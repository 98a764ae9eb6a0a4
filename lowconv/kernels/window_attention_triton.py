"""The Triton kernels of kernels/window_attention.py (its doc states the math and the numerics),
as torch.library custom ops: torch.ops.lowconv.window_attention_forward, _backward and
window_row_windows (at the end of the file), which torch.compile takes whole.

The relative-position terms (SpTr's contextual tables, a split axis) are Triton functions of
window_attention_rel_pos.py, whose doc says how they avoid anything of size sum(n_w^2).
(scripts/tune_window_attention.py measures the alternatives and what each of these choices gains.)
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowconv.kernels.operands import as_operand
from lowconv.kernels.triton_dot import _dot, dot_precision
from lowconv.kernels.window_attention_rel_pos import (_add_table_grad, _added, _by_partner, _by_relative,
                                                      _gather_relative, _halved_tables, _histogram, _joined, _one_hot,
                                                      _pair_term, _pick, _products_by_relative, _scaled_add,
                                                      _split_index, _times_table, _with_split)
from lowconv.kernels.triton_ops import triton_op, wrap


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
    """The arguments and tile sizes every attention kernel of this file shares. A split axis comes
    as its values and thresholds (float32, contiguous), axis and first bucket; values None: none."""

    def __init__(self, q, tq, start, end, coords, scale, values=None, thresholds=None, axis=-1, first=0):
        self.n, self.heads, self.head_dim = q.shape
        self.rel = tq is not None
        self.rows = tq.shape[0] if self.rel else 1  # L
        self.g = (self.rows + 1) // 2
        self.shared = (start, end, coords, values, thresholds)
        self.split = (-1, 0, 0) if values is None else (axis, len(thresholds), first)
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


@triton.jit
def _forward_kernel(q, k, v, out, lse, tq, tk, tv, start, end, coords, split_values, thresholds, N, H, G, L, T,
                    FIRST, scale, D: tl.constexpr, REL: tl.constexpr, SPLIT: tl.constexpr, TP: tl.constexpr,
                    CHUNKS: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_M sorted query rows, one head: online softmax over the tile's key span.
    SPLIT >= 0: that axis's relative index is the split's, per pair."""
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
    Launch(q, tq, start, end, coords, scale, split_values, thresholds, split_axis, split_first).run(
        _forward_kernel, q, k, v, out, lse, tq, tk, tv, launcher=wrap(_forward_kernel))
    return out, lse


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
    launch = Launch(q, tq, start, end, coords, scale, split_values, thresholds, split_axis, split_first)
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
