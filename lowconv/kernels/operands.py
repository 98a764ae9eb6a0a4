"""Tensors as the kernels take them."""
import torch


def as_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous: t itself when it already is. (At small sizes a call's host time
    counts, and a no-op .to() or .contiguous() still goes through the dispatcher.)"""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
