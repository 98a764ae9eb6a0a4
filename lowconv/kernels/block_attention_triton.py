"""The Triton kernels of block attention (forward, backward of the queries, backward of the keys)
and their custom ops, torch.ops.lowconv.block_attention_forward and _backward. Their numerics,
layouts and entry point are in block_attention.py; this file holds the tiles they run on, the
launch they share and the kernels themselves, built of block_attention_tiles.py's functions.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowconv.kernels.block_attention_tiles import (_load_rows, _masked_scores, _partner_start, _partner_tiles,
                                                   _row_softmax, _row_stats, _stat_rows, _store_rows)
from lowconv.kernels.operands import as_operand
from lowconv.kernels.triton_dot import _dot, dot_precision
from lowconv.kernels.triton_ops import triton_op, wrap


class Tiles(NamedTuple):
    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int = 3  # software-pipelining depth (Triton's default)


# The tiles of a BlockLayout (a mask or key padding): one shape for the forward and both
# backward kernels, so that they share it. FlashAttention-2's usual 64 x 64 with 4 warps.
TILES = Tiles(64, 64, 4)

# Launches without a BlockLayout (a band alone: dense, causal, local) may run each kernel on its
# own tiles, by head_dim, for fp16 and bf16. Measured on the H100 (scripts/tune_block_attention.py,
# 8 x 16 x 4096, causal and local W = 256): 64 x 64 with 4 warps was the fastest or within noise
# for every kernel, 128-query tiles 10-100% slower; at head_dim 128 the backward kernels gain
# about 11% from 2 pipeline stages instead of 3.
BAND_TILES = {
    "_forward_kernel": {d: TILES for d in (16, 32, 64, 128)},
    "_backward_query_kernel": {16: TILES, 32: TILES, 64: TILES, 128: TILES._replace(num_stages=2)},
    "_backward_key_kernel": {16: TILES, 32: TILES, 64: TILES, 128: TILES._replace(num_stages=2)},
}


def pipeline_stages(dtype):
    """Software-pipelining depth on TILES: Triton's default 3, but 1 for fp32, whose tiles take
    twice the bytes (at head_dim 128, 2 stages of the backward key kernel need 289 KB of shared
    memory, beyond the H100's 227 KB; 1 stage needs 224 KB)."""
    return 1 if dtype == torch.float32 else 3


def kernel_tiles(kernel_name, head_dim, dtype, listed):
    """The tiles `kernel_name` runs on: TILES with a BlockLayout (listed) and for fp32, else
    its BAND_TILES."""
    if listed or dtype == torch.float32:
        return TILES._replace(num_stages=pipeline_stages(dtype))
    return BAND_TILES[kernel_name][head_dim]


def kernel_mask(mask, batch, heads, seq_q, seq_k):
    """The model's mask as the kernels read it: a (batch, heads, seq_q, seq_k) view (broadcast
    dimensions have stride 0), and its kind, "none", "bool" or "additive"."""
    if mask is None:
        return None, "none"
    while mask.dim() < 4:
        mask = mask[None]
    view = mask.expand(batch, heads, seq_q, seq_k)
    if mask.dtype == torch.bool:
        return view, "bool"
    return view, "additive"


class Launch:
    """The arguments and tile sizes every kernel of this family shares (the ops' arguments, see
    block_attention_forward)."""

    def __init__(self, q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale):
        self.batch, self.heads, self.seq_q, self.head_dim = q.shape
        self.kv_heads, self.seq_k = k.shape[1], k.shape[2]
        self.runs_nothing = 0 in (self.batch, self.heads, self.seq_q, self.seq_k)
        self.listed, self.dtype = count is not None, q.dtype
        mask, kind = kernel_mask(mask, self.batch, self.heads, self.seq_q, self.seq_k)
        # The arguments after the tensors and each kernel's lists (query tiles' lists, then key
        # tiles'), built once for the three launches.
        self.args = (self.heads, self.heads // self.kv_heads, self.seq_q, self.seq_k, lower, upper,
                     scale, *(mask.stride() if mask is not None else (0, 0, 0, 0)))
        self.lists = ((None, None, 0, 0),) * 2 if count is None else (
            tile_lists(count, index), tile_lists(count_t, index_t))
        self.options = dict(D=self.head_dim, BANDED=banded, MASK=kind, PADDING=padding is not None,
                            LISTED=self.listed, PRECISION=dot_precision(q.dtype, q.is_cuda))
        self.masks = (mask, padding)

    def new_like(self, t: torch.Tensor) -> torch.Tensor:
        """An output the kernels fill; zeros where they run no program (no query or no key: the
        output and every gradient are 0, as SDPA's)."""
        return torch.zeros_like(t) if self.runs_nothing else torch.empty_like(t)

    def run(self, kernel, *tensors, transposed, launcher=None):
        """Launch `kernel` over its tiles (of queries, or with `transposed` of keys) and the batch
        and its heads (kv heads when transposed: a program sums over its group). The ops launch
        through `launcher`, triton_ops.wrap(kernel), which torch.compile can trace; else directly."""
        if self.runs_nothing:
            return
        tiles = kernel_tiles(kernel.__name__, self.head_dim, self.dtype, self.listed)
        launcher = launcher or kernel
        if transposed:
            grid = (triton.cdiv(self.seq_k, tiles.block_n), self.batch * self.kv_heads)
        else:
            grid = (triton.cdiv(self.seq_q, tiles.block_m), self.batch * self.heads)
        count, index, list_sb, list_sh = self.lists[transposed]
        launcher[grid](*tensors, *self.masks, count, index, *self.args, list_sb, list_sh, **self.options,
                       BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                       num_stages=tiles.num_stages)


def tile_lists(count, index):
    """A BlockLayout's (count, index) for one direction and count's (batch, head) strides, 0
    where it broadcasts."""
    strides = (0 if size == 1 else stride for size, stride in zip(count.shape[:2], count.stride()[:2]))
    return (count, index, *strides)


# The row statistics' buffer (stats): row_max and row_inv_sum, each (batch, heads, seq_q).
STATS = 2

# The band's bounds change with the window and the sequence: one compile for all of them (Triton
# would otherwise compile again for a bound that is 1 or a multiple of 16).
BAND_ARGS = ("lower", "upper")


@triton.jit
def _query_tile(H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D: tl.constexpr,
                LISTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query tile of one (batch, head): (tile, bh, b, h, q_base, kv_base (its kv
    head's), rows, list_row, and lo, n_tiles of the key tiles of the band i - upper <= j <= i - lower)."""
    # Last tiles first: under a causal band they have the most keys, and the short ones then
    # fill the machine at the end of the launch.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_base = bh.to(tl.int64) * Lq * D
    kv_base = (b * (H // GROUP) + h // GROUP).to(tl.int64) * Lk * D
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    list_row = b * list_sb + h * list_sh
    lo, n_tiles = _partner_tiles(tile, tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, Lk, -upper,
                                 -lower, count, list_row, LISTED, BLOCK_N)
    return tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles


@triton.jit
def _interior(first, last, lo, n_tiles, n, lo_offset, hi_offset, BANDED: tl.constexpr,
              MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """The partner tiles [start, end) (of the n_tiles from lo, see _span) that need no masking:
    each of their pairs in the band, each partner below n. The tiles before and after are the
    band's edges. With MASKED (a model mask or padding: masking everywhere) there are none."""
    if MASKED:
        return n_tiles, n_tiles
    end = tl.minimum(tl.maximum(n - lo, 0) // BLOCK, n_tiles)
    if BANDED:
        # partner - row >= lo_offset for the last row, <= hi_offset for the first.
        start = tl.cdiv(tl.maximum(last + lo_offset - lo, 0), BLOCK)
        end = tl.minimum(end, tl.maximum(first + hi_offset - lo + 1, 0) // BLOCK)
        return tl.minimum(start, end), end
    return 0, end


@triton.jit
def _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk, lower, upper,
                     scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk, D: tl.constexpr,
                     BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr,
                     LISTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                     EDGE: tl.constexpr):
    """The query tile's i-th key tile: its k and v rows and the scaled scores, masked on an EDGE
    tile (interior ones need none)."""
    first = _partner_start(i, lo, index, list_row, tile, tl.cdiv(Lk, BLOCK_N), LISTED, BLOCK_N)
    cols = first + tl.arange(0, BLOCK_N)
    kb = _load_rows(k, kv_base, cols, Lk, D)
    vb = _load_rows(v, kv_base, cols, Lk, D)
    s = _dot(qb, tl.trans(kb), PRECISION) * scale
    if EDGE:
        s = _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                           mask_sb, mask_sh, mask_sq, mask_sk, BANDED, MASK, PADDING)
    return kb, vb, s


@triton.jit
def _forward_tiles(start, end, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
                   Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                   D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                   PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr, EDGE: tl.constexpr):
    """The online softmax (m, l, acc) over key tiles start..end-1."""
    dtype = qb.dtype
    for i in range(start, end):
        kb, vb, s = _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk,
                                     lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                                     D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, EDGE)
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = m_new
        if EDGE:  # a row can still be all -inf here
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(dtype), vb, PRECISION)
        m = m_new
    return m, l, acc


@triton.jit(do_not_specialize=BAND_ARGS)
def _forward_kernel(q, k, v, out, stats, mask, padding, count, index,
                    H, GROUP, Lq, Lk, lower, upper, scale,
                    mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                    D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                    PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_M queries of one (batch, head): online softmax over its key tiles, the
    band's edge tiles masked, the interior ones not."""
    scale = tl.cast(scale, tl.float32)  # fp32 as launched directly; wrapped by inductor, a Python float arrives as fp64
    tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles = _query_tile(
        H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D, LISTED, BLOCK_M, BLOCK_N)
    start, end = _interior(tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, lo, n_tiles, Lk, -upper, -lower,
                           BANDED, MASK != "none" or PADDING, BLOCK_N)
    qb = _load_rows(q, q_base, rows, Lq, D)
    # m starts at -inf and exp() is taken against 0 while a row has seen nothing but -inf, so
    # a row whose keys are all masked so far keeps l = 0 (and a finite mask value still counts).
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m, l, acc = _forward_tiles(0, start, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    m, l, acc = _forward_tiles(start, end, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, False)
    m, l, acc = _forward_tiles(end, n_tiles, m, l, acc, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    # A row with no allowed key: output 0, and 1 / sum = 0 so that backward's P is 0 there.
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    _store_rows(out, q_base, rows, Lq, D, acc * inv_l[:, None])
    BH = tl.num_programs(1)
    tl.store(stats + _stat_rows(0, bh, rows, Lq, BH), tl.where(m == float("-inf"), 0.0, m), mask=rows < Lq)
    tl.store(stats + _stat_rows(1, bh, rows, Lq, BH), inv_l, mask=rows < Lq)


@triton.jit
def _dq_tiles(start, end, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile,
              rows, b, h, Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
              D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr,
              LISTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
              EDGE: tl.constexpr):
    """dq accumulated over key tiles start..end-1."""
    dtype = qb.dtype
    for i in range(start, end):
        kb, vb, s = _key_tile_scores(qb, k, v, kv_base, i, lo, index, list_row, tile, rows, b, h, Lq, Lk,
                                     lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
                                     D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, EDGE)
        p = tl.exp(s - m[:, None]) * inv_l[:, None]
        dp = _dot(dob, tl.trans(vb), PRECISION)
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dqb += _dot(ds, kb, PRECISION)
    return dqb


@triton.jit(do_not_specialize=BAND_ARGS)
def _backward_query_kernel(q, k, v, do, out, stats, delta, dq, mask, padding, count, index,
                           H, GROUP, Lq, Lk, lower, upper, scale,
                           mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                           D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                           PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq for one tile of BLOCK_M queries of one (batch, head), over the forward's key tiles; and
    the tile's delta (<dO_i, O_i>, fp32, into `delta`), which the key kernel reads."""
    scale = tl.cast(scale, tl.float32)
    tile, bh, b, h, q_base, kv_base, rows, list_row, lo, n_tiles = _query_tile(
        H, GROUP, Lq, Lk, lower, upper, count, list_sb, list_sh, D, LISTED, BLOCK_M, BLOCK_N)
    start, end = _interior(tile * BLOCK_M, tile * BLOCK_M + BLOCK_M - 1, lo, n_tiles, Lk, -upper, -lower,
                           BANDED, MASK != "none" or PADDING, BLOCK_N)
    qb = _load_rows(q, q_base, rows, Lq, D)
    dob = _load_rows(do, q_base, rows, Lq, D)
    BH = tl.num_programs(1)
    m, inv_l = _row_softmax(stats, bh, rows, Lq, BH)
    row_delta = tl.sum(dob.to(tl.float32) * _load_rows(out, q_base, rows, Lq, D).to(tl.float32), 1)
    tl.store(delta + bh.to(tl.int64) * Lq + rows, row_delta, mask=rows < Lq)
    dqb = tl.zeros([BLOCK_M, D], tl.float32)
    dqb = _dq_tiles(0, start, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    dqb = _dq_tiles(start, end, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, False)
    dqb = _dq_tiles(end, n_tiles, dqb, dob, m, inv_l, row_delta, qb, k, v, kv_base, lo, index, list_row, tile, rows, b, h,
        Lq, Lk, lower, upper, scale, mask, padding, mask_sb, mask_sh, mask_sq, mask_sk,
        D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_N, True)
    _store_rows(dq, q_base, rows, Lq, D, dqb * scale)


@triton.jit
def _dkdv_tiles(start, end, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH, q_base, bh, lo,
                index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
                mask_sb, mask_sh, mask_sq, mask_sk, D: tl.constexpr, BANDED: tl.constexpr,
                MASK: tl.constexpr, PADDING: tl.constexpr, LISTED: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr):
    """dk, dv of a key tile accumulated over one query head's query tiles start..end-1."""
    dtype = kb.dtype
    for i in range(start, end):
        first = _partner_start(i, lo, index, list_row, tile, tl.cdiv(Lq, BLOCK_M), LISTED, BLOCK_M)
        rows = first + tl.arange(0, BLOCK_M)
        qb = _load_rows(q, q_base, rows, Lq, D)
        dob = _load_rows(do, q_base, rows, Lq, D)
        m, inv_l, row_delta = _row_stats(stats, delta, bh, rows, Lq, BH)
        s = _dot(qb, tl.trans(kb), PRECISION) * scale
        if EDGE:
            s = _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                               mask_sb, mask_sh, mask_sq, mask_sk, BANDED, MASK, PADDING)
        p = tl.exp(s - m[:, None]) * inv_l[:, None]
        dvb += _dot(tl.trans(p.to(dtype)), dob, PRECISION)
        dp = _dot(dob, tl.trans(vb), PRECISION)
        ds = (p * (dp - row_delta[:, None])).to(dtype)
        dkb += _dot(tl.trans(ds), qb, PRECISION)
    return dkb, dvb


@triton.jit(do_not_specialize=BAND_ARGS)
def _backward_key_kernel(q, k, v, do, stats, delta, dk, dv, mask, padding, count, index,
                         H, GROUP, Lq, Lk, lower, upper, scale,
                         mask_sb, mask_sh, mask_sq, mask_sk, list_sb, list_sh,
                         D: tl.constexpr, BANDED: tl.constexpr, MASK: tl.constexpr,
                         PADDING: tl.constexpr, LISTED: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv for one tile of BLOCK_N keys of one (batch, kv head): the sum over the GROUP query
    heads it serves (in one program, so no atomics) of each head's live query tiles (`count`,
    `index`: the BlockLayout's transposed lists)."""
    scale = tl.cast(scale, tl.float32)
    tile = tl.program_id(0)
    bkv = tl.program_id(1)
    b = bkv // (H // GROUP)
    kv_base = bkv.to(tl.int64) * Lk * D
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = _load_rows(k, kv_base, cols, Lk, D)
    vb = _load_rows(v, kv_base, cols, Lk, D)
    dkb = tl.zeros([BLOCK_N, D], tl.float32)
    dvb = tl.zeros([BLOCK_N, D], tl.float32)
    BH = tl.num_programs(1) * GROUP  # the grid is over kv heads
    for g in range(GROUP):
        h = bkv % (H // GROUP) * GROUP + g
        bh = b * H + h
        q_base = bh.to(tl.int64) * Lq * D
        list_row = b * list_sb + h * list_sh
        # Queries i of the band: j + lower <= i <= j + upper.
        lo, n_tiles = _partner_tiles(tile, tile * BLOCK_N, tile * BLOCK_N + BLOCK_N - 1, Lq,
                                     lower, upper, count, list_row, LISTED, BLOCK_M)
        start, end = _interior(tile * BLOCK_N, tile * BLOCK_N + BLOCK_N - 1, lo, n_tiles, Lq, lower, upper,
                               BANDED, MASK != "none" or PADDING, BLOCK_M)
        dkb, dvb = _dkdv_tiles(0, start, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            True)
        dkb, dvb = _dkdv_tiles(start, end, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            False)
        dkb, dvb = _dkdv_tiles(end, n_tiles, dkb, dvb, kb, vb, cols, q, do, stats, delta, BH,
            q_base, bh, lo, index, list_row, tile, b, h, Lq, Lk, lower, upper, scale, mask, padding,
            mask_sb, mask_sh, mask_sq, mask_sk, D, BANDED, MASK, PADDING, LISTED, PRECISION, BLOCK_M,
            True)
    _store_rows(dk, kv_base, cols, Lk, D, dkb * scale)
    _store_rows(dv, kv_base, cols, Lk, D, dvb)


# ---------------------------------------------------------------------------------------------
# The kernels as custom ops (kernels/triton_ops.py): q, k, v in the compute dtype and contiguous; the
# model's mask as block_attention takes it (bool: True attends; float: added); the key padding
# contiguous bool (batch, seq_k), True = padding; a BlockLayout's four lists or four Nones; the
# band's bounds (lower, upper), whether it bounds anything (not dense), and the scale.


@triton_op("lowconv::block_attention_forward", mutates_args=())
def block_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            padding: torch.Tensor | None, count: torch.Tensor | None, index: torch.Tensor | None,
                            count_t: torch.Tensor | None, index_t: torch.Tensor | None, lower: int, upper: int,
                            banded: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: the output, and per query row (STATS, batch, heads, seq_q) the max its
    softmax's exp() was taken against and 1 / the sum, which the backward reads (one buffer:
    fewer allocations and kernel arguments). count_t, index_t are for the backward; autograd
    (register_autograd below) gives q, k, v their gradients."""
    launch = Launch(q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale)
    out = launch.new_like(q)
    stats = q.new_empty((STATS, *q.shape[:3]), dtype=torch.float32)
    launch.run(_forward_kernel, q, k, v, out, stats, transposed=False, launcher=wrap(_forward_kernel))
    return out, stats


@triton_op("lowconv::block_attention_backward", mutates_args=())
def block_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, stats: torch.Tensor, mask: torch.Tensor | None,
                             padding: torch.Tensor | None, count: torch.Tensor | None, index: torch.Tensor | None,
                             count_t: torch.Tensor | None, index_t: torch.Tensor | None, lower: int, upper: int,
                             banded: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the forward's inputs, output and stats and the output's gradient (in the
    compute dtype, contiguous)."""
    launch = Launch(q, k, mask, padding, count, index, count_t, index_t, lower, upper, banded, scale)
    dq, dk, dv = (launch.new_like(t) for t in (q, k, v))
    # delta_i = <dO_i, O_i>: the query kernel writes it (from the tiles it loads anyway), the key
    # kernel, launched after it, reads it.
    delta = q.new_empty(q.shape[:3], dtype=torch.float32)
    launch.run(_backward_query_kernel, q, k, v, grad_out, out, stats, delta, dq, transposed=False,
               launcher=wrap(_backward_query_kernel))
    launch.run(_backward_key_kernel, q, k, v, grad_out, stats, delta, dk, dv, transposed=True,
               launcher=wrap(_backward_key_kernel))
    return dq, dk, dv


def save_for_backward(ctx, inputs, output):
    q, k, v, *masks_and_lists, lower, upper, banded, scale = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *masks_and_lists)
    ctx.band = (lower, upper, banded, scale)
    ctx.mark_non_differentiable(stats)


def attention_backward(ctx, grad_out, _):
    q, k, v, out, stats, *masks_and_lists = ctx.saved_tensors
    grads = torch.ops.lowconv.block_attention_backward(as_operand(grad_out, q.dtype), q, k, v, out, stats,
                                                       *masks_and_lists, *ctx.band)
    return *grads, *(None,) * (len(masks_and_lists) + len(ctx.band))


block_attention_forward.register_autograd(attention_backward, setup_context=save_for_backward)
