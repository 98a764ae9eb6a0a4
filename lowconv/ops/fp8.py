"""`fp8`: linear layers in FP8 (e4m3 weights and activations forward, e5m2 gradients backward).

State dict (inference, compressed-tensors names):
    weight        float8_e4m3fn (out, in)
    weight_scale  (1,) per tensor | (out, 1) per channel, in the model's dtype (dequant scale)
    bias          (out,) in the model's dtype, if the site has one
    input_scale   (1,) float32, static scaling only
    amax_history  (amax_history_len,) float32, delayed scaling only
Training (options.training): `weight` is the high-precision master weight; no weight_scale.
With fp8_all_gather, FSDP2 all-gathers it in e4m3 (kernels/fp8_all_gather.py); the state dict is the same.

granularity, dynamic scaling (kernels/fp8.py LINEAR_GRANULARITIES):
    tensor   one scale for x, one for W
    row      a scale per token of x, per output channel of W
    token    a scale per token of x, one for W (vLLM's dynamic FP8 with a per-tensor weight scale)
    block    a scale per 128 values of each token of x, per 128 x 128 tile of W (DeepSeek-V3's,
             compressed-tensors' FP8_BLOCK); weight_scale (ceil(out / 128), ceil(in / 128)); inference only
Static and delayed scales take x per tensor (tokens vary; a per-token scale cannot be fixed);
`granularity` then applies to W only, and "token" and "block" (which scale x as it comes) are refused.
"""
import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lowconv.kernels.fp8 import (
    BLOCK, E4M3, LINEAR_GRANULARITIES, Fp8FrozenLinearFunction, abs_max, activate,
    amax_to_scale, block_count, dequantize, fp8_frozen_linear, fp8_linear, quantize_activation,
    quantize_rows_after, quantize_weight,
)
from lowconv.kernels.fp8_all_gather import (Fp8MasterWeight, as_fp8_master_weight, gathered_fp8, master_tensor,
                                            plain_weight_in_state_dict)
from lowconv.kernels.fp8_training import Fp8LinearFunction
from lowconv.kernels.operands import needs_autograd
from lowconv.ops.linear_site import LinearOp, linear_info, site_dtype
from lowconv.ops.registry import register_op


MAX_AMAX_HISTORY = 1024  # TransformerEngine's longest recommended history; longer only costs memory and time


@dataclass
class Fp8Options:
    scaling: Literal["dynamic", "static", "delayed"] = "dynamic"  # how x's scale is chosen
    granularity: Literal["tensor", "row", "token", "block"] = "tensor"  # how x and W are scaled: see the module doc
    fast_accum: bool = True  # cuBLASLt's fast accumulation in the forward GEMM (CUDA; elsewhere fp32 accumulation)
    training: bool = False  # keep a high-precision master weight and train through FP8 GEMMs
    amax_history_len: int = 16  # delayed scaling: how many past amaxes of x are kept
    # delayed scaling: x's scale is max(history) / 448, or the last step's amax / 448 (TransformerEngine's
    # amax_compute_algo)
    amax_reduction: Literal["max", "most_recent"] = "max"
    # training under FSDP2: W quantized to e4m3 on each rank before the all-gather, which then moves 1 byte per
    # weight element (kernels/fp8_all_gather.py); the same numbers as without it
    fp8_all_gather: bool = False

    def __post_init__(self):
        if self.granularity in ("token", "block") and self.scaling != "dynamic":
            raise ValueError(f'"{self.granularity}" scales x per token as it comes; {self.scaling} scaling fixes '
                             f'one scale for x (use "tensor", or "row" for a scale per output channel of W)',
                             "granularity")
        if self.granularity == "block" and self.training:
            raise ValueError('"block" is for inference: training scales W per tensor or per row '
                             '(use "tensor", "row" or "token")', "granularity")
        if self.fp8_all_gather and not self.training:
            raise ValueError("is for training (an inference layer's weight is an e4m3 buffer, which FSDP2 does not "
                             "all-gather): set training = true or leave fp8_all_gather out", "fp8_all_gather")
        if not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY:
            raise ValueError(f"must be in [1, {MAX_AMAX_HISTORY}] (got {self.amax_history_len})", "amax_history_len")


