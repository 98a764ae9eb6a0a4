"""lowconv's Triton kernels as torch.library custom ops, `torch.ops.lowconv.<name>`.

`triton_op(name, fake)` registers a function whose launches go through `torch.library.wrap_triton`
as the op `lowconv::name` (torch.library.triton_op), with `fake` (a function of the same arguments
that only allocates the outputs) as its fake implementation. Compiled graphs then hold the op
whole (dynamo) and inductor sees its Triton kernels; eagerly it launches them.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) a kernel is Python that reads its
tensors' data, which fake and functional tensors do not have: there the op is kept whole through
functionalization too (no decomposition into its kernels), so that a compiled graph calls the op,
which then interprets its kernels on real tensors.
"""
import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode
from triton.runtime.interpreter import InterpretedFunction


def triton_op(name: str, fake, *kernels):
    """A decorator: the function as the custom op `lowconv::name` (see the module doc). `kernels`
    are the Triton kernels it launches, to tell whether they run interpreted."""
    def register(fn):
        op = torch.library.triton_op(f"lowconv::{name}", fn, mutates_args=())
        op.register_fake(fake)
        if any(isinstance(kernel, InterpretedFunction) for kernel in kernels):
            op.register_torch_dispatch(FunctionalTensorMode, kept_whole)
        return op
    return register


def kept_whole(mode, op, types, args, kwargs):
    """Functionalization's rule for an op that it is to keep as one call."""
    return mode.__torch_dispatch__(op, types, args, kwargs)
