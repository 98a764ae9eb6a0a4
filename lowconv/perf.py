"""A model's call timed on CUDA, eagerly and under torch.compile, and its peak memory: what
`lowconv compare` reports beside the accuracy (report.Perf)."""
from __future__ import annotations

import statistics
import warnings

import torch

from lowconv.errors import first_line
from lowconv.kernels.cuda_timing import cuda_ms_per_call


def measure_perf(model: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device | str) -> tuple[float, float]:
    """(median ms per forward, peak MB: the model's tensors plus the forward's working memory). CUDA only."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_perf times CUDA kernels; it got device {device}")
    if device.index is None:  # "cuda" must equal the "cuda:0" of the model's tensors
        device = torch.device("cuda", torch.cuda.current_device())

    def forward():
        with torch.no_grad():
            model(*args, **kwargs)

    forward()  # warmup: lazy init, kernel compilation and autotuning stay out of the numbers
    torch.cuda.synchronize(device)
    # Counted from the model's own tensors, so another model resident on the GPU does not count.
    model_bytes = sum(t.untyped_storage().nbytes() for t in unique_storages(model, device))
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward()
    torch.cuda.synchronize(device)
    peak_mb = (model_bytes + torch.cuda.max_memory_allocated(device) - before) / 2**20
    try:
        from triton.testing import do_bench

        return float(do_bench(forward, return_mode="median")), peak_mb
    except ImportError:
        return statistics.median(cuda_ms_per_call(forward, samples=20, calls=1)), peak_mb


def measure_compiled_ms(model: torch.nn.Module, args: tuple, kwargs: dict) -> float | None:
    """Median ms per forward of `model` under torch.compile (its default mode), or None where it
    does not compile. CUDA only, as measure_perf."""
    compiled = torch.compile(model)

    def forward():
        with torch.no_grad():
            compiled(*args, **kwargs)

    try:
        forward()  # compiles
    except Exception as err:  # noqa: BLE001 - a model that does not compile has no compiled time to report
        warnings.warn(f"torch.compile of {type(model).__name__} failed, so the report has no compiled time for it: "
                      f"{first_line(err)}", stacklevel=2)
        return None
    from triton.testing import do_bench
    return float(do_bench(forward, return_mode="median"))


def unique_storages(model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    """One tensor per distinct storage on `device` (tied weights count once)."""
    by_storage = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device == device:
            by_storage.setdefault(t.untyped_storage().data_ptr(), t)
    return list(by_storage.values())