def outside_autocast(forward):
    """An FP8 layer's forward as nn.Linear's is under autocast: x cast to autocast's dtype, so that
    the GEMM writes that dtype (an fp32 x, as a LayerNorm makes under autocast, would take the fp32
    reference GEMM with row scales), the activation it takes computed first where its inputs are in
    another dtype (as the model computed it); inside, autocast off, so that the op keeps its own
    numerics (the CPU reference's fp32 GEMM would run in bf16)."""
    @functools.wraps(forward)
    def forward_in_autocast_dtype(self, input: torch.Tensor, *, activation: str | None = None,
                                  up: torch.Tensor | None = None) -> torch.Tensor:
        device = input.device.type
        if not (torch.is_autocast_enabled(device) and input.is_floating_point()):
            return forward(self, input, activation=activation, up=up)
        dtype = torch.get_autocast_dtype(device)
        if activation is not None and any(t is not None and t.dtype != dtype for t in (input, up)):
            input, activation, up = activate(input, activation, up), None, None
        with torch.autocast(device, enabled=False):
            return forward(self, input.to(dtype), activation=activation, up=up)
    return forward_in_autocast_dtype


@register_op(Fp8Options, name="fp8", kind="linear", timed=True,
             description="FP8 linear: e4m3 weights and activations (tensor or per-row scales), e5m2 gradients")
