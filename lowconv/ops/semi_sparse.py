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

On CUDA the two fixed-mask modules run cuSPARSELt's 2:4 GEMM (lowconv.kernels.cusparselt) or the
masked dense product, as `backend` says; "auto" times both on the site's own GEMM (rows M from its
traced input, dtype, bias; forward and backward for training) when the module first runs on a
GPU, and keeps the faster (BackendChoice, in `module.choice`). Runtime masks and activation
targets run the masked dense product: their cuSPARSELt path is not built. The CPU runs the
masked dense reference.
"""
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowconv.kernels.cusparselt import SparseWeight, unsupported_shape_reason
from lowconv.kernels.sparse24 import (
    BackendChoice, GemmCase, SparseLinearFunction, TrainingGemms, choose_backend, compress_bitmask,
    decompress_bitmask, mask_24, mask_24_transposable, prune_24_straight_through, semi_sparse_linear,
)
from lowconv.ops.linear_site import in_autocast_dtype, linear_from_site, linear_info, site_dtype
from lowconv.ops.registry import Op, register


@dataclass
class SemiSparseOptions:
    target: Literal["weight", "activation"] = "weight"  # which GEMM operand is 2:4
    mask: Literal["fixed", "runtime"] = "fixed"  # weight only: prune once, or by magnitude every forward
    training: bool = False  # fixed mask: keep a trainable dense weight + mask instead of compressing
    # CUDA only (the CPU runs masked-dense): cuSPARSELt's 2:4 GEMM, the dense GEMM of the pruned
    # weight, or whichever is faster at the site's shape (fixed weight masks)
    backend: Literal["auto", "cusparselt", "masked-dense"] = "auto"
    # fixed weight mask: also 2:4 along out_features, so that W^T (the backward GEMM's operand) is 2:4 too
    transposable: bool = False

    def __post_init__(self):
        if self.transposable and (self.target != "weight" or self.mask != "fixed"):
            raise ValueError("applies to a fixed weight mask only (target = \"weight\", mask = \"fixed\")",
                             "transposable")
        if self.backend == "cusparselt" and (self.target != "weight" or self.mask != "fixed"):
            raise ValueError("\"cusparselt\" is built for a fixed weight mask only (target = \"weight\", "
                             "mask = \"fixed\"); runtime masks and activation targets run masked-dense", "backend")


class FixedMaskLinear(nn.Module):
    """What both fixed-mask modules share: the CUDA backend, chosen once per module."""

    def __init__(self, in_features: int, out_features: int, options: SemiSparseOptions, rows: int | None):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.rows = rows  # M of the site's traced input: the GEMM "auto" times
        self.choice: BackendChoice | None = None  # the CUDA backend, decided on the first GPU seen
        self.chosen_for: tuple[torch.device, torch.dtype] | None = None

    def decide(self, device: torch.device, rows: int, dtype: torch.dtype) -> BackendChoice:
        """The backend for this device and dtype: chosen again after .to() / .float() changed them
        (a bf16 choice of cuSPARSELt would fail on float32), kept while they stay the same."""
        if self.choice is None or self.chosen_for != (device, dtype):
            case = GemmCase(self.rows or rows, self.out_features, self.in_features, dtype, self.bias is not None,
                            device, training=self.options.training, transposable=self.options.transposable)
            self.choice, self.chosen_for = choose_backend(self.options.backend, case), (device, dtype)
        return self.choice

    def runs_cusparselt(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        return x.is_cuda and self.decide(x.device, x.numel() // self.in_features, dtype).backend == "cusparselt"

    def tuned(self, x: torch.Tensor) -> bool:
        """Whether x's product runs a tuned cuSPARSELt algorithm: at the site's own M (the GEMM
        "auto" timed); other M take cuSPARSELt's default, to spare a tuning per shape."""
        return x.numel() // self.in_features == self.rows

    def plan_note(self) -> str:
        """The CUDA backend chosen at conversion and why (measured times for "auto"), for the plan."""
        return f"CUDA backend {self.choice.backend} ({self.choice.reason})" if self.choice else ""

    def extra_repr(self) -> str:
        backend = f", backend={self.choice.backend}" if self.choice else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{backend}")


