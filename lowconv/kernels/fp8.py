"""FP8 quantization and FP8 linear.

Scales follow torch._scaled_mm: a float32 *dequant* scale, x ~= x_fp8.float() * scale.
Tensorwise scales have shape (1,); rowwise scales keep the reduced dim: (..., 1). Block scales
(DeepSeek-V3's, compressed-tensors' FP8_BLOCK) cover BLOCK = 128 consecutive values along K of an
activation row, (..., ceil(K / 128)) ("group"), and a 128 x 128 tile of W, (ceil(N / 128),
ceil(K / 128)) ("block"); a last, partial block is scaled by its own values.
Quantizers saturate: finite values beyond the format's max are clamped to it, never cast to
NaN/inf (NaN stays NaN; an infinite x makes its scale infinite). Amaxes skip NaN.
Quantizers run Triton kernels (fp8_quant.py) eagerly on sm_90+ GPUs, and torch ops (the
reference, the same numbers) elsewhere and under torch.compile, where inductor fuses them into the
op that produces x (one kernel for a norm, its amax and the cast); the per-tensor quantizer may
scale x by a vector along its columns or rows first (mul, mul_axis), as the training backward
needs. The GEMM (gemm_route picks it): on CUDA, for up to 64 rows (a decode step) lowconv's
Triton GEMM (fp8_small_m.py: the weight's bytes at memory speed, where torch._scaled_mm is slower
than bf16), else torch._scaled_mm (cuBLASLt) where it takes the operands, and otherwise a torch
reference with the same numerics. It runs as the custom op `torch.ops.lowconv.fp8_gemm` (a fake
implementation gives its output's shape, so compiled graphs keep it whole), except torch._scaled_mm
under torch.compile: traced, it is an aten op that inductor calls itself, with the scales' layout
work fused into the quantizer's kernel; through the custom op each call paid about 0.1 ms of
Python on the host (dispatch, checks, scale copies), which left compiled FP8 models host-bound.
"""

import torch

from lowconv.kernels import fp8_quant, fp8_small_m
from lowconv.kernels.gpu import cuda_capability

E4M3 = torch.float8_e4m3fn  # forward: weights and activations
E5M2 = torch.float8_e5m2  # backward: gradients (wider range, fewer mantissa bits)
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
# A linear's granularity: how its x and its W are scaled when quantized dynamically ("token": x per
# token, W per tensor, vLLM's dynamic FP8 scheme for a per-tensor weight scale).
LINEAR_GRANULARITIES = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "token": ("row", "tensor"),
                        "block": ("group", "block")}
BLOCK = 128  # the values one block scale covers along each blocked dim


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The dequant scale that maps amax to the format's max; 1 where amax is 0 (all-zero data)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX[fp8_dtype], torch.ones_like(amax))


def casts_in_triton(x: torch.Tensor) -> bool:
    """Whether the Triton quantizers can take x: on sm_90+, where Triton's fp32 -> fp8 cast rounds
    once (on sm_89 it goes through fp16: a double rounding, not the reference's numbers)."""
    return x.is_cuda and cuda_capability(x.device.index) >= (9, 0)


def quantizes_in_triton(x: torch.Tensor) -> bool:
    """Whether x's quantizers run the Triton kernels: eagerly where they can take x. Under
    torch.compile the torch ops run: inductor fuses them with x's producer."""
    return not torch.compiler.is_compiling() and casts_in_triton(x)


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype):
    """The reference cast: (x_fp8, scale) with x_fp8 = saturate(x / scale); scale broadcasts."""
    scale = scale.float()
    fp8_max = FP8_MAX[fp8_dtype]
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        clipped: torch.Tensor | None = None):
    """(x_fp8, scale) with x_fp8 = saturate(x / scale) for a tensor scale (1,); `clipped` (an int64
    scalar tensor), if given, gets the number of saturated values added."""
    if quantizes_in_triton(x):
        return fp8_quant.quantize_with_scale(x, scale, fp8_dtype, clipped)
    if clipped is not None:
        clipped += count_clipped(x, scale, fp8_dtype)
    return cast_with_scale(x, scale, fp8_dtype)


