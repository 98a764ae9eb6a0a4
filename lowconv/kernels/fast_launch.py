"""Launching a Triton kernel again without Triton's per-call argument binding.

`kernel[grid](...)` binds and specializes every argument, builds a cache key and checks hooks on
each call. On the lent H100 machines' hosts, for block attention's forward kernel (~30
arguments), that took 23 us per launch against 7 us for the compiled kernel's own launcher
(measured 2026-11-22, see BENCHMARKS.md, issue 7; on another, slower host: 34 us through
`launch` with its key, of which 15 us the key). Attention at small sizes launches three kernels
per training step and is host-bound, so this is a fifth of its host time.

`launch` goes through Triton the first time it sees a specialization, keeps the compiled kernel
under a key finer than Triton's own (each int's exact value, each tensor's dtype and whether its
address is 16-byte aligned, which arguments are None, the constexprs and the launch options),
and on a hit calls the compiled kernel's launcher directly: it launches what Triton would.
Arguments of any other kind (e.g. tensor descriptors), and kernels with pre-run hooks, always go
through Triton; so does everything under TRITON_INTERPRET=1 (there is no compiled kernel).
Not followed: Triton's debug and instrumentation settings (TRITON_DEBUG, knobs) changed after a
kernel's first launch in the process (reading them costs two environment lookups per launch).
"""
import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction, driver

# (kernel, device, options, constexprs, each argument's key) -> (compiled kernel, its
# constexprs' names in signature order). Bounded; a cache of what Triton compiled, so clearing it
# loses nothing.
_COMPILED: dict = {}
CACHE_ENTRIES = 1024


def _arg_key(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):  # bool too
        return arg
    if arg is None or isinstance(arg, float):
        return type(arg)
    raise TypeError  # Triton binds it: see launch


def launch(kernel, grid, args, constexprs, **options):
    """kernel[grid](*args, **constexprs, **options): `args` are the kernel's arguments before
    its constexprs, given positionally; `constexprs` (a dict) the rest, by name."""
    if not isinstance(kernel, JITFunction):  # the interpreter's
        return kernel[grid](*args, **constexprs, **options)
    device = driver.active.get_current_device()
    try:
        key = (kernel, device, *options.items(), *constexprs.items(), *map(_arg_key, args))
    except TypeError:
        return kernel[grid](*args, **constexprs, **options)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        names = kernel.arg_names[len(args):]
        if isinstance(compiled, CompiledKernel) and set(names) == set(constexprs) and not kernel.pre_run_hooks:
            if len(_COMPILED) >= CACHE_ENTRIES:
                _COMPILED.clear()
            _COMPILED[key] = compiled, names
        return compiled
    compiled, names = hit
    all_args = (*args, *(constexprs[name] for name in names))
    stream = driver.active.get_current_stream(device)
    grid = (*grid, 1, 1)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *all_args), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *all_args)
    return compiled
