"""`fp8_semi_sparse`: FP8 linear layers whose e4m3 weights are 2:4 sparse (2 of every 4 consecutive
input features kept, by magnitude), for inference; x quantized dynamically, as fp8's.

State dict: fp8's (ops/fp8.py) with the weight pruned before its quantization: weight e4m3 (out,
in), at most 2 nonzeros in every 4 along in; weight_scale; bias. So a checkpoint serves as fp8's
does: transformers and vLLM read a dense FP8 layer of the pruned weight (the same products).

On CUDA the layer runs cuSPARSELt's e4m3 2:4 GEMM (kernels/fp8_sparse24.py) or fp8.py's dense
GEMM of the pruned weight, as `backend` says; "auto" times both at the site's rows M and keeps
the faster (`choice`, in the plan). The CPU runs fp8's reference of the pruned weight. cuSPARSELt's
copy of the weight (0.56 bytes a parameter) is kept beside the e4m3 weight the state dict holds:
1.56 bytes a parameter on the GPU, against fp8's 1 and bf16's 2.

When the backend is chosen and its copy made: eagerly, never inside torch.compile; at conversion
on a GPU, or else at the first eager call on a GPU (after .to() to another device too). Under
torch.compile a layer runs what was prepared for its input's device, else the dense FP8 GEMM: so
convert on the GPU, or run the model once eagerly there, before compiling it (as semi_sparse).
"""
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from lowconv.errors import LowconvError
from lowconv.kernels import cusparselt
from lowconv.kernels.fp8 import E4M3, LINEAR_GRANULARITIES, activate, quantize_activation, quantize_rows_after
from lowconv.kernels.fp8_sparse24 import GemmCase, choose_backend, fp8_sparse24_linear, sparse_gemm
from lowconv.kernels.operands import needs_autograd
from lowconv.kernels.sparse24 import BackendChoice, prune_24
from lowconv.ops.fp8 import Fp8Linear, outside_autocast
from lowconv.ops.linear_site import linear_info, site_dtype, site_rows
from lowconv.ops.registry import register_op


@dataclass
class Fp8SemiSparseOptions:
    granularity: Literal["tensor", "row", "token"] = "row"  # as fp8's, for x scaled dynamically
    fast_accum: bool = True  # as fp8's (the dense GEMM; cuSPARSELt's accumulates as it does)
    # CUDA only (the CPU runs the reference): cuSPARSELt's e4m3 2:4 GEMM, the dense FP8 GEMM of the
    # pruned weight, or whichever is faster at the site's shape
    backend: Literal["auto", "cusparselt", "dense"] = "auto"
    # What fp8's layer reads of its options, fixed here (not recipe keys): inference, x's scales dynamic.
    scaling: ClassVar[str] = "dynamic"
    training: ClassVar[bool] = False
    fp8_all_gather: ClassVar[bool] = False


@register_op(Fp8SemiSparseOptions, name="fp8_semi_sparse", kind="linear", timed=True,
             description="FP8 linear with a 2:4 sparse e4m3 weight (inference, dynamic scaling): cuSPARSELt's e4m3 "
                         "2:4 GEMM")