def scaled_by(x: torch.Tensor, mul: torch.Tensor | None, mul_axis: str | None) -> torch.Tensor:
    """x, or x.float() times the vector mul along its columns (last dim) or its rows (the rest)."""
    if mul is None:
        return x
    if mul_axis == "columns":
        return x.float() * mul.float().reshape(-1)
    if mul_axis == "rows":
        return (x.float().reshape(-1, x.shape[-1]) * mul.float().reshape(-1, 1)).reshape(x.shape)
    raise ValueError(f"mul_axis must be 'columns' or 'rows', got {mul_axis!r}")


def quantize_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor | None = None,
                        mul_axis: str | None = None):
    """(x_fp8, scale (1,)): one scale for the whole tensor (x times mul along mul_axis)."""
    if quantizes_in_triton(x):
        return fp8_quant.quantize_tensorwise(x, fp8_dtype, mul, mul_axis)
    x = scaled_by(x, mul, mul_axis)
    return cast_with_scale(x, amax_to_scale(abs_max(x.reshape(-1)).reshape(1), fp8_dtype), fp8_dtype)


def quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype):
    """(x_fp8, scale (..., 1)): one scale per row (per token of x, per output channel of W)."""
    if quantizes_in_triton(x):
        return fp8_quant.quantize_rowwise(x, fp8_dtype)
    return cast_with_scale(x, amax_to_scale(abs_max(x), fp8_dtype), fp8_dtype)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| along the last dim, kept (..., 1), as the kernels take it: NaN skipped, 0 for no elements."""
    a = x.detach().abs()
    a = torch.where(a.isnan(), 0.0, a)
    if a.shape[-1] == 0:
        return a.new_zeros(*a.shape[:-1], 1)
    return a.amax(dim=-1, keepdim=True)


ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}  # quantize_rows_after's


def activate(x: torch.Tensor, activation: str, up: torch.Tensor | None = None) -> torch.Tensor:
    """act(x), times up where given (a gated MLP's SiLU(gate) * up), in torch ops."""
    h = ACTIVATIONS[activation](x)
    return h if up is None else h * up


def quantize_rows_after(x: torch.Tensor, activation: str, up: torch.Tensor | None, fp8_dtype: torch.dtype = E4M3):
    """quantize_rowwise(activate(x, activation, up)). On sm_90+ GPUs, eagerly and under
    torch.compile, one Triton kernel that never writes the activation (inductor's fusion of the
    two loops over a row past 1024 values took 600 us where the kernel takes 275 at Llama-8B's
    MLP); elsewhere, or with an `up` of another shape or dtype, the torch ops."""
    if casts_in_triton(x) and x.shape[-1] > 0 and (up is None or (up.shape, up.dtype) == (x.shape, x.dtype)):
        return fp8_quant.quantize_rows_after(x, activation, up, fp8_dtype)
    return quantize_rowwise(activate(x, activation, up), fp8_dtype)


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, rows: int):
    """(x_fp8, scale) with one scale per `rows` x BLOCK tile of x's last two dims (rows=1: per
    BLOCK values of each row, "group"; rows=BLOCK: per tile of a weight, "block"), in torch ops:
    x is zero-padded to whole tiles (zeros change no amax) and the padding cut off after the cast."""
    if x.dim() == 1:  # one row (an unbatched input)
        x_fp8, scale = quantize_blocks(x.unsqueeze(0), fp8_dtype, rows)
        return x_fp8[0], scale[0]
    scale = amax_to_scale(block_amax(x, rows), fp8_dtype)
    x_fp8, _ = cast_with_scale(x, expand_blocks(scale, x.shape), fp8_dtype)
    return x_fp8, scale


