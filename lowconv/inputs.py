"""Example inputs as a plan keeps them, so that load can trace a model again without the user's.

Each tensor argument is kept as its shape and dtype, each constant (None, bool, int, float, str)
as it is; inputs holding anything else (a KV cache, a dataclass), or positional and keyword
arguments both, are not kept, and load then needs the inputs themselves. Load makes stand-ins:
standard normal values for floating tensors, ones for integer and bool ones (valid token ids;
masks that keep every position). Branches that the example decided on shapes, dtypes and flags go
the same way for them, and refind_sites checks that every converted site is found again as it
was converted.
"""
from __future__ import annotations

import math

import torch

from lowconv.errors import LowconvError
from lowconv.passes.trace import normalize_inputs
from lowconv.site import dtype_name, is_dtype_name

CONSTANTS = (bool, int, float, str)
MAX_ELEMENTS = 2**28  # stand-ins load makes at most (1 GiB of float32): a plan cannot ask for more


def describe(example_inputs) -> dict | None:
    """{"args": [...]} or {"kwargs": {...}}, each argument's description; None where one is neither
    a tensor nor a constant, or both kinds of arguments are given."""
    args, kwargs = normalize_inputs(example_inputs)
    values = [*args, *kwargs.values()]
    if (args and kwargs) or not all(value is None or isinstance(value, (torch.Tensor, *CONSTANTS)) for value in values):
        return None
    if kwargs:
        return {"kwargs": {name: described(v) for name, v in kwargs.items()}}
    return {"args": [described(a) for a in args]}


def described(value) -> dict:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    return {"value": value}


def stand_ins(description: dict, device: torch.device, source: str) -> tuple | dict:
    """Example inputs (a tuple of args or a dict of kwargs) made from describe's description, on
    `device`; a LowconvError naming `source` where the description is not one describe writes."""
    try:
        kwargs = description.get("kwargs")
        items = list(kwargs.values()) if kwargs is not None else description["args"]
        elements = sum(math.prod(item["shape"]) for item in items if "shape" in item)
        if elements > MAX_ELEMENTS:
            raise ValueError(f"{elements} elements, more than the {MAX_ELEMENTS} stand-ins load makes")
        if kwargs is not None:
            return {name: stand_in(item, device) for name, item in kwargs.items()}
        return tuple(stand_in(item, device) for item in items)
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as err:
        raise LowconvError(f"{source}: the plan's example_inputs are not valid ({type(err).__name__}: {err}): "
                           f"pass example_inputs") from None


def stand_in(item: dict, device: torch.device):
    if "value" in item:
        if item["value"] is not None and not isinstance(item["value"], CONSTANTS):
            raise TypeError(f"{item['value']!r} is not a constant")
        return item["value"]
    shape, dtype = item["shape"], item["dtype"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape) or not is_dtype_name(dtype):
        raise ValueError(f"{str(item)[:80]} is not a shape and a dtype")
    dtype = getattr(torch, dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.ones(shape, dtype=dtype, device=device)
