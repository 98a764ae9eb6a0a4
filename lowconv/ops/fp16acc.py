"""`fp16acc`: fp16 linear layers with fp16 accumulation, split along K to bound its error.

State dict: `weight` (out, in) float16, `bias` (out,) float16 if the site has one (nn.Linear's).
"""
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowconv.kernels.fp16acc import auto_splits, fp16acc_matmul
from lowconv.ops.linear_site import LinearOp, in_autocast_dtype, linear_info
from lowconv.ops.registry import register_op


@dataclass
class Fp16AccOptions:
    splits: int | Literal["auto"] = "auto"  # chunks of K, each with its own fp16 accumulator
    combine: Literal["fp32", "fp16"] = "fp32"  # how the chunks' partial sums are added up
    # On CUDA: lowconv's Triton kernel, or one cuBLAS matmul per chunk with torch's
    # allow_fp16_accumulation on for the call only. The CPU runs the reference either way.
    backend: Literal["triton", "cublas"] = "triton"

    def __post_init__(self):
        if self.splits != "auto" and self.splits < 1:
            raise ValueError(f"must be at least 1 (got {self.splits})", "splits")


@register_op(Fp16AccOptions, name="fp16acc", kind="linear",
             description="fp16 linear with fp16 accumulation, split along K (fp32 or fp16 combine) to bound the error")
class Fp16AccLinear(LinearOp, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, options: Fp16AccOptions):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.float16)) if bias else None

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight.copy_(weight)
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if torch.is_autocast_enabled(input.device.type) and input.is_floating_point():
            input = input.half()  # autocast casts an nn.Linear's input; this op computes in fp16
        backend = self.options.backend if input.is_cuda else "reference"
        return in_autocast_dtype(fp16acc_matmul(input, self.weight, self.bias, self.splits_for(input),
                                                self.options.combine, backend))

    def splits_for(self, x: torch.Tensor) -> int:
        """The chunks of K for this input: "auto" depends on its rows (decode takes more)."""
        if self.options.splits == "auto":
            # torch.compile traces the function under auto_splits' cache (and warns of the cache)
            splits = auto_splits.__wrapped__ if torch.compiler.is_compiling() else auto_splits
            return splits(self.in_features, x.numel() // self.in_features, self.options.combine)
        return self.options.splits

    def linear_weight(self) -> torch.Tensor:
        return self.weight

    @classmethod
    def site_problem(cls, site, options: Fp16AccOptions) -> str | None:
        dtype = site.compute_dtype()
        if dtype != "float16":
            return (f"fp16acc runs fp16 models only (site dtype is {dtype}; cast the model and its inputs "
                    "first, as `lowconv convert --dtype float16` does)")
        return None

    @classmethod
    def empty(cls, site, options: Fp16AccOptions) -> "Fp16AccLinear":
        info = linear_info(site)
        return cls(info.in_features, info.out_features, info.bias, options)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"splits={self.options.splits}, combine={self.options.combine}, backend={self.options.backend}")
