"""An FP8 GEMM for few rows (a decode step's tokens): y = (x_fp8 @ w_fp8^T) * x_scale * w_scale^T + bias.

Numerics: fp8.py's fp8_linear_reference. Products of two fp8 values are exact in fp32 and summed
in fp32 (tl.dot's accumulator); with SPLIT_K > 1 each program sums a K range and the partial sums
are added in fp32 afterwards (another order of the same terms); the scales multiply the fp32 sum,
then the bias is added, then one rounding to the output dtype. Tensor scales (1,) or row scales,
x (M, 1) and w (N, 1); not block scales.

Why: with a few rows a linear reads its weight and little else, so its time is the weight's bytes
over the memory bandwidth, half of bf16's in FP8. torch._scaled_mm's kernels tile N by 128 or
more with no split along K: at 64 rows a 4096-wide layer runs 32 programs on the GPU's 132
multiprocessors and reads its FP8 weight slower than cuBLAS reads the bf16 one (bench_models.py,
llama-decode). Here a program covers BLOCK_N output columns and a share of K, so every layer
runs about one program per multiprocessor, each streaming its slice of the weight.
"""
import torch
import triton
import triton.language as tl

from lowconv.kernels.gpu import cuda_capability, multiprocessors
from lowconv.kernels.triton_ops import cdiv

# Rows the kernel takes: one BLOCK_M tile, of 16 rows (tensor-core MMAs) or 64 (Hopper's wgmma; 32 rows
# would run the slower MMAs: 1.5x the time of 64 at Llama-3-8B's down projection)
MAX_ROWS = 64
BLOCK_K, WARPS = 256, 4
MIN_K_STEPS = 2  # BLOCK_K steps a program runs at least: fewer, and the partial sums cost more than they save
PRECISE_EVERY = 32  # without fast accumulation, products summed in the tensor cores' narrower accumulator before fp32
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemm_rows(x, x_scale, w, w_scale, bias, out, partial, M, N, K, K_PER_SPLIT,
                   X_ROWS: tl.constexpr, W_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr):
    """Program (n, s): columns [n * BLOCK_N, ...) of all M rows over K range s. SPLIT_K == 1 writes
    the scaled result to out; else the unscaled fp32 partial sum to partial[s]."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        ks = k + steps
        a = tl.load(x + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        y = _scaled(acc, x_scale, w_scale, bias, rows, cols, M, N, X_ROWS, W_ROWS, HAS_BIAS)
        tl.store(out + rows[:, None] * N + cols[None, :], y.to(out.dtype.element_ty), mask=ok)
    else:
        tl.store(partial + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=ok)


@triton.jit
def _scaled(acc, x_scale, w_scale, bias, rows, cols, M, N, X_ROWS: tl.constexpr, W_ROWS: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """acc * x_scale * w_scale (+ bias), in fp32."""
    if X_ROWS:
        acc = acc * tl.load(x_scale + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    else:
        acc = acc * tl.load(x_scale).to(tl.float32)
    if W_ROWS:
        acc = acc * tl.load(w_scale + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    else:
        acc = acc * tl.load(w_scale).to(tl.float32)
    if HAS_BIAS:
        acc = acc + tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _sum_partials(partial, x_scale, w_scale, bias, out, M, N, X_ROWS: tl.constexpr, W_ROWS: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[:, columns of program n] = the scaled sum of the SPLIT_K partial sums."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial + s * M * N + offs, mask=ok, other=0.0)
    y = _scaled(acc, x_scale, w_scale, bias, rows, cols, M, N, X_ROWS, W_ROWS, HAS_BIAS)
    tl.store(out + offs, y.to(out.dtype.element_ty), mask=ok)


def takes(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
          out_dtype: torch.dtype) -> bool:
    """Whether this kernel computes the linear: an e4m3 x on an sm_90+ GPU, 1 to MAX_ROWS rows,
    tensor or row scales, K a multiple of 16 (16-byte rows), 32-bit offsets."""
    rows = x_fp8.numel() // max(x_fp8.shape[-1], 1)
    return (x_fp8.is_cuda and x_fp8.dtype == torch.float8_e4m3fn and 0 < rows <= MAX_ROWS
            and w_fp8.shape[1] % 16 == 0 and out_dtype in OUT_DTYPES and w_fp8.numel() < 2**31
            and x_scale.numel() in (1, rows) and w_scale.numel() in (1, w_fp8.shape[0])
            and cuda_capability(x_fp8.device.index) >= (9, 0))


def tiles(m: int, n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, STAGES) for an (m, n, k) GEMM: scripts/tune_fp8_small_m.py on an H200 (BENCHMARKS.md)."""
    block_n = 64 if n >= 8192 or (m <= 16 and n >= 4096) else 32
    return block_n, 5 if k >= 8192 else 3


def split_k(n: int, k: int, programs: int, block_n: int) -> int:
    """K ranges per column block: enough programs for every multiprocessor, each range at least
    MIN_K_STEPS blocks of K long."""
    column_blocks = cdiv(n, block_n)
    wanted = max(1, programs // column_blocks)
    return max(1, min(wanted, cdiv(k, BLOCK_K * MIN_K_STEPS)))


def fp8_gemm_rows(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool,
                  config: tuple[int, int] | None = None) -> torch.Tensor:
    """The linear for x (..., K) with few rows (takes() says which); w (N, K). `fast_accum`: sum
    in the tensor cores' accumulator throughout (cuBLASLt's fast accumulation), else move the sums
    to fp32 every PRECISE_EVERY products. `config`: (BLOCK_N, STAGES), else tiles()'s."""
    k, n = x_fp8.shape[-1], w_fp8.shape[0]
    x2 = x_fp8.reshape(-1, k).contiguous()
    x_scale, w_scale = x_scale.reshape(-1).contiguous(), w_scale.reshape(-1).contiguous()
    m = x2.shape[0]
    w = w_fp8.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    block_n, stages = config or tiles(m, n, k)
    splits = split_k(n, k, multiprocessors(x2.device), block_n)
    k_per_split = cdiv(cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = cdiv(k, k_per_split)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device) if splits > 1 else out
    flags = dict(X_ROWS=x_scale.numel() != 1, W_ROWS=w_scale.numel() != 1, HAS_BIAS=bias is not None,
                 SPLIT_K=splits, BLOCK_M=16 if m <= 16 else MAX_ROWS, BLOCK_N=block_n)
    bias_arg = bias if bias is not None else out
    _fp8_gemm_rows[(cdiv(n, block_n), splits)](
        x2, x_scale, w, w_scale, bias_arg, out, partial, m, n, k, k_per_split, BLOCK_K=BLOCK_K,
        IMPRECISE=None if fast_accum else PRECISE_EVERY, **flags, num_warps=WARPS, num_stages=stages)
    if splits > 1:
        _sum_partials[(cdiv(n, block_n),)](partial, x_scale, w_scale, bias_arg, out, m, n, **flags, num_warps=4)
    return out.reshape(*x_fp8.shape[:-1], n)