def block_amax(x: torch.Tensor, rows: int) -> torch.Tensor:
    """abs_max of each `rows` x BLOCK tile of x's last two dims: (..., ceil(m / rows), ceil(k / BLOCK))."""
    m, k = x.shape[-2:]
    pad_m, pad_k = -m % rows, -k % BLOCK
    tiles = torch.nn.functional.pad(x, (0, pad_k, 0, pad_m)).unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, rows))
    return abs_max(tiles.transpose(-3, -2).flatten(-2)).squeeze(-1)


def expand_blocks(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A scale broadcast to `shape`: block scales repeated over the BLOCK values (rows, columns)
    they cover, cut to size; tensor and row scales as they are (they broadcast)."""
    for dim in (-1, -2):
        if scale.dim() >= -dim and 1 < scale.shape[dim] < shape[dim]:
            scale = scale.repeat_interleave(BLOCK, dim).narrow(dim, 0, shape[dim])
    return scale


def quantize(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype = E4M3):
    """Dynamic quantization at `granularity` ("tensor" | "row" | "group": per BLOCK values of a row |
    "block": per BLOCK x BLOCK tile)."""
    if granularity == "tensor":
        return quantize_tensorwise(x, fp8_dtype)
    if granularity == "row":
        return quantize_rowwise(x, fp8_dtype)
    if granularity in ("group", "block"):
        return quantize_blocks(x, fp8_dtype, 1 if granularity == "group" else BLOCK)
    raise ValueError(f"granularity must be 'tensor', 'row', 'group' or 'block', got {granularity!r}")


# Under torch.compile, rows of x longer than this that one layer alone reads are quantized by
# lowconv's row kernel, not fused by inductor into x's producer: past 1024 values inductor's
# reduction loops over each row twice and computes the producer twice (GELU's erf, SiLU), which
# took ViT-L's GELU and quantization 188 us where GELU then the kernel take 156 (H200).
# Where several layers read x, the fusion stays: inductor computes it once for all of them.
FUSED_ROWS_MAX = 1024


def quantize_activation(x: torch.Tensor, granularity: str, scale: torch.Tensor | None = None,
                        clipped: torch.Tensor | None = None, alone: bool = False):
    """e4m3 x with a fixed dequant `scale` (static or delayed scaling; saturated values added to
    `clipped`), or dynamically as the linear's granularity scales x; `alone`: no other layer
    quantizes this x (see FUSED_ROWS_MAX)."""
    if scale is not None:
        return quantize_with_scale(x, scale, E4M3, clipped)
    granularity = LINEAR_GRANULARITIES[granularity][0]
    if granularity == "row" and alone and torch.compiler.is_compiling() and x.shape[-1] > FUSED_ROWS_MAX \
            and casts_in_triton(x):
        return fp8_quant.quantize_rowwise(x, E4M3)
    return quantize(x, granularity)


def quantize_weight(weight: torch.Tensor, granularity: str, scale_dtype: torch.dtype):
    """(w_fp8, scale in scale_dtype) for storing, as the linear's granularity scales W: (1,) per
    tensor, (out, 1) per output channel or (ceil(out / 128), ceil(in / 128)) per tile.

    The scale is rounded *up* to scale_dtype and the weight quantized with that rounded scale, so
    the stored pair is self-consistent (w ~= w_fp8 * stored scale) and the max still fits.
    On the CPU, W is read in chunks of rows (weight_rows): each pass over a chunk stays in cache,
    which quantizes a 13824 x 5120 bf16 weight 5x faster than whole-tensor passes (the same numbers).
    """
    granularity = LINEAR_GRANULARITIES[granularity][1]
    chunks = weight_rows(weight)
    if granularity == "block":
        amax = torch.cat([block_amax(weight[rows], BLOCK) for rows in chunks])
    else:
        amax = torch.cat([abs_max(weight[rows]) for rows in chunks])
        amax = amax.amax().reshape(1) if granularity == "tensor" else amax
    scale = amax_to_scale(amax, E4M3)
    stored = scale.to(scale_dtype)
    stored = torch.where(stored.float() < scale, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    w_fp8 = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    for rows in chunks:
        covering = {"tensor": slice(None), "row": rows, "block": slice(rows.start // BLOCK, -(-rows.stop // BLOCK))}
        w_fp8[rows] = cast_with_scale(weight[rows], expand_blocks(stored[covering[granularity]], weight[rows].shape),
                                      E4M3)[0]
    return w_fp8, stored


CPU_CHUNK_VALUES = 1 << 18  # values of W quantized at a time on the CPU: 1 MB in float32


def weight_rows(weight: torch.Tensor) -> list[slice]:
    """W's rows in chunks of a multiple of BLOCK rows (a block scale's tile stays in one chunk):
    about CPU_CHUNK_VALUES each on the CPU, all of them at once elsewhere."""
    if weight.device.type != "cpu":
        return [slice(0, weight.shape[0])]
    rows = max(1, CPU_CHUNK_VALUES // max(1, weight.shape[-1]) // BLOCK) * BLOCK
    return [slice(start, min(start + rows, weight.shape[0])) for start in range(0, weight.shape[0], rows)]


def count_clipped(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """How many elements of x saturate when quantized with `scale` (an int64 scalar tensor)."""
    return (x.detach().float().abs() / scale.float() > FP8_MAX[fp8_dtype]).sum()


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() * expand_blocks(scale.float(), x_fp8.shape)


def fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    """y = (x_fp8 @ w_fp8^T) * x_scale * w_scale^T + bias, as cuBLASLt computes it.

    Products of two fp8 values are exact in fp32 and the sum is accumulated in fp32 (fast_accum's
    reduced-precision accumulation on Hopper is not emulated); the scales are applied to the fp32
    result, then the bias, then one rounding to out_dtype. Block scales vary along K: each operand
    is scaled first (cuBLASLt scales each K block's fp32 partial sum: the same terms, summed in
    another order).
    """
    if blockwise(w_scale, w_fp8):
        y = dequantize(x_fp8, x_scale) @ dequantize(w_fp8, w_scale).t()
    else:
        y = (x_fp8.float() @ w_fp8.float().t()) * x_scale.float() * w_scale.float().reshape(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum=False):
    """The FP8 linear entry point: checks its inputs, then runs the GEMM op (fp8_gemm).

    x_fp8 (..., K) e4m3 (e5m2 for gradients) with x_scale (1,) or (..., 1); w_fp8 (N, K) e4m3 with
    w_scale (1,) or (N, 1); or block scales, x_scale (..., ceil(K / 128)) with w_scale (ceil(N / 128),
    ceil(K / 128)). Any strides: the GEMM gets the row-major x and column-major w^T it needs.
    `fast_accum`: cuBLASLt's faster, less precise accumulation (CUDA, not with block scales; the
    reference accumulates in fp32).
    """
    if x_fp8.dtype not in (E4M3, E5M2) or w_fp8.dtype != E4M3:
        raise TypeError(f"fp8_linear takes an e4m3 (or, for gradients, e5m2) x and an e4m3 w, "
                        f"got x {x_fp8.dtype} and w {w_fp8.dtype}")
    if w_fp8.dim() != 2 or x_fp8.shape[-1] != w_fp8.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x_fp8.shape)} and w {tuple(w_fp8.shape)} do not match (w is (N, K))")
    tiles = block_count(w_fp8.shape[0]), block_count(w_fp8.shape[1])
    if w_scale.numel() not in (1, w_fp8.shape[0]) and tuple(w_scale.shape) != tiles:
        raise ValueError(f"fp8_linear: w_scale has shape {tuple(w_scale.shape)}, expected (1,), (N, 1) with "
                         f"N={w_fp8.shape[0]} or the tiles' {tiles}")
    x_scale_shapes = [(*x_fp8.shape[:-1], 1)] + ([(*x_fp8.shape[:-1], tiles[1])] if blockwise(w_scale, w_fp8) else [])
    if x_scale.numel() != 1 and tuple(x_scale.shape) not in x_scale_shapes:
        raise ValueError(f"fp8_linear: x_scale has shape {tuple(x_scale.shape)}, "
                         f"expected (1,) or {' or '.join(map(str, x_scale_shapes))}")
    route = gemm_route(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    if route in TRACED_ROUTES and torch.compiler.is_compiling():
        return gemm(route, x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum)
    return torch.ops.lowconv.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum)


def gemm_route(x_fp8, x_scale, w_fp8, w_scale, out_dtype) -> str:
    """Which GEMM computes an FP8 linear: "few_rows" (lowconv's Triton GEMM for a decode step's
    tokens), "scaled_mm" or "scaled_mm_blockwise" (torch._scaled_mm, where it takes the operands:
    scaled_mm_takes, blockwise_scaled_mm_takes), else "reference"."""
    has_rows = x_fp8.numel() > 0
    if blockwise(w_scale, w_fp8):
        takes = blockwise_scaled_mm_takes(x_fp8.device, *w_fp8.shape, has_rows, out_dtype)
        return "scaled_mm_blockwise" if takes else "reference"
    if fp8_small_m.takes(x_fp8, x_scale, w_fp8, w_scale, out_dtype):
        return "few_rows"
    rowwise = x_scale.numel() != 1 or w_scale.numel() != 1
    return "scaled_mm" if scaled_mm_takes(x_fp8.device, *w_fp8.shape, has_rows, rowwise, out_dtype) else "reference"


TRACED_ROUTES = ("scaled_mm", "scaled_mm_blockwise")  # aten ops: under torch.compile, not behind the custom op


def gemm(route, x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum):
    """The FP8 linear on the GEMM `route` names (gemm_route)."""
    if route == "few_rows":
        return fp8_small_m.fp8_gemm_rows(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum)
    if route == "scaled_mm":
        rowwise = x_scale.numel() != 1 or w_scale.numel() != 1
        return scaled_mm_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, rowwise, fast_accum)
    if route == "scaled_mm_blockwise":
        return scaled_mm_blockwise(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    return fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


@torch.library.custom_op("lowconv::fp8_gemm", mutates_args=())
def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """fp8_linear's GEMM, its inputs checked, on the GEMM gemm_route picks."""
    return gemm(gemm_route(x_fp8, x_scale, w_fp8, w_scale, out_dtype), x_fp8, x_scale, w_fp8, w_scale, bias,
                out_dtype, fast_accum)