class Fp8SemiSparseLinear(Fp8Linear):
    """fp8's inference layer with a 2:4 weight, on cuSPARSELt's 2:4 GEMM where `choice` says so."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: Fp8SemiSparseOptions, rows: int | None = None):
        super().__init__(in_features, out_features, bias, dtype, options)
        self.rows = rows  # M of the site's traced input: the GEMM "auto" times and tunes
        # The weight in cuSPARSELt's layout and its GEMM's plans, on one GPU: derived from `weight`,
        # so out of the checkpoint.
        self.register_buffer("cusparselt_weight", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.gemm = None
        self.choice: BackendChoice | None = None
        self.chosen_for: torch.device | None = None
        self.register_load_state_dict_post_hook(recompress_loaded_weight)

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().set_params(prune_24(weight), bias)
        self.forget_cuda_state()
        if weight.is_cuda and self.rows:  # converting on a GPU: the plan gets the measured choice
            self.prepare(weight.device, self.rows)

    def prepare(self, device: torch.device, rows: int):
        """The backend for `device`, chosen (timed, for "auto") and its copy of the weight made,
        unless done already."""
        if self.chosen_for == device:
            return
        x_scales, w_scales = LINEAR_GRANULARITIES[self.options.granularity]
        case = GemmCase(self.rows or rows, self.out_features, self.in_features, x_scales == "row", w_scales == "row",
                        self.bias is not None, self.weight_scale.dtype, device)
        self.forget_cuda_state()
        self.choice, self.chosen_for = choose_backend(self.options.backend, case), device
        if self.choice.backend == "cusparselt":
            self.gemm = sparse_gemm(self.out_features, self.in_features, device)
            self.cusparselt_weight = self.gemm.compress(self.weight)

    def forget_cuda_state(self):
        """The choice, the plans and cuSPARSELt's copy, dropped: new weights or device."""
        self.cusparselt_weight = self.cusparselt_weight.new_empty(0)
        self.gemm, self.choice, self.chosen_for = None, None, None

    def _apply(self, fn, recurse=True):
        device = self.weight.device
        super()._apply(fn, recurse)
        if self.weight.device != device:  # what was chosen and made is for the old device
            self.forget_cuda_state()
        return self

    def sparse_ready(self, x: torch.Tensor) -> bool:
        """Whether x runs on cuSPARSELt: chosen and prepared for x's device (eagerly, prepared now
        if not yet)."""
        if not x.is_cuda:
            return False
        if not torch.compiler.is_compiling():
            self.prepare(x.device, x.numel() // self.in_features)
        return self.gemm is not None and self.chosen_for == x.device

    @outside_autocast
    def forward(self, input: torch.Tensor, *, activation: str | None = None,
                up: torch.Tensor | None = None) -> torch.Tensor:
        if self.calibrating or needs_autograd(input, up, self.bias) or not self.sparse_ready(input):
            return super().forward(input, activation=activation, up=up)
        if activation is not None and self.takes_activation():
            x_fp8, x_scale = quantize_rows_after(input, activation, up)
        else:
            x = input if activation is None else activate(input, activation, up)
            x_fp8, x_scale = quantize_activation(x, self.options.granularity, alone=not self.input_shared)
        tuned = input.numel() // self.in_features == self.rows
        return fp8_sparse24_linear(x_fp8, x_scale, self.cusparselt_weight, self.weight_scale, self.bias, input.dtype,
                                   self.gemm, tuned)

    def plan_note(self) -> str:
        """The CUDA backend chosen at conversion and why (measured times for "auto"), for the plan."""
        if self.choice is None:
            return "no CUDA backend chosen yet: chosen at the layer's first call on a GPU"
        return f"CUDA backend {self.choice.backend} ({self.choice.reason})"

    def loaded_state_problem(self) -> str | None:
        """fp8's checks, and a weight that is 2:4 (at most 2 nonzeros in every 4 along in)."""
        problem = super().loaded_state_problem()
        if problem:
            return problem
        nonzero = (self.weight.view(torch.uint8) & 0x7F) != 0  # e4m3's magnitude bits (-0 is 0x80)
        crowded = (nonzero.reshape(self.out_features, -1, 4).sum(-1) > 2).sum().item()
        if crowded:
            return f"weight must keep at most 2 nonzeros in every 4 along in_features; {crowded} groups keep more"
        return None

    def extra_repr(self) -> str:
        backend = f", backend={self.choice.backend}" if self.choice else ""
        return super().extra_repr() + backend

    @classmethod
    def site_problem(cls, site, options: Fp8SemiSparseOptions) -> str | None:
        info = linear_info(site)
        if info.in_features % 4:
            return (f"2:4 sparsity needs in_features divisible by 4 "
                    f"(weight is ({info.out_features}, {info.in_features}))")
        if options.backend == "cusparselt":
            return (cusparselt.shape_problem(info.out_features, info.in_features, E4M3)
                    or super().site_problem(site, options))
        return super().site_problem(site, options)

    @classmethod
    def empty(cls, site, options: Fp8SemiSparseOptions) -> "Fp8SemiSparseLinear":
        info = linear_info(site)
        return cls(info.in_features, info.out_features, info.bias, site_dtype(site), options, site_rows(site))


@torch.no_grad()
def recompress_loaded_weight(module: Fp8SemiSparseLinear, incompatible_keys=None):
    """After load_state_dict: cuSPARSELt's copy made again from the loaded weight, into the same
    memory (a CUDA graph that captured a forward reads the new one); dropped where the weight now
    lies on another device (load_state_dict(assign=True))."""
    if module.gemm is None:
        return
    if module.weight.device != module.chosen_for:
        module.forget_cuda_state()
        return
    problem = module.loaded_state_problem()  # cuSPARSELt would compress a weight that is not 2:4 silently
    if problem:
        raise LowconvError(f"fp8_semi_sparse: {problem}")
    module.cusparselt_weight.copy_(module.gemm.compress(module.weight))
