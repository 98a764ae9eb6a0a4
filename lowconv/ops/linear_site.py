"""What the linear ops (fp8, semi_sparse, fp16acc) share: reading a linear Site and its params."""
import math

import torch

from lowconv.site import LinearInfo, Site


def site_dtype(site: Site) -> torch.dtype:
    """The dtype the op module computes and keeps its tensors in.

    `empty` has no tensors to look at, so both constructors take the dtype from here: that keeps
    a module built by `from_site` and one rebuilt by `empty` identical.
    """
    return getattr(torch, site.compute_dtype())


def in_autocast_dtype(y: torch.Tensor) -> torch.Tensor:
    """y in autocast's dtype where autocast is on for y's device, as nn.Linear's output would be;
    else y. The ops compute in their own precision (fp8, 2:4, fp16 accumulation) either way."""
    device = y.device.type
    if torch.is_autocast_enabled(device) and y.is_floating_point():
        return y.to(torch.get_autocast_dtype(device))
    return y


def site_rows(site: Site) -> int | None:
    """M of the site's GEMM as traced (its input's elements over in_features), None if not traced."""
    return math.prod(site.input.shape[:-1]) if site.input else None


def linear_info(site: Site) -> LinearInfo:
    if not isinstance(site.info, LinearInfo):
        raise ValueError(f"site {site.fqn!r} is not a linear site ({type(site.info).__name__})")
    return site.info


class LinearOp:
    """The `from_site` of a linear op's builder (registry.OpBuilder), whose subclass defines `empty`
    and `site_problem`: the module built by `empty`, then given the site's weight (in the site's
    dtype) and bias."""

    @classmethod
    def from_site(cls, site: Site, options, params: dict[str, torch.Tensor]):
        module = cls.empty(site, options)
        weight, bias = linear_params(site, params)
        module.set_params(weight.to(site_dtype(site)), bias)
        return module


def linear_params(site: Site, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The site's (weight (out, in), bias (out,) or None), checked against its LinearInfo."""
    info = linear_info(site)
    weight, bias = params["weight"], params.get("bias")
    if tuple(weight.shape) != (info.out_features, info.in_features):
        raise ValueError(f"site {site.fqn!r}: weight has shape {tuple(weight.shape)}, "
                         f"expected (out, in) = ({info.out_features}, {info.in_features})")
    if info.bias != (bias is not None):
        raise ValueError(f"site {site.fqn!r}: bias is {'missing' if info.bias else 'unexpected'}")
    return weight.detach(), None if bias is None else bias.detach()

