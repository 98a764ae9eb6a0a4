"""Triton dot products at a stated precision, shared by the attention kernels."""
import torch
import triton
import triton.language as tl


def dot_precision(dtype, is_cuda):
    """_dot's PRECISION for operands of `dtype`: tf32x3 for fp32 (about fp32 accuracy), else
    "tf32", which fp16/bf16 operands ignore; "upcast" for bf16 in the interpreter."""
    if dtype == torch.float32:
        return "tf32x3"
    return "tf32" if dtype == torch.float16 or is_cuda else "upcast"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. PRECISION "upcast" (the interpreter with bf16, whose dot
    multiplies bf16's raw bits) multiplies the same values in fp32, where their products are
    exact: the same numbers as a bf16 MMA."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, input_precision=PRECISION)
