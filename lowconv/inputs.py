"""A model's inputs: normalized to (args, kwargs), cloned fresh for each run lowconv makes, the
runs in eval mode; and example inputs as a plan keeps them, so that load can trace a model again
without the user's.

Each tensor argument is kept as its shape and dtype, each constant (None, bool, int, float, str)
as it is; inputs holding anything else (a KV cache, a dataclass), or positional and keyword
arguments both, are not kept, and load then needs the inputs themselves. Load makes stand-ins:
standard normal values for floating tensors, ones for integer and bool ones (valid token ids;
masks that keep every position). Branches that the example decided on shapes, dtypes and flags go
the same way for them, and refind_sites checks that every converted site is found again as it
was converted.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext

import torch
import torch.utils._pytree as pytree
from torch import nn

from lowconv.errors import LowconvError
from lowconv.scoped_setting import ScopedSetting
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


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """example_inputs as (args, kwargs): a tuple/list is args, a dict (any mapping: a tokenizer's
    BatchEncoding) is kwargs, else one arg."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}



def fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with every tensor in them (through tuples, lists, dicts and other pytree
    containers) a detached clone, requires_grad kept; anything else as it is. A tensor passed twice
    gets one clone, so the run sees the aliasing it had (views of one another become separate).
    Other objects a run may change (a KV cache) are copies too (as_called). What each internal run
    of a model is given, so that writes into its inputs change neither the caller's tensors and
    objects nor what the next run sees."""
    clones: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in clones:
            clones[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
        return clones[id(t)]

    return pytree.tree_map_only(torch.Tensor, clone, as_called(args, kwargs))



@contextmanager
def evaluating(model: nn.Module, plain_path: bool = True):
    """The model in eval mode (no BatchNorm statistics updated, no dropout), modes restored after;
    the global RNG is left as it was. With `plain_path`, torch's fused attention fast paths are off
    meanwhile (a process-wide switch, see ScopedSetting): the runs take the plain path that tracing
    records, so an encoder's layers see padded tensors, not nested ones, as they will in the
    converted model. (Timing runs keep the user's setting: see compare.compare.)"""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with NO_FAST_PATH.held() if plain_path else nullcontext(), torch.no_grad(), \
                torch.random.fork_rng(devices=cuda):
            yield model
    finally:
        for m, mode in modes.items():
            m.training = mode



NO_FAST_PATH = ScopedSetting(torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled, False)



def as_called(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A module's arguments as they are when it is called: objects the call may change (a
    transformers KV cache, which each layer appends to) copied; tensors, constants and what cannot
    be copied as they are."""
    def copied(value):
        if isinstance(value, (torch.Tensor, nn.Module)) or is_constant(value) or value is None:
            return value
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is recorded as it is
            return value
    return pytree.tree_map(copied, (tuple(args), dict(kwargs)))



def is_constant(value) -> bool:
    """An argument value that tracing fixes (and the graph guards): a bool, int, float or str."""
    return type(value) in CONSTANTS


def run_eval(model: nn.Module, args: tuple, kwargs: dict) -> object:
    """model(*args, **kwargs) in eval mode, the model's modes and the global RNG left as they were,
    on fresh clones of the tensors in args and kwargs (fresh_inputs): a model that writes into its
    inputs leaves the caller's tensors as they were."""
    args, kwargs = fresh_inputs(args, kwargs)
    with evaluating(model):
        return model(*args, **kwargs)
