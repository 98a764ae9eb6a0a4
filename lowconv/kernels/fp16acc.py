"""fp16 GEMM with fp16 accumulation, split along K: a Triton kernel, a cuBLAS path, and a torch
reference that emulates them.

The numerics (what "splits = S, combine = c" means). K is split into S contiguous chunks of whole
16-wide k-blocks (`chunks`). Within a chunk each k-block is one tensor-core MMA step (k16): fp16 x
fp16 products are exact in fp32 and summed in fp32, and the block's sum is added into the chunk's
own fp16 accumulator (one rounding to fp16 per block). The S chunk results are then added up in
order in fp32 or in fp16 (combine), the bias added in fp32, and the output rounded to fp16.
`fp16acc_matmul_reference` computes exactly this. The hardware sums a k-block in its own way, so
the kernel matches the reference in error size, not necessarily bit for bit: on the H100 the two
errors vs float64 agree to three digits at every S (BENCHMARKS.md).

The Triton kernels, their two layouts (chunks in turn, chunks in parallel) and the Gluon kernel
for sm_90 are in fp16acc_triton.py, with their configs and autotuning.
The `cublas` path runs S cuBLAS matmuls, one per chunk, with torch's
`allow_fp16_accumulation` switched on for the call only, and combines them the same way.

Each backend's GEMM is a torch.library op with a fake implementation and a registered autograd
(`backward_through`), so that torch.compile(fullgraph=True) and CUDA graphs take it whole:
lowconv::fp16acc_triton (a triton_op: inductor sees its kernels; it calls lowconv::fp16acc_wgmma
for the Gluon kernel), lowconv::fp16acc_cublas and lowconv::fp16acc_reference (custom ops).
(Triton's interpreter rounds once per loaded k-tile of up to 256 instead of per k16 step: CPU runs
of the kernel test its logic, the reference its numbers.)
"""
import functools
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from lowconv.kernels.fp16acc_triton import BLOCK_K, SMALL_M, chunks, fp16_output, launch_fp16acc
from lowconv.scoped_setting import ScopedSetting

AUTO_MAX_SPLITS = 32
AUTO_MAX_SPLITS_SMALL_M = 64  # up to SMALL_M rows (decode): see auto_splits
AUTO_MIN_CHUNK_K = 64
ERROR_BAR = 0.25  # auto's aim: its error at most this of one fp16 chain's
# The variance of the output's fp16 rounding over that of one k16 block's rounding in the
# accumulator: (2.08e-4 / 2.04e-4)^2 on the H100 (cuBLAS fp32-acc's error; S = 1's fitted per block)
OUTPUT_ROUNDING = 1.04


@functools.lru_cache(maxsize=1024)  # pure and called per forward (0.7-2 us uncached); rows vary per call
def auto_splits(K: int, rows: int, combine: str = "fp32") -> int:
    """S for a GEMM of `rows` rows over K: min(32, ceil(K / 64)) chunks, up to 64 when rows <=
    SMALL_M (decode, small batches); with the fp32 combine, where that misses ERROR_BAR
    (`error_ratio`) and 32- or 16-wide chunks meet it, the wider of those instead.

    Why: an fp16 running sum loses ~2^-11 of its magnitude at every add, so on random data its
    error grows as the square root of the chain's length. cuBLAS's fp16 accumulation behaves as one
    chain over all of K: on the H100 its error vs float64 equals this kernel's with S = 1 to three
    digits (N(0, 1) data: 1.18e-3 at K = 1024, 1.67e-3 at 2048, 2.35e-3 at 4096, 3.32e-3 at 8192).
    32 chains of K/32 cut that part of the error to ~1/sqrt(32) = 0.18, so with the fp16 rounding
    of the output (2.1e-4, what fp32 accumulation also pays) the total lands at <= 1/4 of cuBLAS
    fp16 accumulation's from K = 2048 on (H100: 3.9e-4 at 2048, 4.9e-4 at 4096, 6.4e-4 at 8192);
    more chunks would buy little more than that floor and cost a fold of the accumulator each
    (S = 32 takes 9-17% more time than S = 1 at 4096^3 and 8192^3). Chunks narrower than 64 leave
    the kernel's 64-wide k-tiles partly empty and fold more often, so they are taken only where they
    buy the bar: from K ~ 1000 to ~2000 (K = 1024: 16-wide, 2.94e-4 against cuBLAS's 1.18e-3 on the
    H100, 0.248x, at about 4x cuBLAS fp32-acc's time, 1.3-1.6x with S = 16; K = 1536: 32-wide).
    Below K ~ 1000 no S meets the bar (error_ratio's floor), so the fast 64-wide chunks stay.
    For M = 1 cuBLAS picks a kernel with shorter chains (2.54e-3 at K = 14336, one chain: 4.28e-3),
    so there S = 32 (8.2e-4) is 0.32x of it; such GEMMs read W once and are bound by memory, where
    a fold per chunk costs little, so small M takes up to 64 chunks (K = 14336: 224 wide, 6.0e-4,
    0.24x cuBLAS's; H100 kernel time at M = 1, N = 4096 in a CUDA graph: 43.5 us at S = 1, 45.4 at
    32, 46.6 at 64, 58 at 128, cuBLAS 43.6).
    Combining in fp16 adds one fp16 rounding of the total per chunk (about 2x the error), so the
    fp16 combine never takes the narrower chunks: 16-wide ones gave 1.22e-3 at 1024^3 on the H100,
    worse than one chain, against 7.1e-4. BENCHMARKS.md has the measurements.
    """
    most = AUTO_MAX_SPLITS_SMALL_M if rows <= SMALL_M else AUTO_MAX_SPLITS
    splits = max(1, min(most, math.ceil(K / AUTO_MIN_CHUNK_K)))
    if combine != "fp32" or error_ratio(K, splits) <= ERROR_BAR:
        return splits
    for width in (32, 16):
        narrower = max(1, math.ceil(K / width))
        if error_ratio(K, narrower) <= ERROR_BAR:
            return narrower
    return splits


