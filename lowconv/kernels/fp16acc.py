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

The Triton kernel (`_fp16acc_kernel`) runs in one of two layouts, both with these numerics:
- chunks in turn: one program per output tile runs its S chunks one after the other, each in a
  fresh fp16 accumulator folded into the tile's running total at the chunk's end, so nothing of
  size S x M x N is stored. Used when the output tiles alone give enough programs: M > SMALL_M,
  or small M (decode) when N gives at least one 16-column tile per SM;
- chunks in parallel (small M and small N): every chunk of every tile is its own program, writing
  its fp16 accumulator (as is, exactly) to an (S, M, N) buffer; `_combine_kernel` then adds the S
  partial sums in chunk order in `combine` precision, the same order as the other layout. The
  buffer costs S*M*N*2 bytes against the weight's N*K*2, i.e. M / chunk width: small for small M.
On an sm_90 device (H100), large GEMMs whose operands TMA can read run the Gluon kernel of
fp16acc_wgmma.py instead: the same numerics (the same bits on the H100), 128 x 256 tiles, TMA loads,
asynchronous wgmma; `launch_fp16acc` picks it (fp16acc_wgmma.wgmma_runs says when).
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
import triton
import triton.language as tl
import triton.testing

from lowconv.kernels.fp16acc_wgmma import launch_fp16acc_wgmma, wgmma_aligned, wgmma_runs
from lowconv.kernels.gpu import multiprocessors
from lowconv.kernels.tile_order import grouped_tile
from lowconv.kernels.triton_ops import cdiv, triton_op, wrap
from lowconv.scoped_setting import ScopedSetting

BLOCK_K = 16
AUTO_MAX_SPLITS = 32
AUTO_MAX_SPLITS_SMALL_M = 64  # up to SMALL_M rows (decode): see auto_splits
AUTO_MIN_CHUNK_K = 64
ERROR_BAR = 0.25  # auto's aim: its error at most this of one fp16 chain's
# The variance of the output's fp16 rounding over that of one k16 block's rounding in the
# accumulator: (2.08e-4 / 2.04e-4)^2 on the H100 (cuBLAS fp32-acc's error; S = 1's fitted per block)
OUTPUT_ROUNDING = 1.04
SMALL_M = 64  # up to this many rows: 16- or 64-row tiles, their own configs
NARROW_TILE_N = 16
SMALL_WORK = 1 << 24  # M*N*K below which tuning costs more than it can win: one fixed config


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


def chunks(k: int, splits: int) -> tuple[int, int]:
    """(16-wide k-blocks per chunk, number of chunks) of K split S ways: ceil(blocks / S) whole
    blocks per chunk, the last one shorter, no empty chunk; so fewer than S chunks where S does
    not divide the blocks evenly enough (K = 1024, 64 blocks: S = 40 gives 32 chunks of 2)."""
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


def fp16_output(x, w, bias, splits, combine) -> torch.Tensor:
    """The fake implementation of the GEMM ops: (M, N) fp16, contiguous."""
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float16)


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


# --- Triton ------------------------------------------------------------------------------------

def gemm_config(block_n, tile_k, warps, stages, block_m=None, **options) -> triton.Config:
    kwargs = dict(BLOCK_N=block_n, TILE_K=tile_k, **({} if block_m is None else {"BLOCK_M": block_m}))
    return triton.Config(kwargs, num_warps=warps, num_stages=stages, **options)


# Wgmma with an fp16 accumulator is synchronous in Triton 3.6 (its pipeliner makes a dot async only
# with an fp32 accumulator), so each k-tile's MMAs are waited for before the next are issued. The
# candidates keep two or three programs per SM (registers and shared memory for all of them), so
# that one program's MMAs run while another waits, loads or folds its accumulator into its total.
# On the H100 the first wins from 2048^3 up and (128, 64) at 1024^3 (BENCHMARKS.md).
LARGE_M_CONFIGS = [
    gemm_config(128, 64, 8, 3, block_m=128, maxnreg=128),  # 2 programs per SM
    gemm_config(128, 64, 4, 3, block_m=128),  # 2 programs per SM
    gemm_config(128, 64, 8, 3, block_m=256),
    gemm_config(128, 64, 4, 3, block_m=64),  # 3 programs per SM
    gemm_config(64, 64, 4, 4, block_m=128),  # 2 programs per SM
]
LARGE_M_SMALL_WORK_CONFIG = gemm_config(64, 64, 4, 3, block_m=64)
# BLOCK_M comes from the launch (16 or 64 rows); memory-bound, so wide k-tiles for bytes in flight
# and narrow N for enough programs when there are few chunks.
SMALL_M_CONFIGS = [
    gemm_config(16, 256, 4, 4),
    gemm_config(32, 256, 4, 4),
    gemm_config(64, 128, 4, 4),
    gemm_config(64, 256, 4, 3),
    gemm_config(128, 128, 4, 3),
]
SMALL_M_SMALL_WORK_CONFIG = gemm_config(32, 64, 4, 3)


