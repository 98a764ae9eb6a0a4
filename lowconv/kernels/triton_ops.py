"""Triton kernels as torch.library ops: `triton_op` and `wrap` are torch.library's triton_op and
wrap_triton, except under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).

torch.compile sees into a triton_op: its fake implementation, and inductor's lowering, run the op's
body with each kernel launch wrapped by wrap_triton. The interpreter's kernels are not JIT
functions: wrap_triton hands them back as they are (torch 2.13) or refuses them (torch 2.11), and
they cannot run on fake tensors. So under the interpreter an op is a custom_op with the same body,
opaque to torch.compile, whose fake implementation is that body with no kernel launched (`wrap`
launches nothing given a fake tensor).

Launch kernels through `wrap` inside an op's body only: outside one, wrap_triton goes through its
higher-order op on every launch, about a millisecond of host time.
"""
import torch
from torch._subclasses.fake_tensor import is_fake
from triton import knobs

INTERPRETED = knobs.runtime.interpret  # what @triton.jit read when it made the kernels


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), for grids: triton.cdiv, called from Python, costs about 1.6 us a call
    (unwrapping its arguments) where this costs 0.02, and takes torch.compile's symbolic sizes."""
    return -(-a // b)


def triton_op(name: str, *, mutates_args):
    """Decorator: the function as the op `name` (torch.library.triton_op; see the module doc)."""
    if not INTERPRETED:
        return torch.library.triton_op(name, mutates_args=mutates_args)

    def register(fn):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        return op
    return register


def wrap(kernel):
    """wrap_triton(kernel): launched as kernel[grid](...)."""
    return InterpretedKernel(kernel) if INTERPRETED else torch.library.wrap_triton(kernel)


class InterpretedKernel:
    """An interpreted kernel, launched unless an argument is a fake tensor."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not any(isinstance(a, torch.Tensor) and is_fake(a) for a in (*args, *kwargs.values())):
                self.kernel[grid](*args, **kwargs)
        return launch
