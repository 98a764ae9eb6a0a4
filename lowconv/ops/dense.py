"""`dense`: a linear site as a plain nn.Linear holding the site's weight and bias.

What lowconv.revert turns converted linears into (the "train sparse, finish dense" schedule), and
a recipe can ask for it too: a Conv1D, F.linear or x @ W site then becomes an nn.Linear module.
"""
from dataclasses import dataclass

import torch
from torch import nn

from lowconv.ops.linear_site import linear_info, linear_params, site_dtype
from lowconv.ops.registry import register_op


@dataclass
class DenseOptions:
    pass


@register_op(DenseOptions, name="dense", kind="linear",
             description="a plain nn.Linear with the site's weights (what lowconv.revert makes of converted linears)")
class Dense:
    """The op's builder: its modules are plain nn.Linear."""

    @staticmethod
    def site_problem(site, options: DenseOptions) -> None:
        return None

    @staticmethod
    def empty(site, options: DenseOptions) -> nn.Linear:
        info = linear_info(site)
        return nn.Linear(info.in_features, info.out_features, bias=info.bias, dtype=site_dtype(site))

    @staticmethod
    def from_site(site, options: DenseOptions, params: dict[str, torch.Tensor]) -> nn.Linear:
        weight, bias = linear_params(site, params)
        dtype = site_dtype(site)
        return linear_holding(weight.to(dtype), None if bias is None else bias.to(dtype))


def linear_holding(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of weight (out, in) and bias, in weight's dtype and device."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                       device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear

