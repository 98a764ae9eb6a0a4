"""Tensors as the kernels take them, and whether a call on them needs autograd."""
import torch


def as_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous: t itself when it already is. (At small sizes a call's host time
    counts, and a no-op .to() or .contiguous() still goes through the dispatcher.)"""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def needs_autograd(*tensors) -> bool:
    """Whether a call on these tensors (None allowed) records a graph: otherwise the kernels run
    without their autograd Function, whose node costs host time that small calls are bound by."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
