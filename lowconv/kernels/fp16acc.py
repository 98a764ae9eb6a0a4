"""fp16 GEMM with fp16 accumulation, split along K: a torch reference that emulates the kernel.

The kernel (Triton, BLOCK_K = 16) splits K into S contiguous chunks. Within a chunk each k-block
is one MMA: fp16 x fp16 products are exact in fp32 and summed in fp32, and the block's sum is
added into an fp16 accumulator (one rounding to fp16 per block). The S chunk results are then
combined in fp32 or fp16, the bias added in fp32, and the output rounded to fp16.
"""
import math

import torch
import torch.nn.functional as F

BLOCK_K = 16
MAX_BLOCKS_PER_SPLIT = 32


def auto_splits(K: int) -> int:
    """S = ceil(K / 512): each fp16 accumulator takes at most 32 block-adds.

    An fp16 running sum loses ~2^-11 of its magnitude at every add, so its error grows with the
    chain's length; 32 adds keep it within a few times fp16's own rounding, and S fp32-combined
    partial sums cost S-1 extra adds only. K <= 512 needs no split at all.
    """
    return max(1, math.ceil(K / (BLOCK_K * MAX_BLOCKS_PER_SPLIT)))


def fp16acc_matmul_reference(x, w, bias, splits: int, combine: str) -> torch.Tensor:
    """y = x w^T + b as the split-K fp16-accumulating kernel computes it (see the module doc).

    Vectorized over M, N and the splits; the loop runs over the k-blocks of one split.
    """
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    blocks_per_split = math.ceil(math.ceil(K / BLOCK_K) / splits)
    splits = math.ceil(math.ceil(K / BLOCK_K) / blocks_per_split)  # drop empty chunks
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


def fp16acc_matmul(x, w, bias, splits: int, combine: str = "fp32") -> torch.Tensor:
    """The entry point: checks its inputs and runs the reference (on every device for now; the
    Triton kernel plugs in here). x (..., K) fp16, w (N, K) fp16, bias (N,) fp16 or None."""
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
    return fp16acc_matmul_reference(x, w, bias, splits, combine)
