"""Packing the kept values of a tensor under a fixed 2:4 mask: rows (R, C) -> (R, C/2), and back.

A fixed-mask training layer keeps its weight as the kept values (the parameter), and cuSPARSELt's
layout of a 2:4 weight begins with them (lowconv.kernels.cusparselt.FixedMaskCompression), so
compression under a known mask is a copy, or from a dense tensor a gather (pack_kept), where
cuSPARSELt's own compression finds the kept positions from the values each time: two kernels, 57
us of GPU time for a 4096 x 1024 fp16 weight on the H100. dW's kept values are packed from the
dense dY^T x; a transposable mask's W^T is packed from W's kept values (transpose_kept), for dX's
2:4 GEMM; unpack_kept makes the dense tensor again.

The mask comes as one code per group of 4: the positions of its two kept values, first | second << 2
(first < second). pack_kept's source may be strided (W^T packed from W as it lies).

The kernels are torch.library ops (lowconv::pack_kept, lowconv::transpose_kept: triton_ops, in
place into their `out`); the torch references beside them are what a compiled graph fuses.
"""
import torch
import triton
import triton.language as tl

from lowconv.errors import LowconvError
from lowconv.kernels.triton_ops import cdiv, triton_op, wrap

# (rows, groups of 4, warps) per program, measured (BENCHMARKS.md): pack ~10-12 us at 4096 x 1024
# and 1024 x 4096 fp16 (W and W^T's view) on the H100; on the H200 (scripts/tune_pack24.py, bf16,
# 8192 x 2048 and 2048 x 8192) no tile of 26 beat these by more than 3.4%, for either kernel.
PACK_TILE = (64, 32, 4)
TRANSPOSE_TILE = (64, 32, 4)
WIDE_OFFSETS = 2 ** 31  # element offsets from here on need int64 (WIDE): the kernel goes over to it