def quick_bench(kernel_call, quantiles):
    """The autotuner's timing: fewer and shorter repeats than its default, so that tuning a new
    shape stays a fraction of a second per config."""
    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


def untuned_when_small(small_config):
    """An early_config_prune: only `small_config` for problems under SMALL_WORK."""
    def prune(configs, named_args, **kwargs):
        return [small_config] if named_args["M"] * named_args["N"] * named_args["K"] < SMALL_WORK else configs
    return prune


@triton.jit(do_not_specialize=["SPLITS", "CHUNKS_PER_PROGRAM"])
def _fp16acc_kernel(x, w, bias, out, M, N, K, CHUNK_K, SPLITS, CHUNKS_PER_PROGRAM,
                    stride_xm, stride_xk, stride_wn, stride_wk, stride_og, stride_om, stride_on,
                    HAS_BIAS: tl.constexpr, COMBINE_FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile over chunks first .. first + CHUNKS_PER_PROGRAM - 1
    (first = program_id(1) * CHUNKS_PER_PROGRAM): each chunk (CHUNK_K wide, the last one cut at K)
    summed in its own fp16 accumulator, folded into the total (fp32 or fp16) at its end; then the
    bias; stored at out + program_id(1) * stride_og."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, TILE_K)
    x_rows = x + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w + rn[None, :].to(tl.int64) * stride_wn
    first_chunk = tl.program_id(1) * CHUNKS_PER_PROGRAM
    tiles_per_chunk = tl.cdiv(CHUNK_K, TILE_K)
    steps = tl.minimum(SPLITS - first_chunk, CHUNKS_PER_PROGRAM) * tiles_per_chunk
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32 if COMBINE_FP32 else tl.float16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float16)
    # One flat loop over (chunk, k-tile), not two nested ones: the compiler pipelines the loads of
    # a flat loop across chunk ends, and the nested form spilled registers.
    for step in range(steps):
        chunk = first_chunk + step // tiles_per_chunk
        tile = step % tiles_per_chunk
        ks = chunk * CHUNK_K + tile * TILE_K + rk
        k_end = tl.minimum((chunk + 1) * CHUNK_K, K)
        a = tl.load(x_rows + ks[None, :] * stride_xk, mask=(rm[:, None] < M) & (ks[None, :] < k_end), other=0.0)
        b = tl.load(w_cols + ks[:, None] * stride_wk, mask=(ks[:, None] < k_end) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.float16)
        if tile == tiles_per_chunk - 1:
            total = (total.to(tl.float32) + acc.to(tl.float32)).to(total.dtype)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float16)
    y = total.to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out += tl.program_id(1).to(tl.int64) * stride_og
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on, y.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _combine_kernel(partials, bias, out, MN, N, SPLITS, HAS_BIAS: tl.constexpr, COMBINE_FP32: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out (M, N contiguous) = the S fp16 partial sums (S, M, N contiguous) added in chunk order in
    fp32 or fp16, plus the bias in fp32, rounded to fp16."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < MN
    total = tl.zeros([BLOCK], tl.float32 if COMBINE_FP32 else tl.float16)
    for split in range(SPLITS):
        partial = tl.load(partials + split * MN + offsets, mask=inside, other=0.0)
        total = (total.to(tl.float32) + partial.to(tl.float32)).to(total.dtype)
    y = total.to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias + offsets % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + offsets, y.to(tl.float16), mask=inside)


GEMM_KEY = ["M", "N", "K", "stride_xk", "stride_wk"]  # the strides tell the backward's transposed operands apart
_tuned_for_large_m = triton.autotune(LARGE_M_CONFIGS, key=GEMM_KEY, do_bench=quick_bench, prune_configs_by={
    "early_config_prune": untuned_when_small(LARGE_M_SMALL_WORK_CONFIG)})(_fp16acc_kernel)
_tuned_for_small_m = triton.autotune(SMALL_M_CONFIGS, key=GEMM_KEY + ["CHUNK_K"], do_bench=quick_bench,
                                     prune_configs_by={"early_config_prune": untuned_when_small(
                                         SMALL_M_SMALL_WORK_CONFIG)})(_fp16acc_kernel)
COMBINE_BLOCK = 1024


