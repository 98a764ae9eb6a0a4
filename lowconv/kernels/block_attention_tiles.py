"""The building blocks of the block-attention kernels (block_attention_triton.py): rows of a
head's matrix, the partner tiles of a tile (the band's span, or a BlockLayout's listed tiles),
the scores' masks, and the row statistics the backward reads (stats: row max and 1 / row sum,
a (2, batch x heads, seq_q) buffer)."""
import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, base, rows, n, D: tl.constexpr):
    """Rows `rows` (zeros at n and past) of the (seq, D) matrix of one head at ptr + base."""
    offs = base + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=(rows < n)[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, base, rows, n, D: tl.constexpr, block):
    offs = base + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, block.to(ptr.dtype.element_ty), mask=(rows < n)[:, None])


@triton.jit
def _span(first, last, n, lo_offset, hi_offset, BLOCK: tl.constexpr):
    """The partners p of rows first..last with lo_offset <= p - row <= hi_offset, below n: the
    first (rounded down to a whole BLOCK, for aligned loads) and the number of BLOCKs."""
    lo = tl.maximum(first + lo_offset, 0) // BLOCK * BLOCK
    hi = tl.minimum(last + hi_offset + 1, n)
    return lo, tl.maximum(tl.cdiv(hi - lo, BLOCK), 0)


@triton.jit
def _partner_tiles(tile, first, last, n, lo_offset, hi_offset, count, list_row,
                   LISTED: tl.constexpr, BLOCK: tl.constexpr):
    """Where the partner tiles of a tile start and how many there are: the band's span, or
    with LISTED the live tiles of its BlockLayout row (list_row: the row's offset in count)."""
    lo, n_tiles = _span(first, last, n, lo_offset, hi_offset, BLOCK)
    if LISTED:
        n_tiles = tl.load(count + list_row + tile)
    return lo, n_tiles


@triton.jit
def _partner_start(i, lo, index, list_row, tile, TILES_PER_ROW, LISTED: tl.constexpr,
                   BLOCK: tl.constexpr):
    """The first partner of the i-th partner tile."""
    if LISTED:
        return tl.load(index + (list_row + tile) * TILES_PER_ROW + i) * BLOCK
    return lo + i * BLOCK


@triton.jit
def _masked_scores(s, rows, cols, b, h, Lq, Lk, lower, upper, mask, padding,
                   mask_sb, mask_sh, mask_sq, mask_sk,
                   BANDED: tl.constexpr, MASK: tl.constexpr, PADDING: tl.constexpr):
    """Scores s (rows, cols) with the model's additive mask added and -inf where a key is not
    allowed: past the ends, outside the band, padding, or False in a bool mask."""
    allowed = (rows[:, None] < Lq) & (cols[None, :] < Lk)
    if BANDED:
        offset = rows[:, None] - cols[None, :]
        allowed = allowed & (offset >= lower) & (offset <= upper)
    if PADDING:
        is_padding = tl.load(padding + b.to(tl.int64) * Lk + cols, mask=cols < Lk, other=1)
        allowed = allowed & (is_padding == 0)[None, :]
    if MASK != "none":
        offs = (b.to(tl.int64) * mask_sb + h.to(tl.int64) * mask_sh
                + rows.to(tl.int64)[:, None] * mask_sq + cols.to(tl.int64)[None, :] * mask_sk)
        if MASK == "bool":
            allowed = allowed & (tl.load(mask + offs, mask=allowed, other=0) != 0)
        else:
            s += tl.load(mask + offs, mask=allowed, other=0.0).to(tl.float32)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _stat_rows(stat, bh, rows, Lq, BH):
    """Where the rows' statistic `stat` (0 max, 1 1 / sum) lies in stats, a (STATS, BH, Lq)
    buffer."""
    return (stat * BH + bh).to(tl.int64) * Lq + rows


@triton.jit
def _row_softmax(stats, bh, rows, Lq, BH):
    """The rows' softmax max and 1 / sum (0 past Lq: no probability there)."""
    ok = rows < Lq
    return (tl.load(stats + _stat_rows(0, bh, rows, Lq, BH), mask=ok, other=0.0),
            tl.load(stats + _stat_rows(1, bh, rows, Lq, BH), mask=ok, other=0.0))


@triton.jit
def _row_stats(stats, delta, bh, rows, Lq, BH):
    """The rows' softmax max, 1 / sum and delta (0 past Lq; delta is (BH, Lq))."""
    m, inv_l = _row_softmax(stats, bh, rows, Lq, BH)
    return m, inv_l, tl.load(delta + bh.to(tl.int64) * Lq + rows, mask=rows < Lq, other=0.0)
