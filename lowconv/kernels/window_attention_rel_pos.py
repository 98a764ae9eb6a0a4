"""The relative-position terms of the window-attention kernels (window_attention_triton.py): SpTr's
contextual tables on the three axes of each point's coordinates in its window, and a split axis.

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
"""
import triton
import triton.language as tl

from lowconv.kernels.triton_dot import _dot


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
