"""FP8 linears with 2:4 sparse e4m3 weights on cuSPARSELt's e4m3 2:4 GEMM.

Numerics: y = (x_fp8 @ w_fp8^T) * x_scale * w_scale^T + bias, as fp8.py's linear (products of two
e4m3 values exact, fp32 sums), with one rounding more: cuSPARSELt (0.8, Hopper) refuses scale
vectors for e4m3 operands (ALPHA_VECTOR_SCALING), and a dynamic scale lives on the GPU, where its
host-side alpha cannot read it. So the GEMM writes the unscaled sums rounded to bfloat16
(`product`: y^T row-major, as kernels/cusparselt.py lays it; bfloat16 for fp16 models too, since
|sum| reaches 448^2 K, beyond fp16's range), and `scale_product` applies the scales and the bias
in fp32 and rounds to the model's dtype: each output rounded twice (2^-9 relative each), where
fp8.py's GEMM rounds once.

`scale_product` is one Triton kernel (`lowconv::fp8_sparse24_scale`, eagerly and under
torch.compile) that reads the transposed product and writes y row-major. Torch's eager ops read it
through fp32 temporaries: about 1.7 ms at a Llama MLP's 16384 x 14336 output on the H200, against
1.1 ms for the sparse GEMM itself. Under torch.compile, inductor's fusion of the same torch ops
(`scale_product_reference`) into y's reader made ViT-L/16 slower (1.29x bf16 compiled against
1.42x with the kernel; its LayerNorm then reduces rows of a column-major y) and the Llama prefill
about 2% faster (bench_models.py, H200, 5 and 3 rounds).

With its scales applied, as `choose_backend` times it against fp8.py's dense GEMM (the plans'
notes in bench_models.py, H200, cuSPARSELt 0.8.0): 0.89x the dense time at a Llama-8B gate/up
(16384 x 4096 -> 14336), 0.69x at its down projection, 0.69-0.78x at 64 rows, 0.91x at ViT-L/16's
fc2, but 1.41x at its fc1 (12608 x 1024 -> 4096), which keeps the dense GEMM.
"""
import functools
import statistics
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowconv.errors import LowconvError
from lowconv.kernels import cusparselt, cusparselt_library
from lowconv.kernels.cuda_timing import graph_ms
from lowconv.kernels.fp8 import E4M3, fp8_linear
from lowconv.kernels.sparse24 import BackendChoice, pick_backend, prune_24
from lowconv.kernels.triton_ops import cdiv, triton_op, wrap

PRODUCT_DTYPE = torch.bfloat16  # what the GEMM writes (module doc)
TILE = (64, 64)  # the scaling kernel's rows x columns of y per program


def sparse_gemm(out_features: int, in_features: int, device: torch.device) -> cusparselt.SparseGemm:
    """The cuSPARSELt GEMM of an e4m3 2:4 weight (out_features, in_features) on `device`."""
    return cusparselt.SparseGemm(out_features, in_features, E4M3, device, PRODUCT_DTYPE)


@torch.library.custom_op("lowconv::fp8_sparse24_gemm", mutates_args=())
def product(x_fp8: torch.Tensor, compressed: torch.Tensor, out_features: int, gemm: int,
            tuned: bool) -> torch.Tensor:
    """x_fp8 (..., K) times the 2:4 weight^T that the SparseGemm registered under `gemm`
    compressed: the unscaled sums in bfloat16, (..., N), the transposed view of y^T (`tuned` as
    SparseGemm.linear's)."""
    return cusparselt.registered(gemm).linear(compressed, x_fp8, None, tuned)


@product.register_fake
def _(x_fp8, compressed, out_features, gemm, tuned):
    return cusparselt.linear_output(x_fp8, out_features, PRODUCT_DTYPE)[1]