def error_ratio(K: int, splits: int) -> float:
    """The relative error vs float64 of `splits` chunks (fp32 combine) over that of one fp16 chain
    over K, for random data. Model: a chain of n k16 blocks rounds its running sum after each block,
    the j-th time at ~sqrt(j) times one block's magnitude, so its rounding variance is n(n + 1)/2
    units (one block's rounding); K/(16 n) such chains against an output of K/16 blocks give a
    relative variance of (n + 1)/2 units, plus the output's own rounding, c = OUTPUT_ROUNDING units.
    Over one chain's (n = N = K/16): sqrt((n + 1 + 2c) / (N + 1 + 2c)). Its floor, n = 1, reaches
    1/4 only from K ~ 1000 on. Against the CPU emulation (N(0, 1) data, K from
    512 to 4096, S from K/64 to K/16): within 3%, within 1.2% from K = 960 on."""
    blocks_per_chunk, _ = chunks(K, splits)
    blocks = max(1, math.ceil(K / BLOCK_K))
    floor = 1 + 2 * OUTPUT_ROUNDING
    return math.sqrt((blocks_per_chunk + floor) / (blocks + floor))


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
    return add_bias(combine_in_order(acc, combine), bias).reshape(*x.shape[:-1], N)


def combine_in_order(partials, combine: str) -> torch.Tensor:
    """The sum over dim 0 of fp16 partial sums in fp32, or one after the other in fp16 (fp32 out)."""
    if combine == "fp32":
        return partials.float().sum(0)
    total = partials[0]
    for partial in partials[1:]:
        total = (total.float() + partial.float()).half()
    return total.float()


def add_bias(total, bias) -> torch.Tensor:
    """fp32 total + bias in fp32, rounded to fp16 once."""
    return (total if bias is None else total + bias.float()).half()


def fp16acc_matmul(x, w, bias, splits: int, combine: str = "fp32", backend: str = "auto") -> torch.Tensor:
    """The entry point: checks its inputs and runs the Triton kernel (backend "auto" on CUDA, or
    "triton", which on CPU tensors needs TRITON_INTERPRET=1), cuBLAS per chunk ("cublas", CUDA
    only) or the reference. Differentiable: every backend's backward computes dX and dW the same
    way as its forward, each GEMM split by auto_splits of its own reduced dim and rows.
    x (..., K) fp16, w (N, K) fp16, bias (N,) fp16 or None."""
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
    if backend not in ("auto", "triton", "cublas", "reference"):
        raise ValueError(f"fp16acc_matmul: backend must be 'auto', 'triton', 'cublas' or 'reference', "
                         f"got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("fp16acc_matmul: the Triton backend on CPU tensors needs TRITON_INTERPRET=1 "
                         "set before triton is imported")
    if backend == "cublas" and not x.is_cuda:
        raise ValueError("fp16acc_matmul: the cublas backend needs CUDA tensors (the CPU runs the reference)")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "reference"
    return forward_gemm(x, w, bias, splits, combine, backend)


