"""FP8 training's linear (kernels/fp8.py states the scales and quantizers): y = x W^T + b with x
and W in e4m3 forward and grad_output in e5m2 backward, each GEMM an FP8 GEMM (fp8_linear), and the
transposed operands the backward's GEMMs take written by the forward's quantizers.
"""
import torch
from torch.autograd.function import once_differentiable

from lowconv.kernels import fp8_quant
from lowconv.kernels.fp8 import (E4M3, E5M2, LINEAR_GRANULARITIES, fp8_linear, quantize_activation,
                                 quantize_tensorwise, quantizes_in_triton)


def quantize_for_training(x2: torch.Tensor, granularity: str, scale: torch.Tensor | None = None,
                          clipped: torch.Tensor | None = None):
    """(x_fp8, x_fp8_t, scale) of a 2D x in e4m3 for training's GEMMs: as quantize_activation, and
    x_fp8_t (K, M), the transposed layout the backward GEMM needs, written by a transposing Triton
    cast with a tensor scale (one more read of x); elsewhere a transposed view (fp8_linear copies it)."""
    x_fp8, scale = quantize_activation(x2, granularity, scale, clipped)
    if quantizes_in_triton(x2) and scale.numel() == 1:
        return x_fp8, fp8_quant.transposed_with_scale(x2, scale, E4M3), scale
    return x_fp8, x_fp8.t(), scale


def quantize_transposed(g: torch.Tensor, fp8_dtype: torch.dtype, mul: torch.Tensor, mul_axis: str):
    """(g_fp8_t (N, M), scale): the tensorwise quantization of a 2D g (times mul), transposed; the
    Triton kernel writes that layout directly, elsewhere it is a transposed view."""
    if quantizes_in_triton(g):
        return fp8_quant.quantize_tensorwise_transposed(g, fp8_dtype, mul, mul_axis)
    g_fp8, scale = quantize_tensorwise(g, fp8_dtype, mul, mul_axis)
    return g_fp8.t(), scale


class Fp8LinearFunction(torch.autograd.Function):
    """Training: y = x W^T + b with x and W in e4m3 forward, grad_output in e5m2 backward.

    x_scale: a fixed dequant scale for x (static or delayed scaling), or None to quantize x
    dynamically at `granularity`; W is always quantized dynamically (it changes every step).
    The forward quantizations also write x^T and W^T (quantize_for_training), which the backward's
    FP8 GEMMs take: dX = dY W needs W^T as its column-major operand, dW = dY^T x needs x^T, and
    dY^T comes transposed out of its quantizer. A scale along a GEMM's reduced dim (W's per-row
    scales in dX, x's per-row scales in dW) cannot be applied to its output, so it is folded into
    dY as dY is quantized (one e5m2 tensor scale per GEMM). dbias comes from the unquantized
    grad, as in TransformerEngine.
    w_fp8, w_scale: W already in e4m3, as `granularity` scales W (FSDP2's e4m3 all-gather,
    fp8_all_gather.py), computed with as they are (W^T a transposed view); `weight` then only
    gives the gradient's dtype and shape.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale, granularity, fast_accum=False, clipped=None, w_fp8=None,
                w_scale=None):
        x_fp8, x_t, x_scale = quantize_for_training(x.reshape(-1, x.shape[-1]), granularity, x_scale, clipped)
        if w_fp8 is None:
            w_fp8, w_t, w_scale = quantize_for_training(weight, LINEAR_GRANULARITIES[granularity][1])
        else:
            w_t = w_fp8.t()
        ctx.save_for_backward(x_t, x_scale, w_t, w_scale)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        y = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, x.dtype, fast_accum)
        # Not a view of y (as aten's linear, whose output is no view either): FSDP2's pre-backward
        # hook on a module's output is lost to an in-place op on a view. Not -1: an empty batch has
        # no size to infer.
        return torch.ops.aten._unsafe_view(y.contiguous(), (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    @once_differentiable  # the backward's FP8 GEMMs and casts have no derivatives of their own
    def backward(ctx, grad):
        x_t, x_scale, w_t, w_scale = ctx.saved_tensors
        x_dtype, w_dtype, bias_dtype = ctx.dtypes
        needs_x, needs_w, needs_bias = ctx.needs_input_grad[:3]
        g = grad.reshape(-1, grad.shape[-1])  # (M, N)
        unit = torch.ones(1, device=g.device)
        grad_x = grad_w = None
        if needs_x:  # dX (M, K) = (dY * w_scale^T) (M, N) @ W_fp8 (N, K); W^T (K, N) is fp8_linear's w
            per_column = w_scale.float().reshape(-1).expand(g.shape[1])  # W's row scales (or its one scale)
            g_fp8, g_scale = quantize_tensorwise(g, E5M2, per_column, "columns")
            grad_x = fp8_linear(g_fp8, g_scale, w_t, unit, None, x_dtype).reshape(*grad.shape[:-1], w_t.shape[0])
        if needs_w:  # dW (N, K) = (dY * x_scale)^T (N, M) @ x_fp8 (M, K); x^T (K, M) is fp8_linear's w
            per_row = x_scale.float().reshape(-1).expand(g.shape[0])  # x's row scales (or its one scale)
            g_t, g_scale = quantize_transposed(g, E5M2, per_row, "rows")
            grad_w = fp8_linear(g_t, g_scale, x_t, unit, None, w_dtype)
        grad_bias = g.float().sum(0).to(bias_dtype) if needs_bias else None
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None