def kept_codes(mask: torch.Tensor, name: str = "a 2:4 mask") -> torch.Tensor:
    """uint8 (R, C/4): each group's two kept positions, first | second << 2, from a bool (R, C) 2:4
    mask. LowconvError (naming the mask `name`) if a group keeps other than exactly 2."""
    rows, cols = mask.shape
    groups = mask.reshape(rows, cols // 4, 4)
    kept = groups.sum(-1)
    if (kept != 2).any():
        bad = (kept != 2).nonzero()[0].tolist()
        raise LowconvError(f"{name} ({rows}, {cols}) keeps {int(kept[bad[0], bad[1]])} values in the group of "
                           f"row {bad[0]}, columns {4 * bad[1]}..{4 * bad[1] + 3}; every group of 4 must keep 2")
    return mask_codes(mask)


def mask_codes(mask: torch.Tensor) -> torch.Tensor:
    """kept_codes of a mask known to be 2:4, unchecked: in torch ops that torch.compile takes whole
    (no host sync)."""
    groups = mask.reshape(mask.shape[0], -1, 4)
    index = torch.arange(4, dtype=torch.uint8, device=mask.device)
    # Python scalars, not CPU tensors, for the other branch: a CUDA graph capture refuses the copy.
    first = torch.where(groups, index, 4).amin(-1)
    second = torch.where(groups, index, 0).amax(-1)
    return first | second << 2


def pack_kept_reference(src: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch: src (R, C) -> its kept values (R, C/2), row-major."""
    rows, cols = src.shape
    codes = codes.long()
    positions = torch.stack((codes & 3, codes >> 2), dim=-1)
    return src.reshape(rows, cols // 4, 4).gather(-1, positions).reshape(rows, cols // 2)


def unpack_kept(kept: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """pack_kept's inverse, in torch: kept values (R, C/2) -> the dense (R, C), zeros where the
    codes' mask does not keep (one fused kernel under torch.compile)."""
    rows = kept.shape[0]
    codes = codes.unsqueeze(-1)  # (R, C/4, 1)
    first, second = codes & 3, codes >> 2
    pairs = kept.reshape(rows, -1, 2)
    at = torch.arange(4, dtype=codes.dtype, device=kept.device)
    zero = torch.zeros((), dtype=kept.dtype, device=kept.device)
    return torch.where(first == at, pairs[..., :1], torch.where(second == at, pairs[..., 1:], zero)).reshape(rows, -1)


def transpose_kept_reference(kept: torch.Tensor, codes: torch.Tensor, codes_t: torch.Tensor) -> torch.Tensor:
    """What transpose_kept computes, in torch: W's kept values (R, C/2) under its codes -> W^T's (C, R/2)
    under codes_t, W^T's codes (a transposable mask: 2:4 along both dims)."""
    return pack_kept_reference(unpack_kept(kept, codes).t(), codes_t)


@triton.jit
def _rows_and_groups(BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, WIDE: tl.constexpr):
    """This program's row and group indices, int64 when WIDE (offsets of 2^31 elements or more)."""
    row, group = tl.program_id(0), tl.program_id(1)
    r = (row.to(tl.int64) if WIDE else row) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = (group.to(tl.int64) if WIDE else group) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    return r, g


@triton.jit
def _pack_kept_kernel(src, codes, out, rows, groups, stride_row, stride_col,
                      BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, WIDE: tl.constexpr):
    r, g = _rows_and_groups(BLOCK_ROWS, BLOCK_GROUPS, WIDE)
    ok = (r[:, None] < rows) & (g[None, :] < groups)
    code = tl.load(codes + r[:, None] * groups + g[None, :], mask=ok, other=0).to(tl.int32)
    t = tl.arange(0, 4)
    columns = g[None, :, None] * 4 + t[None, None, :]
    w = tl.load(src + r[:, None, None] * stride_row + columns * stride_col, mask=ok[:, :, None], other=0)
    # The four values of each group apart (selecting by where keeps every bit, -0.0 and NaNs too).
    even, odd = tl.split(tl.reshape(w, (BLOCK_ROWS, BLOCK_GROUPS, 2, 2)))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    first, second = code & 3, code >> 2
    kept0 = tl.where(first == 0, w0, tl.where(first == 1, w1, w2))  # first < second, so first <= 2
    kept1 = tl.where(second == 3, w3, tl.where(second == 2, w2, w1))  # and second >= 1
    pair = tl.reshape(tl.join(kept0, kept1), (BLOCK_ROWS, 2 * BLOCK_GROUPS))
    o = tl.program_id(1) * 2 * BLOCK_GROUPS + tl.arange(0, 2 * BLOCK_GROUPS)
    tl.store(out + r[:, None] * (2 * groups) + o[None, :], pair, mask=(r[:, None] < rows) & (o[None, :] < 2 * groups))


def wide(*extents: int) -> bool:
    """Whether offsets up to the largest of `extents` (elements) need int64."""
    return max(extents) >= WIDE_OFFSETS


def pack_kept(src: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes src's kept values (R, C/2) into `out` (contiguous, src's dtype) and returns it; src
    (R, C) of any strides, codes from kept_codes."""
    pack_kept_into(src, codes, out)
    return out


@triton_op("lowconv::pack_kept", mutates_args={"out"})
def pack_kept_into(src: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    rows, cols = src.shape
    if codes.shape != (rows, cols // 4) or out.shape != (rows, cols // 2) or not out.is_contiguous() \
            or out.dtype != src.dtype or not codes.is_contiguous():
        raise LowconvError(f"pack_kept: src {tuple(src.shape)}, codes {tuple(codes.shape)} and out "
                           f"{tuple(out.shape)} {out.dtype} do not fit (codes (R, C/4) and out (R, C/2) contiguous)")
    block_rows, block_groups, warps = PACK_TILE
    grid = (cdiv(rows, block_rows), cdiv(cols // 4, block_groups))
    last = (rows - 1) * abs(src.stride(0)) + (cols - 1) * abs(src.stride(1))  # src's farthest element
    wrap(_pack_kept_kernel)[grid](src, codes, out, rows, cols // 4, src.stride(0), src.stride(1),
                                  BLOCK_ROWS=block_rows, BLOCK_GROUPS=block_groups, WIDE=wide(last, src.numel()),
                                  num_warps=warps)


@triton.jit
def _kept_at(kept, codes, n, column_group, position, groups, ok):
    """W's kept value (n, column) for W^T's kept (column, n): the first of W's group or the second."""
    code = tl.load(codes + n * groups + column_group, mask=ok, other=0).to(tl.int32)
    at = n * (2 * groups) + 2 * column_group + ((code & 3) != position).to(n.dtype)
    return tl.load(kept + at, mask=ok, other=0)


@triton.jit
def _transpose_kept_kernel(kept, codes, codes_t, out, rows_t, groups_t, BLOCK_ROWS: tl.constexpr,
                           BLOCK_GROUPS: tl.constexpr, WIDE: tl.constexpr):
    # Row r of W^T is column r of W; group g of W^T's row covers W's rows 4g..4g+3.
    r, g = _rows_and_groups(BLOCK_ROWS, BLOCK_GROUPS, WIDE)
    ok = (r[:, None] < rows_t) & (g[None, :] < groups_t)
    code_t = tl.load(codes_t + r[:, None] * groups_t + g[None, :], mask=ok, other=0).to(tl.int32)
    column_group, position = r[:, None] // 4, (r[:, None] % 4).to(tl.int32)
    groups = rows_t // 4  # W's groups of 4 per row
    first = _kept_at(kept, codes, g[None, :] * 4 + (code_t & 3), column_group, position, groups, ok)
    second = _kept_at(kept, codes, g[None, :] * 4 + (code_t >> 2), column_group, position, groups, ok)
    o = tl.program_id(1) * 2 * BLOCK_GROUPS + tl.arange(0, 2 * BLOCK_GROUPS)
    tl.store(out + r[:, None] * (2 * groups_t) + o[None, :],
             tl.reshape(tl.join(first, second), (BLOCK_ROWS, 2 * BLOCK_GROUPS)),
             mask=(r[:, None] < rows_t) & (o[None, :] < 2 * groups_t))


def transpose_kept(kept: torch.Tensor, codes: torch.Tensor, codes_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes W^T's kept values (C, R/2) into `out` and returns it, from W's (R, C/2) and the codes of
    W's mask (R, C/4) and of its transpose (C, R/4): a transposable mask's W^T packed without the
    dense W."""
    transpose_kept_into(kept, codes, codes_t, out)
    return out


@triton_op("lowconv::transpose_kept", mutates_args={"out"})
def transpose_kept_into(kept: torch.Tensor, codes: torch.Tensor, codes_t: torch.Tensor, out: torch.Tensor) -> None:
    rows, half = kept.shape
    cols = 2 * half
    if codes.shape != (rows, cols // 4) or codes_t.shape != (cols, rows // 4) or out.shape != (cols, rows // 2) \
            or out.dtype != kept.dtype or not all(t.is_contiguous() for t in (kept, codes, codes_t, out)):
        raise LowconvError(f"transpose_kept: kept {tuple(kept.shape)}, codes {tuple(codes.shape)}, codes_t "
                           f"{tuple(codes_t.shape)} and out {tuple(out.shape)} {out.dtype} do not fit (kept (R, C/2), "
                           f"codes (R, C/4), codes_t (C, R/4), out (C, R/2) of kept's dtype, all contiguous)")
    block_rows, block_groups, warps = TRANSPOSE_TILE
    grid = (cdiv(cols, block_rows), cdiv(rows // 4, block_groups))
    wrap(_transpose_kept_kernel)[grid](kept, codes, codes_t, out, cols, rows // 4, BLOCK_ROWS=block_rows,
                                       BLOCK_GROUPS=block_groups, WIDE=wide(kept.numel()), num_warps=warps)