@fp8_gemm.register_fake
def _(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum):
    return x_fp8.new_empty((*x_fp8.shape[:-1], w_fp8.shape[0]), dtype=out_dtype)


def block_count(size: int) -> int:
    return -(-size // BLOCK)


def blockwise(w_scale: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    """Whether W's scale is one per tile (not one, nor one per output channel)."""
    return w_scale.numel() != 1 and tuple(w_scale.shape) != (w_fp8.shape[0], 1) and w_scale.dim() == 2


def blockwise_scaled_mm_takes(device: torch.device, n: int, k: int, has_rows: bool, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm computes an (N, K) linear with block scales: cuBLASLt's 1x128 and
    128x128 modes on sm_90, K and N whole blocks, K's block count a multiple of 4 (the scales'
    16-byte alignment), a bf16 output."""
    return (device.type == "cuda" and has_rows and k % BLOCK == 0 and n % BLOCK == 0 and (k // BLOCK) % 4 == 0
            and out_dtype == torch.bfloat16 and cuda_capability(device.index) == (9, 0))


def scaled_mm_blockwise(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    """fp8_linear through torch._scaled_mm's block modes: x's scales (M, K / 128) laid out
    column-major (with M padded to a multiple of 4, its alignment), W's as (K / 128, N / 128); no
    fast accumulation (cuBLASLt has none with block scales). A bias is added to the rounded output
    in fp32 and rounded again (one rounding more than the reference)."""
    n, k = w_fp8.shape
    x2, scale_a = x_fp8.reshape(-1, k), x_scale.float().reshape(-1, k // BLOCK)
    m = x2.shape[0]
    if m % 4:
        x2 = torch.cat([x2, x2.new_zeros(-m % 4, k)])
        scale_a = torch.cat([scale_a, scale_a.new_ones(-m % 4, k // BLOCK)])
    y = torch._scaled_mm(x2.contiguous(), w_fp8.contiguous().t(), scale_a=scale_a.t().contiguous().t(),
                         scale_b=w_scale.float().t(), out_dtype=out_dtype)[:m]
    if bias is not None:
        y = (y.float() + bias.float()).to(out_dtype)
    return y.reshape(*x_fp8.shape[:-1], n)


def scaled_mm_takes(device: torch.device, n: int, k: int, has_rows: bool, rowwise: bool,
                    out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm computes an (N, K) FP8 linear: K and N multiples of 16, some rows,
    on CUDA with an FP8 GPU (sm_89+) and, with row scales, a bf16 output (what cuBLASLt's rowwise
    scaling writes). Not on the CPU: torch's CPU kernel took 4.3 s for a 256 x 1024 x 1024 product
    that the reference (an fp32 matmul, the same numbers to summation order) does in 7 ms."""
    if k % 16 or n % 16 or not has_rows:
        return False
    if device.type == "cuda":
        return cuda_capability(device.index) >= (8, 9) and (not rowwise or out_dtype == torch.bfloat16)
    return False


def scaled_mm_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, rowwise, fast_accum):
    """fp8_linear through torch._scaled_mm. Row scales are (M, 1) and (1, N), a tensor scale
    expanded when the other operand's are per row. The bias goes into the GEMM's epilogue when it
    is in the fp16/bf16 output dtype (added in fp32 before the one rounding, as the reference);
    otherwise the GEMM returns fp32 and the bias is added before rounding."""
    n, k = w_fp8.shape
    x2 = x_fp8.reshape(-1, k).contiguous()  # row-major mat1
    if rowwise:
        scale_a = x_scale.float().reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
        scale_b = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
    else:  # one-element scales of any shape
        scale_a, scale_b = x_scale.float(), w_scale.float()
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.float16, torch.bfloat16)
    y = torch._scaled_mm(x2, w_fp8.contiguous().t(), scale_a=scale_a, scale_b=scale_b, bias=bias if fused_bias else None,
                         out_dtype=out_dtype if bias is None or fused_bias else torch.float32,
                         use_fast_accum=fast_accum)
    if bias is not None and not fused_bias:
        y = (y + bias.float()).to(out_dtype)
    return y.reshape(*x_fp8.shape[:-1], n)


