"""What the kernels ask of the GPU they launch on, cached: they ask on every call."""
import functools

import torch

H100_SMS = 132  # what the interpreter (CPU tensors) takes the GPU to have


def cuda_capability(index: int | None) -> tuple[int, int]:
    """CUDA device `index`'s (None: the current one) compute capability. Under torch.compile asked of
    torch.cuda, which dynamo folds to a constant (through functools' cache it warns, and traces
    past the cache anyway)."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(index)
    return cached_capability(index)


@functools.cache
def cached_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count; H100_SMS off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