def forward_gemm(x, w, bias, splits: int, combine: str, backend: str) -> torch.Tensor:
    """y (..., N) = x (..., K) @ w^T + bias through `backend`'s GEMM (its op, differentiable)."""
    return GEMMS[backend](x.reshape(-1, x.shape[-1]), w, bias, splits, combine).reshape(*x.shape[:-1], w.shape[0])


def save_operands(ctx, inputs, output):
    x, w, bias, _, combine = inputs
    ctx.save_for_backward(x, w)
    ctx.combine, ctx.has_bias = combine, bias is not None


def backward_through(gemm):
    """The backward of one backend's GEMM op: dX = dY w and dW = dY^T x through that op too, each
    split by auto_splits of its own reduced dim and rows. (Those are plain ints here: the chunks of
    dW depend on M, so under torch.compile with dynamic shapes the backward specializes M.)"""
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.to(torch.float16)
        m, n = g.shape
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:  # (M, K) = g (M, N) @ w (N, K): "w" is w^T, (K, N)
            grad_x = gemm(g, w.t(), None, auto_splits(int(n), int(m), ctx.combine), ctx.combine)
        if ctx.needs_input_grad[1]:  # (N, K) = g^T (N, M) @ x (M, K): "w" is x^T, (K, M)
            grad_w = gemm(g.t(), x.t(), None, auto_splits(int(m), int(n), ctx.combine), ctx.combine)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.float().sum(0).half()
        return grad_x, grad_w, grad_bias, None, None
    return backward



@torch.library.custom_op("lowconv::fp16acc_reference", mutates_args=())
def reference_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], splits: int,
                   combine: str) -> torch.Tensor:
    """fp16acc_matmul_reference of x (M, K) as an op: its backward is the same split GEMM's."""
    return fp16acc_matmul_reference(x, w, bias, splits, combine)


reference_gemm.register_fake(fp16_output)


# --- cuBLAS: one matmul per chunk, fp16-accumulated --------------------------------------------

# The flag is process-wide: blocks in several threads (DataParallel replicas, a serving pool) share
# one switch-on, and the value from before the first comes back when the last one leaves.
FP16_ACCUMULATION = ScopedSetting(lambda: torch.backends.cuda.matmul.allow_fp16_accumulation,
                                  lambda on: setattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", on),
                                  True)


def cublas_fp16_accumulation():
    """torch.backends.cuda.matmul.allow_fp16_accumulation on inside the block only: the previous
    value comes back when the last block (of any thread) leaves, also when a block raises. Other
    threads' fp16 matmuls see the flag on while a block runs."""
    return FP16_ACCUMULATION.held()


def chunk_product(x_chunk, w_chunk) -> torch.Tensor:
    """One chunk's x_chunk (M, k) @ w_chunk (N, k)^T in fp16 (a name of its own, so tests can
    watch the calls)."""
    return x_chunk @ w_chunk.t()


@torch.library.custom_op("lowconv::fp16acc_cublas", mutates_args=())
def cublas_fp16acc(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], splits: int,
                   combine: str) -> torch.Tensor:
    """(M, N) fp16 = x (M, K) @ w (N, K)^T + bias: one cuBLAS matmul per chunk of the reference,
    each accumulated in fp16 by cuBLAS (allow_fp16_accumulation), added up in `combine` precision.
    An op, opaque to torch.compile: the flag is a process-wide setting, switched around the calls."""
    (m, k), n = x.shape, w.shape[0]
    blocks_per_split, _ = chunks(k, splits)
    width = blocks_per_split * BLOCK_K
    total = torch.zeros(m, n, dtype=torch.float32 if combine == "fp32" else torch.float16, device=x.device)
    with cublas_fp16_accumulation():
        for start in range(0, k, width):
            # one kernel: torch adds in fp32 and rounds to total's dtype (fp16 for combine "fp16")
            total.add_(chunk_product(x[:, start:start + width], w[:, start:start + width]))
    return add_bias(total.float(), bias)


cublas_fp16acc.register_fake(fp16_output)


# The GEMM op of each backend, differentiable (backward_through).
GEMMS = {"triton": launch_fp16acc, "cublas": cublas_fp16acc, "reference": reference_gemm}
for gemm in GEMMS.values():
    gemm.register_autograd(backward_through(gemm), setup_context=save_operands)
