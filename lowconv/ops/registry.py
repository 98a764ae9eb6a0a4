"""The op registry: the one place where conversion targets are registered by name.

An op turns one Site into one nn.Module. `from_site` does the one-time work (quantize, prune,
compress) from the site's original parameters; `empty` builds the same module with
uninitialized tensors of the right shapes and dtypes, which `load_state_dict` then fills, so a
module rebuilt from a checkpoint equals the one built by `from_site`.

Op modules may also have:
- `needs_calibration` (True) with `begin_calibration()` / `end_calibration()`: convert runs the
  example or calibration inputs through the model between the two (static/delayed FP8 scales);
- `report_stats() -> dict[str, float]`: counters the report shows per site (e.g. clipped values);
- `plan_note() -> str`: what the module measured or chose when it was built (a 2:4 layer's CUDA
  backend and its timings), kept in the plan beside the recipe's decision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lowconv.site import Site


@dataclass(frozen=True)
class Op:
    name: str
    kind: str | None  # the site kind it accepts; None: any (only `keep`)
    description: str
    options: type  # a dataclass; its fields are the recipe's `options` keys
    # Why this op cannot take this site (shape, dtype, ...), or None when it can.
    check: Callable[[Site, Any], str | None]
    # (site, options, params) -> module. params: the site's original tensors; for linears
    # {"weight": (out, in), "bias": (out,) or absent}; for nn.MultiheadAttention its state_dict;
    # for functional attention {}.
    from_site: Callable[[Site, Any, dict[str, torch.Tensor]], nn.Module] | None
    empty: Callable[[Site, Any], nn.Module] | None
    # Whether conversion on CUDA times the op's module against the original at the site's shape
    # and keeps the original where the op is slower (unless the rule forces it): ops for speed.
    timed: bool = False


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is already registered")
    OPS[op.name] = op
    return op

