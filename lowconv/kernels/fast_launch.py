"""Launching a Triton kernel again without Triton's per-call argument binding.

`kernel[grid](...)` binds and specializes every argument, builds a cache key and checks hooks on
each call. On one of the lent H100 machines' hosts, for block attention's forward kernel (~30
arguments), that took 23 us per launch against 7 us for the compiled kernel's own launcher
(2026-11-22, BENCHMARKS.md issue 7). Attention at small sizes launches three kernels per
training step and is host-bound.

`launch` goes through Triton the first time it sees a specialization and keeps the compiled
kernel under a key at least as fine as Triton's own: each tensor's dtype and whether its address
is 16-byte aligned; each int's type by range and whether it is 1 or a multiple of 16 (`_int_key`);
bools, floats and None by kind; the constexprs by name and repr (1, True and 1.0 differ, as they
do to Triton); Gluon's tensor descriptors by dtype, block shape, layout and padding (what Triton
puts in their type; their shape and strides are run-time values); the launch options. On a hit it
calls the compiled kernel's launcher directly: it launches what Triton would. Arguments of any
other kind, and kernels with pre-run hooks, always go through Triton; so does everything under
TRITON_INTERPRET=1 (there is no compiled kernel).
Not followed on a hit: Triton's debug and instrumentation settings (TRITON_DEBUG, knobs) changed
after the kernel's first launch in the process (reading them costs two environment lookups per
launch), and its check that the globals a kernel reads have not changed since it was compiled.
"""
import torch
from torch.nn import Parameter
from triton import knobs
from triton.compiler import CompiledKernel
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import JITFunction, driver

# (id of the kernel, device, options, constexprs, each argument's key) -> (the kernel, compiled
# kernel, its constexprs' names in signature order). The entry holds the kernel, so no other object
# can take its id while the entry lives. Bounded; a cache of what Triton compiled, so clearing it
# loses nothing.
_COMPILED: dict = {}
CACHE_ENTRIES = 1024
I32, I64 = range(-2 ** 31, 2 ** 31), range(-2 ** 63, 2 ** 63)


def _int_key(value: int) -> str:
    """Triton's specialization of an int argument: its type by range, and whether it is 1 or a
    multiple of 16 (kept even where Triton does not specialize: finer, so still safe)."""
    spec = "1" if value == 1 else "D" if value % 16 == 0 else ""
    return spec if value in I32 else ("i64" if value in I64 else "u64") + spec


def _arg_key(arg):
    """What Triton specializes an argument on, or TypeError for kinds left to Triton."""
    kind = type(arg)
    if kind is torch.Tensor or kind is Parameter:
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is int:
        return _int_key(arg)
    if kind is bool:
        return kind, arg
    if arg is None or kind is float:
        return kind
    if kind is TensorDescriptor:
        return kind, arg.base.dtype, *arg.block_shape, arg.layout, arg.padding
    raise TypeError  # Triton binds it: see launch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the grids: `triton.cdiv` is a constexpr function, and called from Python it
    costs about 1.6 us a call (unwrapping its arguments), where this costs 0.02."""
    return -(-a // b)


def launch(kernel, grid, args, constexprs, **options):
    """kernel[grid](*args, **constexprs, **options): `args` are the kernel's arguments before
    its constexprs, given positionally; `constexprs` (a dict) the rest, by name."""
    if not isinstance(kernel, JITFunction) or kernel.pre_run_hooks:  # the interpreter's; hooks
        return kernel[grid](*args, **constexprs, **options)
    device = driver.active.get_current_device()
    try:  # id(kernel): hashing a JITFunction takes a lock and reads a property on every call
        key = (id(kernel), device, *options.items(), *constexprs, *map(repr, constexprs.values()),
               *map(_arg_key, args))
    except TypeError:
        return kernel[grid](*args, **constexprs, **options)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        names = kernel.arg_names[len(args):]
        if isinstance(compiled, CompiledKernel) and set(names) == set(constexprs):
            if len(_COMPILED) >= CACHE_ENTRIES:
                _COMPILED.clear()
            _COMPILED[key] = kernel, compiled, names
        return compiled
    _, compiled, names = hit
    all_args = (*args, *(constexprs[name] for name in names))
    stream = driver.active.get_current_stream(device)
    padded = (*grid, 1, 1)
    compiled.run(padded[0], padded[1], padded[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *all_args), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *all_args)
    return compiled
