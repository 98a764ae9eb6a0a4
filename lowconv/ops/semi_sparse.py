"""`semi_sparse`: 2:4 sparse linear layers (2 of every 4 consecutive input features kept).

Which module, and its state dict, by options:
    target="weight", mask="fixed", inference    CompressedSemiSparseLinear
        compressed (out, in/2), bitmask uint8 (out, ceil(in/8)), shape int64 (2, 1), bias
        (compressed-tensors' sparse-24-bitmask; no dense weight in the checkpoint)
    target="weight", mask="fixed", training     MaskedSemiSparseLinear: weight (pruned), mask bool, bias
    target="weight", mask="runtime"             RuntimeSemiSparseLinear: weight (dense), bias;
                                                re-pruned every forward (torchao's SemiSparseLinear)
    target="activation"                         RuntimeSemiSparseLinear: weight (dense), bias; x is
                                                pruned every forward (`mask` does not apply)
"""
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowconv.kernels.sparse24 import (
    compress_bitmask, decompress_bitmask, mask_24, mask_24_transposable, prune_24_straight_through,
    semi_sparse_linear,
)
from lowconv.ops.linear_site import linear_from_site, linear_info, site_dtype
from lowconv.ops.registry import Op, register


@dataclass
class SemiSparseOptions:
    target: Literal["weight", "activation"] = "weight"  # which GEMM operand is 2:4
    mask: Literal["fixed", "runtime"] = "fixed"  # weight only: prune once, or by magnitude every forward
    training: bool = False  # fixed mask: keep a trainable dense weight + mask instead of compressing
    backend: Literal["auto", "cusparselt", "masked-dense"] = "auto"  # CUDA only; the CPU runs masked-dense
    # fixed weight mask: also 2:4 along out_features, so that W^T (the backward GEMM's operand) is 2:4 too
    transposable: bool = False

    def __post_init__(self):
        if self.transposable and (self.target != "weight" or self.mask != "fixed"):
            raise ValueError("applies to a fixed weight mask only (target = \"weight\", mask = \"fixed\")",
                             "transposable")


class CompressedSemiSparseLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.register_buffer("compressed", torch.empty(out_features, in_features // 2, dtype=dtype))
        self.register_buffer("bitmask", torch.empty(out_features, -(-in_features // 8), dtype=torch.uint8))
        self.register_buffer("shape", torch.tensor([[out_features], [in_features]]))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        # The dense pruned weight the forward multiplies by: derived from the three tensors above,
        # so it stays out of the checkpoint and is rebuilt whenever they are loaded.
        self.register_buffer("dense_weight", torch.empty(out_features, in_features, dtype=dtype), persistent=False)
        self.register_load_state_dict_post_hook(rebuild_after_load)

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.compressed, self.bitmask, self.shape = compress_bitmask(weight * fixed_mask(weight, self.options))
        if bias is not None:
            self.bias.copy_(bias)
        self.rebuild_dense_weight()

    @torch.no_grad()
    def rebuild_dense_weight(self):
        self.dense_weight = decompress_bitmask(self.compressed, self.bitmask, self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return semi_sparse_linear(x, self.dense_weight, self.bias)

    def linear_weight(self) -> torch.Tensor:
        """The (out, in) weight a plain nn.Linear needs to compute what this module does."""
        return self.dense_weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def rebuild_after_load(module: CompressedSemiSparseLinear, incompatible_keys):
    module.rebuild_dense_weight()


class MaskedSemiSparseLinear(nn.Module):
    """Fine-tuning with a fixed 2:4 mask: pruned weights get zero gradient and stay zero."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("mask", torch.empty(out_features, in_features, dtype=torch.bool))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.mask.copy_(fixed_mask(weight, self.options))
        self.weight.copy_(weight * self.mask)
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return semi_sparse_linear(x, self.weight * self.mask, self.bias)

    def linear_weight(self) -> torch.Tensor:
        return self.weight * self.mask

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RuntimeSemiSparseLinear(nn.Module):
    """A dense weight; the weight (target="weight") or the input (target="activation") is pruned
    2:4 by magnitude on every forward, with a straight-through gradient to the dense tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight.copy_(weight)
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.options.target == "activation":
            return semi_sparse_linear(prune_24_straight_through(x), self.weight, self.bias)
        return semi_sparse_linear(x, prune_24_straight_through(self.weight), self.bias)

    def linear_weight(self) -> torch.Tensor:
        """The dense weight, not its pruned view: reverting a runtime mask goes back to dense
        training (torchao's swap back from SemiSparseLinear)."""
        return self.weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"target={self.options.target}")


def fixed_mask(weight: torch.Tensor, options: SemiSparseOptions) -> torch.Tensor:
    """The 2:4 mask a fixed-mask module keeps: by magnitude along in_features, transposable if asked."""
    return mask_24_transposable(weight) if options.transposable else mask_24(weight)


def module_class(options: SemiSparseOptions) -> type[nn.Module]:
    if options.target == "activation" or options.mask == "runtime":
        return RuntimeSemiSparseLinear
    return MaskedSemiSparseLinear if options.training else CompressedSemiSparseLinear


def check(site, options: SemiSparseOptions) -> str | None:
    info = linear_info(site)
    if info.in_features % 4:
        return (f"2:4 sparsity needs in_features divisible by 4 "
                f"(weight is ({info.out_features}, {info.in_features}))")
    if options.transposable and info.out_features % 4:
        return (f"transposable 2:4 sparsity needs out_features divisible by 4 too "
                f"(weight is ({info.out_features}, {info.in_features}))")
    return None


def empty(site, options: SemiSparseOptions) -> nn.Module:
    info = linear_info(site)
    return module_class(options)(info.in_features, info.out_features, info.bias, site_dtype(site), options)


def from_site(site, options: SemiSparseOptions, params: dict[str, torch.Tensor]) -> nn.Module:
    return linear_from_site(empty, site, options, params)


SEMI_SPARSE = register(Op(
    name="semi_sparse",
    kind="linear",
    description="2:4 semi-structured sparse linear (weight or activation pruned along in_features)",
    options=SemiSparseOptions,
    check=check,
    from_site=from_site,
    empty=empty,
))
