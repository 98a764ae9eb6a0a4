"""The op registry: the one place where conversion targets are registered by name.

An op turns one Site into one nn.Module. An op file is its Options dataclass (the recipe's
`options` keys), its module class, and one decorator, `register_op(Options, name=...)`, on the
class that builds the modules (OpBuilder): the module class itself, with `site_problem`,
`from_site` and `empty` as classmethods, or, for an op that builds several module classes (or
none), a class holding just those three. `from_site` does the one-time work (quantize, prune,
compress) from the site's original parameters; `empty` builds the same module with
uninitialized tensors of the right shapes and dtypes, which `load_state_dict` then fills, so a
module rebuilt from a checkpoint equals the one built by `from_site`.

Op modules may also have what the protocols below name; lowconv asks `isinstance(module, P)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.fx as fx
from torch import nn

from lowconv.site import Site


@dataclass(frozen=True)
class Op:
    name: str
    kind: str | None  # the site kind it accepts; None: any (only `keep`)
    description: str
    options: type  # a dataclass; its fields are the recipe's `options` keys
    # Why this op cannot take this site (shape, dtype, ...), or None when it can.
    site_problem: Callable[[Site, Any], str | None]
    # (site, options, params) -> module. params: the site's original tensors; for linears
    # {"weight": (out, in), "bias": (out,) or absent}; for nn.MultiheadAttention its state_dict;
    # for functional attention {}.
    from_site: Callable[[Site, Any, dict[str, torch.Tensor]], nn.Module] | None
    empty: Callable[[Site, Any], nn.Module] | None
    # Whether conversion on CUDA times the op's module against the original at the site's shape
    # and keeps the original where the op is slower (unless the rule forces it): ops for speed.
    timed: bool = False
    # What the rewrite then does to each region graph it rewrote, on convert and on load alike:
    # the sparse attention op drops SpTr pair layouts that only its window modules read.
    rewrite_graph: Callable[[fx.GraphModule], None] | None = None


OPS: dict[str, Op] = {}


@runtime_checkable
class Calibrated(Protocol):
    """A module whose scales are measured on inputs: convert runs the example or calibration inputs
    through the model between begin_calibration() and end_calibration() where needs_calibration
    (static and delayed FP8 scales)."""
    needs_calibration: bool

    def begin_calibration(self) -> None: ...

    def end_calibration(self) -> None: ...


@runtime_checkable
class NotesThePlan(Protocol):
    def plan_note(self) -> str:
        """What the module measured or chose when it was built (a 2:4 layer's CUDA backend and its
        timings), kept in the plan beside the recipe's decision."""


@runtime_checkable
class ReportsStats(Protocol):
    def report_stats(self) -> dict[str, float]:
        """Counters the report shows per site (e.g. clipped values), cumulative: compare reports
        the difference over its run."""


@runtime_checkable
class ChecksLoadedState(Protocol):
    def loaded_state_problem(self) -> str | None:
        """What is wrong with the tensors a checkpoint filled in (2:4 masks that are not 2:4,
        scales that are not finite and positive), or None."""


@runtime_checkable
class SharesInputStep(Protocol):
    # Whether other converted layers of these options read the same x (the conversion and load set
    # it): under torch.compile the layer then leaves x's step to inductor, which does it once for all.
    input_shared: bool

    def input_step(self, x: torch.Tensor) -> object:
        """The forward's work on x alone (an FP8 layer's dynamic quantization of x), the same in
        every layer of these options that reads x: never-slower's timing shares it among them."""


@runtime_checkable
class TakesActivation(Protocol):
    def takes_activation(self) -> bool:
        """Whether forward(h, activation=name, up=u) may compute its input act(h) [* u] within its
        own step on x (fuse_activation.py moves the activation there)."""


class OpBuilder(Protocol):
    """What register_op takes from the class it decorates (classmethods or staticmethods)."""

    def site_problem(self, site: Site, options: Any) -> str | None:
        """Why this op cannot take this site (shape, dtype, ...), or None when it can."""

    def from_site(self, site: Site, options: Any, params: dict[str, torch.Tensor]) -> nn.Module: ...

    def empty(self, site: Site, options: Any) -> nn.Module: ...


def register_op(options: type, *, name: str, kind: str | None, description: str, timed: bool = False,
                rewrite_graph: Callable[[fx.GraphModule], None] | None = None):
    """A class decorator: registers op `name`, whose recipe options are the dataclass `options`
    and whose modules the decorated class builds (OpBuilder); the other arguments are Op's."""
    def register(builder: type) -> type:
        if name in OPS:
            raise ValueError(f"op {name!r} is already registered")
        OPS[name] = Op(name, kind, description, options, builder.site_problem, builder.from_site, builder.empty,
                       timed, rewrite_graph)
        return builder
    return register

