"""Triton FP8 quantization on the GPU: the numerics of fp8.py's torch quantizers in fewer passes.

- per tensor: pass 1 takes each program's amax into one (1,) buffer with an atomic max (on the
  int32 bits: non-negative floats order as their bits), pass 2 reads it (the scale never goes
  through the host) and casts, a program per block; x is read twice, written once.
- per row: one kernel, each program a few whole rows (amax loop, then cast loop; the second read
  of a row comes from L2).
- with a given scale (static or delayed scaling): one pass that also counts the clipped values.
- transposed (training's GEMM operands): a tiled cast that writes x^T (K, M) of a 2D x.
- per row after an activation (an FP8 layer whose input an activation makes, fp8.py
  quantize_rows_after): a program per row computes act(x) [* up] (`up` the gated half), rounded
  to x's dtype as the model's own ops round it, its amax and the cast; h is never written. A row
  of up to ONE_PASS_ROWS_MAX values stays in registers; a longer one is computed twice, for the
  amax and for the cast (its second read from L1 / L2).
The per-tensor quantizers may multiply x by a vector along its columns or rows first (the
backward's folding of the forward's row scales into the gradient) without materializing it.

Each entry point is a torch.library op (kernels/triton_ops.py: `torch.ops.lowconv.fp8_*`), so a
compiled graph may hold it; the FP8 layers call them eagerly, and under torch.compile quantize with
torch ops instead, which inductor fuses into the op that produces x (kernels/fp8.py).

Division is IEEE (div_rn) and the fp32 -> fp8 cast rounds to nearest even and saturates, as
torch's `(x.float() / scale).clamp(-max, max).to(fp8)`, on sm_90 (one cvt.rn.satfinite; Triton
casts through fp16 on sm_89, a double rounding, so fp8.py runs the torch reference there): the
outputs equal the torch reference's bit for bit (but for the activation before a row
quantization: its exp, erf and SiLU's division are not torch's to the last bit, and its cast
multiplies by the scale's reciprocal). NaN inputs stay NaN in their element and do not enter the
amax (the reference skips them too). Triton's interpreter does not emulate fp8 casts faithfully:
the casts are checked on the GPU, the rest also in the interpreter.
"""
import torch
import triton
import triton.language as tl

from lowconv.kernels.triton_ops import cdiv, triton_op, wrap

FP8_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
BLOCK = 2048  # elements per program step: 8 per thread at 8 warps (16-byte loads of bf16)
# The per-tensor amax pass: programs, each looping over its share of blocks (an atomic each).
# BLOCK and MAX_PROGRAMS: scripts/tune_fp8_quant.py on an H100 (BENCHMARKS.md). 1056 = 8 programs
# of 8 warps on each of the H100's 132 SMs: one wave.
MAX_PROGRAMS = 1056
TILE_2D = (64, 128)  # the transposing cast: rows x columns of x per program
MUL_AXES = {None: 0, "columns": 1, "rows": 2}  # the kernels' MUL: no multiplier, mul[column], mul[row]


@triton.jit
def _load_scaled(x, mul, offs, ok, column, row, MUL: tl.constexpr):
    """x[offs] in fp32, times mul[column] or mul[row] when MUL says so."""
    v = tl.load(x + offs, mask=ok, other=0.0).to(tl.float32)
    if MUL == 1:
        v = v * tl.load(mul + column, mask=ok, other=0.0)
    elif MUL == 2:
        v = v * tl.load(mul + row, mask=ok, other=0.0)
    return v