class Fp8Linear(LinearOp, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, options: Fp8Options):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        if options.training:
            weight = torch.empty(out_features, in_features, dtype=dtype)
            if options.fp8_all_gather:
                weight = Fp8MasterWeight(weight, LINEAR_GRANULARITIES[options.granularity][1])
                self.register_state_dict_post_hook(plain_weight_in_state_dict)
            self.weight = nn.Parameter(weight)
        else:
            scale_shape = {"tensor": (1,), "row": (out_features, 1),
                           "block": (block_count(out_features), block_count(in_features))}[
                LINEAR_GRANULARITIES[options.granularity][1]]
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=E4M3))
            self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        if options.scaling == "static":
            self.register_buffer("input_scale", torch.zeros(1))  # 0 until calibrated or loaded
            self.input_scale_set = False  # a host flag: checking the scale's value would sync the GPU
        if options.scaling == "delayed":
            self.register_buffer("amax_history", torch.zeros(options.amax_history_len))
            self.last_scale = None  # the last forward's x scale, for activation checkpointing's recompute
        if options.scaling != "dynamic":
            # Saturation counters for report_stats; run-time state, not part of the checkpoint. Both
            # count on the device, so compiled graphs and CUDA graph replays count too.
            self.register_buffer("clipped", torch.zeros((), dtype=torch.int64), persistent=False)
            self.register_buffer("elements", torch.zeros((), dtype=torch.int64), persistent=False)
        self.calibrating = False
        self.calibration_amax = None
        self.input_shared = False  # registry.SharesInputStep: set where the model is converted or loaded

    def _apply(self, fn, recurse=True):
        """Module-wide casts (.half(), .float(), .to(dtype)) cast every floating tensor, the e4m3
        weight too, which would lose its scale; it keeps its dtype and follows only the device.
        (The scale, the bias and the input scales take the new dtype as the model's other tensors.)"""
        weight = None if self.options.training else self.weight
        super()._apply(fn, recurse)
        if weight is not None and self.weight.dtype != E4M3:
            self.weight = weight.to(self.weight.device)
        return self

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        if self.options.training:
            self.weight.copy_(weight)
        else:
            granularity, scale_dtype = self.options.granularity, self.weight_scale.dtype
            self.weight, self.weight_scale = quantize_weight(weight, granularity, scale_dtype)
        if bias is not None:
            self.bias.copy_(bias)

    @outside_autocast
    def forward(self, input: torch.Tensor, *, activation: str | None = None,
                up: torch.Tensor | None = None) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        """nn.Linear's forward. With `activation` (kernels/fp8.py ACTIVATIONS) the layer's x is
        activation(input) [* up], which the quantizer computes where it can (a scale per row,
        inference, no autograd): one kernel reads the activation's input once."""
        if activation is not None:
            if self.takes_activation() and not self.calibrating and not needs_autograd(input, up, self.bias):
                x_fp8, x_scale = quantize_rows_after(input, activation, up)
                return fp8_linear(x_fp8, x_scale, self.weight, self.weight_scale, self.bias, input.dtype,
                                  self.options.fast_accum)
            input = activate(input, activation, up)
        return self.calibration_forward(input) if self.calibrating else self.fp8_forward(input)

    def takes_activation(self) -> bool:
        """registry.TakesActivation: dynamic scaling with a scale per row of x, for inference."""
        o = self.options
        return o.scaling == "dynamic" and LINEAR_GRANULARITIES[o.granularity][0] == "row" and not o.training

    def fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        x_scale = self.fixed_input_scale(x)
        o = self.options
        if o.training:
            return Fp8LinearFunction.apply(x, self.weight, self.bias, x_scale, o.granularity, o.fast_accum,
                                           self.clipped if x_scale is not None else None, *gathered_fp8(self.weight))
        args = (x, x_scale, o.granularity, self.weight, self.weight_scale, self.bias, o.fast_accum,
                self.clipped if x_scale is not None else None, not self.input_shared)
        if needs_autograd(x, self.bias):
            return Fp8FrozenLinearFunction.apply(*args)
        return fp8_frozen_linear(*args)

    def input_step(self, x: torch.Tensor):
        """x's dynamic quantization (registry.SharesInputStep): under torch.compile done once for
        every layer of these options that reads x (inductor computes x's scales and casts in one
        kernel)."""
        return quantize_activation(x, self.options.granularity)

    def linear_weight(self) -> torch.Tensor:
        """The master weight (training), or the e4m3 weight dequantized to the model's dtype."""
        if self.options.training:
            return master_tensor(self.weight)
        return dequantize(self.weight, self.weight_scale).to(self.weight_scale.dtype)

    def fixed_input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """x's scale for static/delayed scaling (None: dynamic); the quantizer counts what it clips."""
        if self.options.scaling == "dynamic":
            return None
        if self.options.scaling == "static":
            if not self.input_scale_set:
                self.check_input_scale()
            scale = self.input_scale
        elif self.recomputing() and self.last_scale is not None:
            # Activation checkpointing recomputes the forward, which must compute what it did (the
            # same scale) and not record x in the history again.
            scale = self.last_scale
        else:
            amax = abs_max(x.reshape(-1)).float().reshape(1)
            past = self.amax_history[:1] if self.options.amax_reduction == "most_recent" else \
                self.amax_history.max().reshape(1)
            # An empty history (never calibrated, first step) falls back to the current amax.
            scale = amax_to_scale(torch.where(past > 0, past, amax), E4M3)
            if not torch.compiler.is_compiling():  # only eager recomputes read it (recomputing())
                self.last_scale = scale
            if self.training:  # only training updates the history, so eval outputs are reproducible
                self.amax_history.copy_(torch.cat([amax, self.amax_history[:-1]]))
        self.elements += x.numel()
        return scale

    def check_input_scale(self):
        """Set input_scale_set where the static scale was given some other way than calibration or
        a checkpoint (checked once, eagerly: the check reads the scale on the host)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("fp8 static scaling: input_scale was neither calibrated nor loaded, and a compiled "
                               "graph cannot read it to check: calibrate the module (begin_calibration, run "
                               "inputs, end_calibration), load a checkpoint, or call it once eagerly first")
        if not (self.input_scale > 0).all():
            raise RuntimeError("fp8 static scaling: input_scale is not set; calibrate the module "
                               "(begin_calibration, run inputs, end_calibration) or load a checkpoint")
        self.input_scale_set = True

    @staticmethod
    def recomputing() -> bool:
        """Whether this forward runs inside a backward pass (eager activation checkpointing; a
        compiled graph's recompute does not run the module's Python again)."""
        return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1

    def calibration_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Record x's amax and compute with the unquantized x (its scale is what is being measured)."""
        amax = abs_max(x.reshape(-1)).float().reshape(())
        self.calibration_amax = amax if self.calibration_amax is None else torch.maximum(self.calibration_amax, amax)
        weight = self.weight if self.options.training else dequantize(self.weight, self.weight_scale)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)

    @property
    def needs_calibration(self) -> bool:
        return self.options.scaling != "dynamic"

    def begin_calibration(self):
        self.calibrating = self.needs_calibration
        self.calibration_amax = None

    @torch.no_grad()
    def end_calibration(self):
        if self.calibrating and self.calibration_amax is not None:
            if self.options.scaling == "static":
                self.input_scale.copy_(amax_to_scale(self.calibration_amax, E4M3).reshape(1))
                self.input_scale_set = True
            else:
                self.amax_history.zero_()
                self.amax_history[0] = self.calibration_amax
        self.calibrating = False
        self.calibration_amax = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.options.fp8_all_gather:  # load_state_dict(assign=True) put a plain tensor there
            self.weight = as_fp8_master_weight(self.weight, LINEAR_GRANULARITIES[self.options.granularity][1])
        if self.options.scaling == "static" and f"{prefix}input_scale" in state_dict:
            self.input_scale_set = bool((self.input_scale > 0).all())  # read once here, not per call

    def loaded_state_problem(self) -> str | None:
        """What is wrong with the scales a checkpoint gave this module (lowconv.load asks), or None:
        a scale that is zero, negative or not finite would turn every output into inf or NaN."""
        scales = {"input_scale": getattr(self, "input_scale", None),
                  "weight_scale": None if self.options.training else self.weight_scale}
        for name, scale in scales.items():
            if scale is not None and not (torch.isfinite(scale) & (scale > 0)).all():
                return f"{name} must be finite and > 0, got {scale.flatten()[:4].tolist()}"
        history = getattr(self, "amax_history", None)
        if history is not None and not (torch.isfinite(history) & (history >= 0)).all():
            return f"amax_history must be finite and >= 0, got {history.flatten()[:4].tolist()}"
        return None

    def report_stats(self) -> dict[str, float]:
        if self.options.scaling == "dynamic":
            return {}
        return {"clipped": float(self.clipped), "elements": float(self.elements)}

    def extra_repr(self) -> str:
        o = self.options
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scaling={o.scaling}, granularity={o.granularity}, training={o.training}"
                + (f", amax_history_len={o.amax_history_len}, amax_reduction={o.amax_reduction}"
                   if o.scaling == "delayed" else "") + (", fp8_all_gather=True" if o.fp8_all_gather else ""))

    @classmethod
    def site_problem(cls, site, options: Fp8Options) -> str | None:
        info = linear_info(site)
        if info.in_features % 16 or info.out_features % 16:
            return (f"fp8 GEMM needs in_features and out_features divisible by 16 "
                    f"(got K={info.in_features}, N={info.out_features})")
        if options.granularity == "block" and (info.in_features % BLOCK or info.out_features % BLOCK):
            return (f"fp8 block scaling needs in_features and out_features divisible by {BLOCK}, as "
                    f"compressed-tensors, vLLM and cuBLASLt's block modes take them (got K={info.in_features}, "
                    f"N={info.out_features})")
        return None

    @classmethod
    def empty(cls, site, options: Fp8Options) -> "Fp8Linear":
        info = linear_info(site)
        return cls(info.in_features, info.out_features, info.bias, site_dtype(site), options)
