"""The Triton kernels of kernels/window_attention.py (its doc states the math and the numerics),
as torch.library custom ops.

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
atomic per element. The kernels read the coordinates packed one int per point
(window_attention.pack_coords).

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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowconv.kernels.operands import as_operand
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