@triton_op("lowconv::fp16acc_triton", mutates_args=())
def launch_fp16acc(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], splits: int,
                   combine: str) -> torch.Tensor:
    """(M, N) fp16 = x (M, K) @ w (N, K)^T + bias, any strides, with the chunks of the reference."""
    (m, k), n = x.shape, w.shape[0]
    if m > SMALL_M and wgmma_runs(x, w, multiprocessors(x.device)):
        return wgmma_gemm(x, w, bias, splits, combine)
    out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    if m == 0 or n == 0:
        return out
    blocks_per_split, splits = chunks(k, splits)
    chunk_k = blocks_per_split * BLOCK_K
    combine_fp32 = combine == "fp32"
    if m > SMALL_M:
        run_gemm(_tuned_for_large_m, x, w, bias, out, chunk_k, splits, splits, 1, combine_fp32, block_m=None)
        return out
    if splits == 1 or cdiv(n, NARROW_TILE_N) >= multiprocessors(x.device):
        run_gemm(_tuned_for_small_m, x, w, bias, out, chunk_k, splits, splits, 1, combine_fp32,
                 block_m=small_block_m(m))
        return out
    partials = torch.empty(splits, m, n, dtype=torch.float16, device=x.device)
    run_gemm(_tuned_for_small_m, x, w, None, partials, chunk_k, splits, 1, splits, combine_fp32,
             block_m=small_block_m(m))
    wrap(_combine_kernel)[(cdiv(m * n, COMBINE_BLOCK),)](
        partials, bias if bias is not None else partials, out, m * n, n, splits,
        HAS_BIAS=bias is not None, COMBINE_FP32=combine_fp32, BLOCK=COMBINE_BLOCK)
    return out


@torch.library.custom_op("lowconv::fp16acc_wgmma", mutates_args=())
def wgmma_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], splits: int,
               combine: str) -> torch.Tensor:
    """launch_fp16acc on the Gluon wgmma kernel, which launch_fp16acc's body calls where wgmma_runs:
    an op of its own, opaque to torch.compile (Gluon kernels do not go through wrap_triton). Where
    its operands turn out unaligned for TMA when it runs (torch.compile traced it on fake tensors,
    which have no address), the Triton kernel's launch_fp16acc computes the product."""
    if not all(wgmma_aligned(t) for t in (x, w)):
        return launch_fp16acc(x, w, bias, splits, combine)
    blocks_per_split, splits = chunks(x.shape[1], splits)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float16, device=x.device)
    launch_fp16acc_wgmma(x, w, bias, out, blocks_per_split * BLOCK_K, splits, combine == "fp32")
    return out


wgmma_gemm.register_fake(fp16_output)


def small_block_m(m: int) -> int:
    return 16 if m <= 16 else 64


def run_gemm(tuner, x, w, bias, out, chunk_k, splits, chunks_per_program, programs_per_tile, combine_fp32, block_m,
             config=None):
    """_fp16acc_kernel through an autotuner (or in the given config), over (output tiles,
    programs_per_tile); out is (M, N) or, for programs_per_tile > 1, (programs_per_tile, M, N).
    block_m: a fixed BLOCK_M, or None when the configs choose it."""
    (m, k), n = x.shape, w.shape[0]
    args = (x, w, bias if bias is not None else x, out, m, n, k, chunk_k, splits, chunks_per_program,
            *x.stride(), *w.stride(), out.stride(0) if out.dim() == 3 else 0, *out.stride()[-2:])
    kwargs = dict(HAS_BIAS=bias is not None, COMBINE_FP32=combine_fp32,
                  **({} if block_m is None else {"BLOCK_M": block_m}))

    def grid(meta):
        return cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), programs_per_tile

    if config is None and x.is_cuda:
        config = tuned_config(tuner, args)
        if config is None:  # a new key: the autotuner times the configs and launches the best
            wrap(tuner)[grid](*args, **kwargs)
            return
    if config is None:  # Triton's interpreter cannot time configs: the first one the pruning keeps
        config = tuner.early_config_prune(tuner.configs, dict(zip(tuner.arg_names, args)))[0]
    # The config the autotuner picked, without the autotuner: at decode an eager call is bound by
    # host time, which the autotuner's lookup adds to; and a compiled graph runs what eager runs.
    wrap(kernel_in(config))[grid](*args, **kwargs)


@functools.cache
def kernel_in(config: triton.Config):
    """_fp16acc_kernel always launched in `config`: an autotuner of that config alone, from which
    wrap_triton takes the config's launch options (inductor leaves out maxnreg)."""
    return triton.autotune([config], key=[])(_fp16acc_kernel)


def tuned_config(tuner, args):
    """The config `tuner` has picked for these arguments (its own cache, under the key Triton 3.6
    builds: the key arguments' values, then every tensor's dtype), or None before it has timed
    them, or for torch.compile's symbolic sizes; a Triton whose key differs only sends every call
    through the autotuner."""
    if len(tuner.configs) == 1:
        return tuner.configs[0]
    named = dict(zip(tuner.arg_names, args))
    key = tuple(named[name] for name in tuner.keys) + tuple(str(a.dtype) for a in args if hasattr(a, "dtype"))
    if any(isinstance(value, torch.SymInt) for value in key):
        return None
    return tuner.cache.get(key)


# The GEMM op of each backend, differentiable (backward_through).
GEMMS = {"triton": launch_fp16acc, "cublas": cublas_fp16acc, "reference": reference_gemm}
for gemm in GEMMS.values():
    gemm.register_autograd(backward_through(gemm), setup_context=save_operands)
