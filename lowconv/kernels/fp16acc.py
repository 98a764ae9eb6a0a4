"""fp16 GEMM with fp16 accumulation, split along K: a Triton kernel and a torch reference that
emulates it.

K is split into S contiguous chunks of whole 16-wide k-blocks. Within a chunk each k-block is
one MMA step (m16n8k16): fp16 x fp16 products are exact in fp32 and summed in fp32, and the
block's sum is added into an fp16 accumulator (one rounding to fp16 per block). The S chunk
results are then combined in fp32 or fp16, the bias added in fp32, and the output rounded to
fp16. The kernel (`_fp16acc_kernel`) runs the S chunks one after the other in each program, each
with its own fp16 accumulator, so nothing of size S x M x N is stored. (Triton's interpreter
rounds once per loaded k-tile of up to 64 instead: CPU runs of the kernel test its logic, the
reference its numbers.)
"""
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_K = 16
MAX_BLOCKS_PER_SPLIT = 32


def auto_splits(K: int) -> int:
    """S = ceil(K / 512): each fp16 accumulator takes at most 32 block-adds.

    An fp16 running sum loses ~2^-11 of its magnitude at every add, so its error grows with the
    chain's length; 32 adds keep it within a few times fp16's own rounding, and S fp32-combined
    partial sums cost S-1 extra adds only. K <= 512 needs no split at all.
    """
    return max(1, math.ceil(K / (BLOCK_K * MAX_BLOCKS_PER_SPLIT)))


def chunks(k: int, splits: int) -> tuple[int, int]:
    """(16-wide k-blocks per chunk, number of chunks) of K split S ways: whole blocks, as even as
    possible, no empty chunk (so fewer than S when K has fewer blocks than that)."""
    blocks = max(1, math.ceil(k / BLOCK_K))
    blocks_per_split = math.ceil(blocks / splits)
    return blocks_per_split, math.ceil(blocks / blocks_per_split)


def fp16acc_matmul_reference(x, w, bias, splits: int, combine: str) -> torch.Tensor:
    """y = x w^T + b as the split-K fp16-accumulating kernel computes it (see the module doc).

    Vectorized over M, N and the splits; the loop runs over the k-blocks of one split.
    """
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    blocks_per_split, splits = chunks(K, splits)
    pad = splits * blocks_per_split * BLOCK_K - K  # zero tail: adds exact zeros, changes no rounding
    xb = F.pad(x2, (0, pad)).float().reshape(-1, splits, blocks_per_split, BLOCK_K)
    wb = F.pad(w, (0, pad)).float().reshape(N, splits, blocks_per_split, BLOCK_K)
    acc = torch.zeros(splits, x2.shape[0], N, dtype=torch.float16, device=x.device)
    for j in range(blocks_per_split):
        block = torch.einsum("msk,nsk->smn", xb[:, :, j], wb[:, :, j])  # one MMA per split, fp32
        acc = (acc.float() + block).half()
    if combine == "fp32":
        y = acc.float().sum(0)
    else:
        y = acc[0]
        for s in range(1, splits):
            y = (y.float() + acc[s].float()).half()
        y = y.float()
    if bias is not None:
        y = y + bias.float()
    return y.half().reshape(*x.shape[:-1], N)


def fp16acc_matmul(x, w, bias, splits: int, combine: str = "fp32", backend: str = "auto") -> torch.Tensor:
    """The entry point: checks its inputs and runs the Triton kernel (backend "auto" on CUDA, or
    "triton", which on CPU tensors needs TRITON_INTERPRET=1) or the reference. Differentiable:
    the kernel's backward runs the same kernel for dX and dW, each GEMM split by auto_splits of its
    own reduced dim. x (..., K) fp16, w (N, K) fp16, bias (N,) fp16 or None."""
    if x.dtype != torch.float16 or w.dtype != torch.float16 or (bias is not None and bias.dtype != torch.float16):
        raise TypeError(f"fp16acc_matmul takes float16 tensors, got x {x.dtype}, w {w.dtype}"
                        + ("" if bias is None else f", bias {bias.dtype}"))
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp16acc_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not match (w is (N, K))")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"fp16acc_matmul: bias has shape {tuple(bias.shape)}, expected ({w.shape[0]},)")
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"fp16acc_matmul: splits must be an int >= 1, got {splits!r}")
    if combine not in ("fp32", "fp16"):
        raise ValueError(f"fp16acc_matmul: combine must be 'fp32' or 'fp16', got {combine!r}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"fp16acc_matmul: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("fp16acc_matmul: the Triton backend on CPU tensors needs TRITON_INTERPRET=1 "
                         "set before triton is imported")
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        return Fp16AccMatmul.apply(x, w, bias, splits, combine)
    return fp16acc_matmul_reference(x, w, bias, splits, combine)


class Fp16AccMatmul(torch.autograd.Function):
    """y = x w^T + b through the kernel; dX = dY w and dW = dY^T x through it too."""

    @staticmethod
    def forward(ctx, x, w, bias, splits, combine):
        ctx.save_for_backward(x, w)
        ctx.combine, ctx.has_bias = combine, bias is not None
        x2 = x.reshape(-1, x.shape[-1])
        return launch_fp16acc(x2, w, bias, splits, combine).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(torch.float16)
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:  # (M, K) = g (M, N) @ w (N, K): "w" is w^T, (K, N)
            grad_x = launch_fp16acc(g, w.t(), None, auto_splits(g.shape[1]), ctx.combine).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # (N, K) = g^T (N, M) @ x (M, K): "w" is x^T, (K, M)
            grad_w = launch_fp16acc(g.t(), x2.t(), None, auto_splits(g.shape[0]), ctx.combine)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.float().sum(0).half()
        return grad_x, grad_w, grad_bias, None, None


def launch_fp16acc(x, w, bias, splits: int, combine: str) -> torch.Tensor:
    """(M, N) fp16 = x (M, K) @ w (N, K)^T + bias, any strides, with the chunks of the reference."""
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    if m == 0 or n == 0:
        return out
    blocks_per_split, splits = chunks(k, splits)
    # The widest k-tile (up to 64) that a chunk holds a whole number of.
    tile_k = next(t for t in (64, 32, 16) if blocks_per_split * BLOCK_K % t == 0)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp16acc_kernel[grid](
        x, w, bias if bias is not None else x, out, m, n, k, *x.stride(), *w.stride(), *out.stride(),
        blocks_per_split * BLOCK_K // tile_k, splits, HAS_BIAS=bias is not None, COMBINE_FP32=combine == "fp32",
        BLOCK_M=block_m, BLOCK_N=64, TILE_K=tile_k, num_warps=4)
    return out


@triton.jit
def _fp16acc_kernel(x, w, bias, out, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                    TILES_PER_SPLIT, SPLITS, HAS_BIAS: tl.constexpr, COMBINE_FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile: the S chunks of K in turn, each summed in its own fp16
    accumulator, added into the total (fp32 or fp16), then the bias."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, TILE_K)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32 if COMBINE_FP32 else tl.float16)
    for split in range(SPLITS):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float16)
        for tile in range(TILES_PER_SPLIT):
            ks = (split * TILES_PER_SPLIT + tile) * TILE_K + rk
            a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            b = tl.load(w + rn[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                        mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, out_dtype=tl.float16)
        total = (total.to(tl.float32) + acc.to(tl.float32)).to(total.dtype)
    y = total.to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on, y.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))
