"""Static FP8 scales observed on calibration batches: the converted model run on them, its
observing modules told when calibration begins and ends."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from lowconv.errors import LowconvError
from lowconv.inputs import normalize_inputs, run_eval
from lowconv.ops.registry import Calibrated


def calibrate(model: nn.Module, batches: Iterable, progress) -> int:
    """Run the batches through modules that observe their inputs (static/delayed scales); how many
    ran (0: no module observes, and the batches are not asked for)."""
    observers = [m for m in model.modules() if isinstance(m, Calibrated) and m.needs_calibration]
    if not observers:
        return 0
    progress(f"calibrating {len(observers)} modules")
    try:  # iter(), not isinstance(Iterable): a map-style Dataset iterates through __getitem__
        if isinstance(batches, torch.Tensor):
            raise TypeError
        batches = iter(batches)
    except TypeError:
        raise LowconvError(f"calibration must be an iterable of example inputs (each a tuple of forward arguments, "
                           f"a dict of keyword arguments or one tensor), got {type(batches).__name__}") from None
    for m in observers:
        m.begin_calibration()
    seen = 0
    for seen, batch in enumerate(batches, 1):
        run_eval(model, *normalize_inputs(batch))
    if not seen:
        raise LowconvError("calibration holds no batch: static scales need at least one")
    for m in observers:
        m.end_calibration()
    return seen



def calibrated_on(batches: int, name: str | None) -> str:
    """What the plan says calibrated the scales: `batches` batches of `name`, or (name None) the
    example inputs."""
    if name is None:
        return "the example inputs (1 batch)"
    return f"{batches} batch{'es' if batches > 1 else ''} of {name}"