def fp8_frozen_linear(x, x_scale, granularity, w_fp8, w_scale, bias, fast_accum=False, clipped=None, alone=False):
    """Inference: y = x W^T + b with x quantized to e4m3 (with a fixed x_scale, else dynamically at
    granularity; clipped values counted into `clipped`; `alone`: see quantize_activation) and W a
    frozen e4m3 weight."""
    x_fp8, x_scale = quantize_activation(x, granularity, x_scale, clipped, alone)
    return fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, x.dtype, fast_accum)


class Fp8FrozenLinearFunction(torch.autograd.Function):
    """Inference: y = x W^T + b with x quantized to e4m3 and W a frozen e4m3 weight.

    Differentiable in x so that a model can train around the FP8 layer: x's quantization is
    straight-through, dx = dy @ W (dequantized), dbias = dy summed. (Autograd through the e4m3
    cast itself would round dy to e4m3 without a scale.)
    """

    @staticmethod
    def forward(ctx, x, x_scale, granularity, w_fp8, w_scale, bias, fast_accum=False, clipped=None, alone=False):
        ctx.save_for_backward(w_fp8, w_scale)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        return fp8_frozen_linear(x, x_scale, granularity, w_fp8, w_scale, bias, fast_accum, clipped, alone)

    @staticmethod
    def backward(ctx, grad):
        w_fp8, w_scale = ctx.saved_tensors
        x_dtype, bias_dtype = ctx.dtypes
        grad_x = (grad.float() @ dequantize(w_fp8, w_scale)).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.float().reshape(-1, grad.shape[-1]).sum(0).to(bias_dtype) if ctx.needs_input_grad[5] else None
        return grad_x, None, None, None, None, grad_bias, None, None, None