@triton.jit
def _load_block(x, mul, block, N, K, MUL: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """(offsets, mask, fp32 values) of block `block` of a flat row-major (N / K, K) x. Offsets are
    int64 only when WIDE (2^31 or more, see _wide): 64-bit division (the multiplier's index) is slow."""
    offs = (block.to(tl.int64) if WIDE else block) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    if MUL == 1:
        v = _load_scaled(x, mul, offs, ok, offs % K, 0, MUL)
    elif MUL == 2:
        v = _load_scaled(x, mul, offs, ok, 0, offs // K, MUL)
    else:
        v = _load_scaled(x, mul, offs, ok, 0, 0, MUL)
    return offs, ok, v


@triton.jit
def _cast(v, scale, FP8_MAX: tl.constexpr, FP8: tl.constexpr):
    return tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(FP8)


@triton.jit
def _scale_from_amax(amax_bits, FP8_MAX: tl.constexpr):
    """amax / FP8_MAX from the amax pass's bits (1 for an all-zero x)."""
    amax = tl.load(amax_bits).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)


@triton.jit
def _amax_kernel(x, mul, amax_bits, N, K, STEPS, MUL: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """amax_bits (int32, zeroed by the caller) = max of itself and the bits of max |x| over the
    program's STEPS blocks, NaN skipped."""
    pid = tl.program_id(0)
    amax = tl.zeros((BLOCK,), tl.float32)
    for step in range(STEPS):
        _, _, v = _load_block(x, mul, pid * STEPS + step, N, K, MUL, WIDE, BLOCK)
        a = tl.abs(v)
        amax = tl.maximum(amax, tl.where(a == a, a, 0.0))
    tl.atomic_max(amax_bits, tl.max(amax, 0).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _cast_kernel(x, mul, out, scale, amax_bits, clipped, N, K,
                 MUL: tl.constexpr, WIDE: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, COUNT: tl.constexpr,
                 FP8_MAX: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """out = saturate(x / scale) over the program's block.

    SCALE_FROM_AMAX: the scale is amax / FP8_MAX (1 for an all-zero x) from the amax pass,
    written to `scale` by program 0. Otherwise `scale` is given and COUNT adds the number of
    clipped values to `clipped`."""
    pid = tl.program_id(0)
    if SCALE_FROM_AMAX:
        s = _scale_from_amax(amax_bits, FP8_MAX)
        if pid == 0:
            tl.store(scale, s)
    else:
        s = tl.load(scale)
    offs, ok, v = _load_block(x, mul, pid, N, K, MUL, WIDE, BLOCK)
    tl.store(out + offs, _cast(v, s, FP8_MAX, FP8), mask=ok)
    if COUNT:
        count = tl.sum((tl.math.div_rn(tl.abs(v), s) > FP8_MAX).to(tl.int32), 0).to(tl.int64)
        tl.atomic_add(clipped, count, mask=count > 0)  # most programs clip nothing: no atomic


@triton.jit
def _cast_transposed_kernel(x, mul, out_t, scale, amax_bits, M, K,
                            MUL: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, FP8_MAX: tl.constexpr,
                            FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """out_t (K, M) = saturate(x / scale)^T on (BLOCK_M, BLOCK_K) tiles of a row-major (M, K) x,
    the scale given or (SCALE_FROM_AMAX) from the amax pass, written by program (0, 0).
    Only the transposed layout: with a second store of the row layout, fp32 inputs came out wrong
    in the transposed one on the H100 (triton 3.6); the row layout comes from _cast_kernel."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    if SCALE_FROM_AMAX:
        s = _scale_from_amax(amax_bits, FP8_MAX)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale, s)
    else:
        s = tl.load(scale)
    row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows, cols = row[:, None], col[None, :]
    ok = (rows < M) & (cols < K)
    v = tl.load(x + rows.to(tl.int64) * K + cols, mask=ok, other=0.0).to(tl.float32)
    # The multiplier as a vector, broadcast after loading (H100: a masked load of (1, BLOCK_K)
    # pointers under a (BLOCK_M, BLOCK_K) mask next to this kernel's transposed store read garbage).
    if MUL == 1:
        v = v * tl.load(mul + col, mask=col < K, other=0.0)[None, :]
    elif MUL == 2:
        v = v * tl.load(mul + row, mask=row < M, other=0.0)[:, None]
    tl.store(out_t + cols.to(tl.int64) * M + rows, _cast(v, s, FP8_MAX, FP8), mask=ok)


@triton.jit
def _rowwise_kernel(x, out, scales, M, K, FP8_MAX: tl.constexpr, FP8: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row of a row-major (M, K) x: scale = amax / FP8_MAX (1 for a zero row), out = saturate(x / scale)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows[:, None] < M
    base = rows[:, None].to(tl.int64) * K
    amax = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        v = tl.load(x + base + cols, mask=row_ok & (cols < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    amax_row = tl.max(amax, 1)
    s = tl.where(amax_row > 0, tl.math.div_rn(amax_row, FP8_MAX), 1.0)
    tl.store(scales + rows, s, mask=rows < M)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        ok = row_ok & (cols < K)
        v = tl.load(x + base + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + base + cols, _cast(v, s[:, None], FP8_MAX, FP8), mask=ok)


def _prepare(x: torch.Tensor, mul: torch.Tensor | None):
    """Contiguous x, its row length K and the multiplier as an fp32 vector (or a dummy: x)."""
    x = x.contiguous()
    k = x.shape[-1] if x.dim() else 1
    return x, k, x if mul is None else mul.float().contiguous().reshape(-1)


def _programs(n: int, max_programs: int):
    """(programs, steps per program) of a pass over n elements in blocks."""
    blocks = max(1, cdiv(n, BLOCK))
    programs = min(blocks, max_programs)
    return programs, cdiv(blocks, programs)


def _wide(programs: int, steps: int) -> bool:
    """Whether the blocks' offsets (up to the last, partly empty block) need int64."""
    return programs * steps * BLOCK >= 2 ** 31


def _amax_bits(x, k, mul, mul_axis):
    """Pass 1 of per-tensor quantization: max |x| (times mul, NaN skipped) as the int32 bits of
    an fp32, in a (1,) tensor."""
    programs, steps = _programs(x.numel(), MAX_PROGRAMS)
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    wrap(_amax_kernel)[(programs,)](x, mul, amax_bits, x.numel(), k, steps, MUL=mul_axis,
                                    WIDE=_wide(programs, steps), BLOCK=BLOCK, num_warps=8)
    return amax_bits


def _launch_cast(x, k, mul, mul_axis, fp8_dtype, scale, amax_bits, clipped):
    """The cast pass, a program per block: with amax_bits, the scale comes from it (and is written
    to `scale`); else `scale` is given."""
    blocks = max(1, cdiv(x.numel(), BLOCK))  # one program even for an empty x: it writes the scale
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    wrap(_cast_kernel)[(blocks,)](x, mul, out, scale, scale if amax_bits is None else amax_bits,
                                  scale if clipped is None else clipped, x.numel(), k,
                                  MUL=mul_axis, WIDE=_wide(blocks, 1), SCALE_FROM_AMAX=amax_bits is not None,
                                  COUNT=clipped is not None, FP8_MAX=torch.finfo(fp8_dtype).max, FP8=FP8_TL[fp8_dtype],
                                  BLOCK=BLOCK, num_warps=8)
    return out


def _launch_cast_transposed(x, mul, mul_axis, fp8_dtype, scale, amax_bits):
    """x_fp8_t (K, M) of a 2D x. Every grid has a program (0, 0), so the scale is written even for
    an empty x."""
    m, k = x.shape
    out_t = torch.empty(k, m, dtype=fp8_dtype, device=x.device)
    grid = (max(1, cdiv(m, TILE_2D[0])), max(1, cdiv(k, TILE_2D[1])))
    wrap(_cast_transposed_kernel)[grid](x, mul, out_t, scale, scale if amax_bits is None else amax_bits, m, k,
                                        MUL=mul_axis, SCALE_FROM_AMAX=amax_bits is not None,
                                        FP8_MAX=torch.finfo(fp8_dtype).max, FP8=FP8_TL[fp8_dtype],
                                        BLOCK_M=TILE_2D[0], BLOCK_K=TILE_2D[1], num_warps=8)
    return out_t


def quantize_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor | None = None,
                        mul_axis: str | None = None):
    """(x_fp8, scale (1,)) of x (times mul along mul_axis, "columns" | "rows"), in two passes and no
    host sync."""
    return torch.ops.lowconv.fp8_quantize_tensorwise(x, fp8_dtype, mul, MUL_AXES[mul_axis])


@triton_op("lowconv::fp8_quantize_tensorwise", mutates_args=())
def _quantize_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor | None,
                         mul_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, k, mul = _prepare(x, mul)
    amax_bits = _amax_bits(x, k, mul, mul_axis)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    return _launch_cast(x, k, mul, mul_axis, fp8_dtype, scale, amax_bits, None), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        clipped: torch.Tensor | None = None):
    """(x_fp8, scale) with a given (1,) dequant scale, in one pass; `clipped` (an int64 scalar
    tensor) gets the number of saturated values added."""
    if clipped is not None and clipped.dtype != torch.int64:
        raise TypeError(f"fp8 quantization: the clipped counter must be int64, got {clipped.dtype}")
    scale = scale.float().reshape(1).contiguous()
    return torch.ops.lowconv.fp8_quantize_with_scale(x, scale, fp8_dtype, clipped), scale


@triton_op("lowconv::fp8_quantize_with_scale", mutates_args=("clipped",))
def _quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                         clipped: torch.Tensor | None) -> torch.Tensor:
    x, k, no_mul = _prepare(x, None)
    return _launch_cast(x, k, no_mul, MUL_AXES[None], fp8_dtype, scale, None, clipped)


def quantize_tensorwise_transposed(x: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor | None = None,
                                   mul_axis: str | None = None):
    """(x_fp8_t (K, M), scale (1,)) of a 2D x (times mul): quantize_tensorwise's values, transposed."""
    return torch.ops.lowconv.fp8_quantize_tensorwise_transposed(x, fp8_dtype, mul, MUL_AXES[mul_axis])


@triton_op("lowconv::fp8_quantize_tensorwise_transposed", mutates_args=())
def _quantize_tensorwise_transposed(x: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor | None,
                                    mul_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, k, mul = _prepare(x, mul)
    amax_bits = _amax_bits(x, k, mul, mul_axis)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    return _launch_cast_transposed(x, mul, mul_axis, fp8_dtype, scale, amax_bits), scale


def transposed_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8_t (K, M) of a 2D x with a given (1,) scale (one that quantize_tensorwise or
    quantize_with_scale returned for x): the same values, transposed."""
    return torch.ops.lowconv.fp8_transposed_with_scale(x, scale.float().reshape(1).contiguous(), fp8_dtype)


@triton_op("lowconv::fp8_transposed_with_scale", mutates_args=())
def _transposed_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    x, _, no_mul = _prepare(x, None)
    return _launch_cast_transposed(x, no_mul, MUL_AXES[None], fp8_dtype, scale, None)


def quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype):
    """(x_fp8, scale (..., 1)): one scale per row of x, in one kernel."""
    return torch.ops.lowconv.fp8_quantize_rowwise(x, fp8_dtype)


@triton_op("lowconv::fp8_quantize_rowwise", mutates_args=())
def _quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, m, k, out, scales = _row_outputs(x, fp8_dtype)
    if m == 0 or k == 0:
        return out, scales.fill_(1.0)
    block_k = min(triton.next_power_of_2(k), BLOCK)
    block_m = max(1, BLOCK * 2 // block_k)  # ~4096 elements per program step
    wrap(_rowwise_kernel)[(cdiv(m, block_m),)](x, out, scales, m, k, FP8_MAX=torch.finfo(fp8_dtype).max,
                                               FP8=FP8_TL[fp8_dtype], BLOCK_M=block_m, BLOCK_K=block_k, num_warps=8)
    return out, scales


def _row_outputs(x: torch.Tensor, fp8_dtype: torch.dtype):
    """(contiguous x, its rows m, their length k, the e4m3 output, the (..., 1) fp32 scales) of a
    per-row quantization."""
    x = x.contiguous()
    k = x.shape[-1] if x.dim() else 1
    m = x.numel() // max(k, 1)
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    return x, m, k, out, torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)


ROW_ACTIVATIONS = {"silu": 0, "gelu": 1}  # what quantize_rows_after's kernel computes before the cast
# quantize_rows_after's kernel holds a row of up to this many values in registers (64 values a
# thread, and 64 of up, at 8 warps) and reads it once: Llama-8B's 14336-wide SiLU * up at 16384
# rows in 275 us on an H200, inductor's fusion 602 us. Longer rows go over the row twice in chunks
# of ROWS_AFTER_BLOCK, the second loop backwards, so that it starts on the chunks the first read
# last, still in L1 / L2 (399 us at that shape). A persistent grid (132 to 528 programs, each
# looping over rows) took 750-2500 us: too few bytes in flight (BENCHMARKS.md).
ONE_PASS_ROWS_MAX = 16384
ROWS_AFTER_BLOCK = 2048


@triton.jit
def _activation(v, ACT: tl.constexpr):
    """SiLU (x / (1 + e^-x)) or GELU (x / 2 * (1 + erf(x / sqrt 2))) of fp32 v. SiLU divides
    with the fast (2-ulp) division: IEEE division took a quarter of the kernel's time, and exp is
    already not torch's to the last bit."""
    if ACT == 0:
        return v / (1.0 + tl.exp(-v))
    return 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))


@triton.jit
def _activated(x, up, offs, ok, ACT: tl.constexpr, GATED: tl.constexpr, EVICT: tl.constexpr):
    """act(x[offs]) [* up[offs]] in fp32, each op rounded to x's dtype as the model's own ops round it."""
    v = tl.load(x + offs, mask=ok, other=0.0, eviction_policy=EVICT)
    h = _activation(v.to(tl.float32), ACT).to(v.dtype)
    if GATED:
        u = tl.load(up + offs, mask=ok, other=0.0, eviction_policy=EVICT)
        h = (h.to(tl.float32) * u.to(tl.float32)).to(v.dtype)
    return h.to(tl.float32)


@triton.jit
def _amax_to_row_scale(a, row, scales, FP8_MAX: tl.constexpr):
    """The row's scale, amax(a) / FP8_MAX (1 for a zero row; NaN skipped), stored; returns its
    reciprocal, which the cast multiplies by, as torchao's casts do. At Llama-8B's MLP (H200) the
    kernel takes 275 us; dividing each value (IEEE) made it 442-545 us, and one value in 2000 lands
    one e4m3 step from where torch's division puts it; a tl.where that skipped NaN made it 429 us."""
    amax = tl.max(a, 0)  # max.f32 gives the number of a NaN and a number: NaN is skipped
    s = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    tl.store(scales + row, s)
    return tl.math.div_rn(1.0, s)


@triton.jit
def _cast_by_reciprocal(v, reciprocal, FP8_MAX: tl.constexpr, FP8: tl.constexpr):
    return tl.clamp(v * reciprocal, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(FP8)


@triton.jit
def _activation_rows_kernel(x, up, out, scales, K, ACT: tl.constexpr, GATED: tl.constexpr, ONE_PASS: tl.constexpr,
                            FP8_MAX: tl.constexpr, FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row r: h = act(x[r]) [* up[r]]; scale = amax(h) / FP8_MAX; out[r] = saturate(h * (1 / scale)).
    ONE_PASS: the row is one block, h stays in registers. Otherwise two loops over the row's
    blocks: the first keeps its reads in L2 for the second, which evicts them."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * K
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_K)
        h = _activated(x, up, base + cols, cols < K, ACT, GATED, "")
        r = _amax_to_row_scale(tl.abs(h), row, scales, FP8_MAX)
        tl.store(out + base + cols, _cast_by_reciprocal(h, r, FP8_MAX, FP8), mask=cols < K)
    else:
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(_activated(x, up, base + cols, cols < K, ACT, GATED, "evict_last")))
        r = _amax_to_row_scale(amax, row, scales, FP8_MAX)
        chunks = tl.cdiv(K, BLOCK_K)
        for i in range(0, chunks):
            cols = (chunks - 1 - i) * BLOCK_K + tl.arange(0, BLOCK_K)
            h = _activated(x, up, base + cols, cols < K, ACT, GATED, "evict_first")
            tl.store(out + base + cols, _cast_by_reciprocal(h, r, FP8_MAX, FP8), mask=cols < K)


def quantize_rows_after(x: torch.Tensor, activation: str, up: torch.Tensor | None, fp8_dtype: torch.dtype):
    """(e4m3 rows, scales (..., 1)) of act(x) [* up] (up of x's shape and dtype)."""
    return torch.ops.lowconv.fp8_quantize_rows_after(x, ROW_ACTIVATIONS[activation], up, fp8_dtype)


@triton_op("lowconv::fp8_quantize_rows_after", mutates_args=())
def _quantize_rows_after(x: torch.Tensor, activation: int, up: torch.Tensor | None,
                         fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, m, k, out, scales = _row_outputs(x, fp8_dtype)
    if m == 0 or k == 0:
        return out, scales.fill_(1.0)
    one_pass = k <= ONE_PASS_ROWS_MAX
    block_k = triton.next_power_of_2(k) if one_pass else ROWS_AFTER_BLOCK
    gated = up is not None  # (up may be x itself: SiLU(x) * x)
    wrap(_activation_rows_kernel)[(m,)](x, up.contiguous() if gated else x, out, scales, k, ACT=activation, GATED=gated,
                                        ONE_PASS=one_pass, FP8_MAX=torch.finfo(fp8_dtype).max, FP8=FP8_TL[fp8_dtype],
                                        BLOCK_K=block_k, num_warps=max(1, min(8, block_k // 256)))
    return out, scales