def scale_product_reference(product: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                            bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y = product * x_scale * w_scale^T + bias in fp32, rounded once to out_dtype; x_scale (1,) or
    (..., 1), w_scale (1,) or (N, 1)."""
    y = product.float() * x_scale.float() * w_scale.float().reshape(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def _scale_product_kernel(p, x_scale, w_scale, bias, y, M, N, stride_m, stride_n,
                          X_ROWS: tl.constexpr, W_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_n
    v = tl.load(p + offsets, mask=ok, other=0.0).to(tl.float32)
    if X_ROWS:
        v = v * tl.load(x_scale + rows, mask=row_ok, other=0.0)[:, None]
    else:
        v = v * tl.load(x_scale)
    if W_ROWS:
        v = v * tl.load(w_scale + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        v = v * tl.load(w_scale).to(tl.float32)
    if HAS_BIAS:
        v = v + tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows[:, None].to(tl.int64) * N + cols[None, :], v.to(y.dtype.element_ty), mask=ok)


@triton_op("lowconv::fp8_sparse24_scale", mutates_args=())
def scale_product(product: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """scale_product_reference in one Triton kernel: reads the product in any layout (its
    transposed view of y^T, coalesced along M), writes y row-major; the bias is added in an FMA."""
    n = product.shape[-1]
    p2 = product.reshape(-1, n)
    m = p2.shape[0]
    y = torch.empty(*product.shape, dtype=out_dtype, device=product.device)
    x_scale = x_scale.float().reshape(-1)
    grid = (cdiv(m, TILE[0]), cdiv(n, TILE[1]))
    wrap(_scale_product_kernel)[grid](
        p2, x_scale, w_scale.reshape(-1), y if bias is None else bias, y, m, n, p2.stride(0), p2.stride(1),
        X_ROWS=x_scale.numel() != 1, W_ROWS=w_scale.numel() != 1, HAS_BIAS=bias is not None,
        BLOCK_M=TILE[0], BLOCK_N=TILE[1], num_warps=4)
    return y


def fp8_sparse24_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, compressed: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                        gemm: cusparselt.SparseGemm, tuned: bool) -> torch.Tensor:
    """The entry point: y = x W^T + b, x as x_fp8 (..., K) e4m3 with x_scale (1,) or (..., 1), W as
    `compressed` by `gemm` (an e4m3 SparseGemm: sparse_gemm) with w_scale (1,) or (N, 1); y (..., N)
    in out_dtype. `tuned` as SparseGemm.linear's."""
    n, k = gemm.out_features, gemm.in_features
    if x_fp8.dtype != E4M3 or gemm.dtype != E4M3 or x_fp8.shape[-1] != k:
        raise LowconvError(f"fp8 2:4 linear: x {tuple(x_fp8.shape)} {x_fp8.dtype} does not fit an e4m3 weight "
                           f"({n}, {k}) ({gemm.dtype})")
    if x_scale.numel() != 1 and tuple(x_scale.shape) != (*x_fp8.shape[:-1], 1):
        raise LowconvError(f"fp8 2:4 linear: x_scale has shape {tuple(x_scale.shape)}, expected (1,) or "
                           f"{(*x_fp8.shape[:-1], 1)}")
    if w_scale.numel() not in (1, n):
        raise LowconvError(f"fp8 2:4 linear: w_scale has shape {tuple(w_scale.shape)}, expected (1,) or ({n}, 1)")
    return scale_product(product(x_fp8, compressed, n, gemm.key, tuned), x_scale, w_scale, bias, out_dtype)


@dataclass(frozen=True)
class GemmCase:
    """What the two FP8 GEMMs of a 2:4 layer are timed on: x (rows, K) e4m3, W (N, K), scales as
    `granularity`'s (fp8.py LINEAR_GRANULARITIES' x and W scales), y in out_dtype."""

    rows: int
    out_features: int
    in_features: int
    x_rows: bool  # a scale per row of x (else one)
    w_rows: bool  # a scale per output channel of W (else one)
    has_bias: bool
    out_dtype: torch.dtype
    device: torch.device


ROUNDS = 3  # the two GEMMs alternate over rounds of CUDA-graph timings


def choose_backend(requested: str, case: GemmCase) -> BackendChoice:
    """Which GEMM a layer runs on a CUDA device: as requested ("cusparselt", "dense"), or for
    "auto" cuSPARSELt's 2:4 GEMM where it is available and measured faster than the dense FP8
    GEMM (fp8.py's, of the same pruned weight) at the case's shape, once per process and case."""
    def problem():
        return cusparselt_library.unavailable_problem(case.device, E4M3) or cusparselt.shape_problem(
            case.out_features, case.in_features, E4M3)
    return pick_backend(requested, "dense", problem, lambda: time_backends(case), case.rows, "e4m3 scaled")


@functools.cache  # unbounded: the cases are bounded by a model's sites
def time_backends(case: GemmCase) -> tuple[float, float]:
    """(2:4 ms, dense ms) of case's GEMMs with their scales applied, as the layer calls them
    (CUDA-graph replays: GPU time), on random operands; once per process and case, so that every
    layer of a shape makes the same choice."""
    gen = torch.Generator(device=case.device).manual_seed(0)
    n, k, device = case.out_features, case.in_features, case.device
    x_fp8 = torch.randn(case.rows, k, generator=gen, device=device).to(E4M3)
    w_fp8 = prune_24(torch.randn(n, k, generator=gen, device=device)).to(E4M3)
    x_scale = torch.rand((case.rows, 1) if case.x_rows else (1,), generator=gen, device=device)
    w_scale = torch.rand((n, 1) if case.w_rows else (1,), generator=gen, device=device).to(case.out_dtype)
    bias = torch.randn(n, generator=gen, device=device).to(case.out_dtype) if case.has_bias else None
    gemm = sparse_gemm(n, k, device)
    compressed = gemm.compress(w_fp8)
    calls = {"sparse": lambda: fp8_sparse24_linear(x_fp8, x_scale, compressed, w_scale, bias, case.out_dtype,
                                                   gemm, True),
             "dense": lambda: fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, case.out_dtype, True)}
    samples = {name: [] for name in calls}
    for _ in range(ROUNDS):  # alternated, so that clock and thermal drift hit both alike
        for name, call in calls.items():
            samples[name].append(graph_ms(call))
    return statistics.median(samples["sparse"]), statistics.median(samples["dense"])