class CompressedSemiSparseLinear(FixedMaskLinear):
    """Inference with a fixed 2:4 weight, kept in the bitmask format; on CUDA as `choice` says."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions, rows: int | None = None):
        super().__init__(in_features, out_features, options, rows)
        self.register_buffer("compressed", torch.empty(out_features, in_features // 2, dtype=dtype))
        self.register_buffer("bitmask", torch.empty(out_features, -(-in_features // 8), dtype=torch.uint8))
        self.register_buffer("shape", torch.tensor([[out_features], [in_features]]))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        # The dense pruned weight of the masked dense product: derived from the three tensors
        # above, so it stays out of the checkpoint; empty while cuSPARSELt's copy is in use.
        self.register_buffer("dense_weight", torch.empty(0, dtype=dtype), persistent=False)
        self.sparse: SparseWeight | None = None  # the weight in cuSPARSELt's layout, on one GPU
        self.register_load_state_dict_post_hook(forget_derived_weights)

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.compressed, self.bitmask, self.shape = compress_bitmask(weight * fixed_mask(weight, self.options))
        if bias is not None:
            self.bias.copy_(bias)
        forget_derived_weights(self)
        if weight.is_cuda and self.rows:  # converting on a GPU: the plan gets the measured choice
            self.decide(weight.device, self.rows, weight.dtype)

    def dense(self) -> torch.Tensor:
        """The dense pruned weight (out, in), rebuilt from the bitmask format when not kept."""
        if self.dense_weight.numel() == 0:
            self.dense_weight = decompress_bitmask(self.compressed, self.bitmask, self.shape)
        return self.dense_weight

    def sparse_weight(self) -> SparseWeight:
        """cuSPARSELt's copy of the weight; the dense one is dropped (saving memory is the point)."""
        if self.sparse is None:
            self.sparse = SparseWeight(self.dense())
            self.dense_weight = self.dense_weight.new_empty(0)
        return self.sparse

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if self.runs_cusparselt(input, self.compressed.dtype):
            y = self.sparse_weight().linear(input, self.bias, self.tuned(input))
        else:
            y = semi_sparse_linear(input, self.dense(), self.bias)
        return in_autocast_dtype(y)

    def _apply(self, fn, recurse=True):
        self.sparse = None  # .to() / .cuda() / .half() move or cast the buffers: rebuilt from them
        return super()._apply(fn, recurse)

    def linear_weight(self) -> torch.Tensor:
        """The (out, in) weight a plain nn.Linear needs to compute what this module does."""
        return decompress_bitmask(self.compressed, self.bitmask, self.shape)


def forget_derived_weights(module: CompressedSemiSparseLinear, incompatible_keys=None):
    """After new weights (set_params, load_state_dict): the dense and cuSPARSELt copies are stale."""
    module.dense_weight = module.dense_weight.new_empty(0)
    module.sparse = None


class MaskedSemiSparseLinear(FixedMaskLinear):
    """Fine-tuning with a fixed 2:4 mask: pruned weights get zero gradient and stay zero. On CUDA
    with cuSPARSELt: the forward (and dX when transposable) through 2:4 GEMMs, dW dense."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions, rows: int | None = None):
        super().__init__(in_features, out_features, options, rows)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("mask", torch.empty(out_features, in_features, dtype=torch.bool))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.gemms: TrainingGemms | None = None  # cuSPARSELt's plans, on one GPU

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        mask = fixed_mask(weight, self.options)  # on the weight's device, which may not be the module's yet
        self.mask.copy_(mask)
        self.weight.copy_(weight * mask)
        if bias is not None:
            self.bias.copy_(bias)
        if weight.is_cuda and self.rows:
            self.decide(weight.device, self.rows, weight.dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if self.runs_cusparselt(input, self.weight.dtype):
            if self.gemms is None:
                self.gemms = TrainingGemms.of(self.weight, self.options.transposable, self.rows)
            y = SparseLinearFunction.apply(input, self.weight, self.mask, self.bias, self.gemms)
        else:
            y = semi_sparse_linear(input, self.weight * self.mask, self.bias)
        return in_autocast_dtype(y)

    def _apply(self, fn, recurse=True):
        self.gemms = None  # cuSPARSELt's plans belong to a device and dtype
        return super()._apply(fn, recurse)

    def linear_weight(self) -> torch.Tensor:
        return self.weight * self.mask


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

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if self.options.target == "activation":
            y = semi_sparse_linear(prune_24_straight_through(input), self.weight, self.bias)
        else:
            y = semi_sparse_linear(input, prune_24_straight_through(self.weight), self.bias)
        return in_autocast_dtype(y)

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
    if site.reads_parameter_device and issubclass(module_class(options), CompressedSemiSparseLinear):
        return ("other code of the model reads this layer's weight (its device), and the compressed 2:4 "
                "layer keeps no weight tensor (training = true keeps one)")
    info = linear_info(site)
    if info.in_features % 4:
        return (f"2:4 sparsity needs in_features divisible by 4 "
                f"(weight is ({info.out_features}, {info.in_features}))")
    if options.transposable and info.out_features % 4:
        return (f"transposable 2:4 sparsity needs out_features divisible by 4 too "
                f"(weight is ({info.out_features}, {info.in_features}))")
    if options.backend == "cusparselt":
        dtype = site_dtype(site)
        shapes = [(info.out_features, info.in_features)]
        if options.training and options.transposable:  # dX runs W^T (in, out) through cuSPARSELt too
            shapes.append((info.in_features, info.out_features))
        return next(filter(None, (unsupported_shape_reason(*shape, dtype) for shape in shapes)), None)
    return None


def empty(site, options: SemiSparseOptions) -> nn.Module:
    info = linear_info(site)
    cls = module_class(options)
    if issubclass(cls, FixedMaskLinear):
        return cls(info.in_features, info.out_features, info.bias, site_dtype(site), options, site_rows(site))
    return cls(info.in_features, info.out_features, info.bias, site_dtype(site), options)


def site_rows(site) -> int | None:
    """M of the site's GEMM as traced (its input's elements over in_features), None if not traced."""
    return math.prod(site.input.shape[:-1]) if site.input else None


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
