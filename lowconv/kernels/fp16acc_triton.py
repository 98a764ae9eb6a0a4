"""The Triton side of fp16acc.py's split-K fp16-accumulating GEMM: the kernels, their configs and
autotuning, and the ops that launch them (lowconv::fp16acc_triton, lowconv::fp16acc_wgmma). The
numerics, the torch reference, the cuBLAS path and the dispatch (fp16acc_matmul, each op's
autograd) are in fp16acc.py, which imports this module. What both files use lives here, so that
this module imports nothing of fp16acc.py: the chunking (`chunks`), BLOCK_K, SMALL_M and the ops'
fake implementation (`fp16_output`). fp16acc.py registers the ops' autograd: import it, not this
module alone, to differentiate them.

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
"""
import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
import triton.testing

from lowconv.kernels.fp16acc_wgmma import launch_fp16acc_wgmma, wgmma_aligned, wgmma_runs
from lowconv.kernels.gpu import multiprocessors
from lowconv.kernels.tile_order import grouped_tile
from lowconv.kernels.triton_ops import cdiv, triton_op, wrap

BLOCK_K = 16
SMALL_M = 64  # up to this many rows: 16- or 64-row tiles, their own configs
NARROW_TILE_N = 16
SMALL_WORK = 1 << 24  # M*N*K below which tuning costs more than it can win: one fixed config


def chunks(k: int, splits: int) -> tuple[int, int]:
    """(16-wide k-blocks per chunk, number of chunks) of K split S ways: ceil(blocks / S) whole
    blocks per chunk, the last one shorter, no empty chunk; so fewer than S chunks where S does
    not divide the blocks evenly enough (K = 1024, 64 blocks: S = 40 gives 32 chunks of 2)."""
    blocks = max(1, math.ceil(k / BLOCK_K))
    blocks_per_split = math.ceil(blocks / splits)
    return blocks_per_split, math.ceil(blocks / blocks_per_split)


def fp16_output(x, w, bias, splits, combine) -> torch.Tensor:
    """The fake implementation of the GEMM ops: (M, N) fp16, contiguous."""
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float16)


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
