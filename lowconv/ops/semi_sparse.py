"""`semi_sparse`: 2:4 sparse linear layers (2 of every 4 consecutive input features kept).

Which module, and its state dict, by options:
    target="weight", mask="fixed", inference    CompressedSemiSparseLinear
        compressed (out, in/2), bitmask uint8 (out, ceil(in/8)), shape int64 (2, 1), bias
        (compressed-tensors' sparse-24-bitmask; no dense weight in the checkpoint)
    target="weight", mask="fixed", training     MaskedSemiSparseLinear: weight (the kept values, (out, in/2)),
                                                mask bool (out, in), bias
    target="weight", mask="runtime"             RuntimeSemiSparseLinear: weight (dense), bias;
                                                re-pruned every forward (torchao's SemiSparseLinear)
    target="activation"                         RuntimeSemiSparseLinear: weight (dense), bias; x is
                                                pruned every forward (`mask` does not apply)

On CUDA the two fixed-mask modules run cuSPARSELt's 2:4 GEMM (lowconv.kernels.cusparselt, through
the custom ops of lowconv.kernels.sparse24) or the masked dense product, as `backend` says; "auto"
times both on the site's own GEMM (rows M from its traced input, dtype, bias; forward and backward
for training) and keeps the faster (BackendChoice, in `module.choice`). Runtime masks and
activation targets run the masked dense product: their cuSPARSELt path is not built. The CPU runs
the masked dense reference.

When the CUDA backend is chosen, and when what it needs is made: eagerly, never inside
torch.compile. A module chooses for a device and dtype when converted on a GPU, or else at its
first eager call on that GPU (where "auto" times both GEMMs), and at once prepares the chosen
backend (cuSPARSELt's copy of the weight and its plans, or the dense weight); .to() and
load_state_dict prepare it again for the module's new device, dtype or weights. Under
torch.compile a module runs the backend chosen and prepared for its input's device and dtype; one
not chosen yet runs masked-dense and chooses (times) nothing, and a compressed layer whose dense
weight is not made yet unpacks it in the graph, on every call (on the CPU too). So convert on the
GPU, or run the model once eagerly there, before compiling it: the compiled model then runs what
the plan says.
"""
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowconv.errors import LowconvError
from lowconv.kernels.cusparselt import SparseGemm, shape_problem
from lowconv.kernels.pack24 import kept_codes, pack_kept_reference
from lowconv.kernels.sparse24 import (
    BackendChoice, GemmCase, TrainingGemms, bitmask_to_dense, choose_backend, compress_bitmask, compressed_linear,
    decompress_bitmask, fixed_mask_linear, kept_to_dense, mask_24, mask_24_transposable, prune_24_straight_through,
    semi_sparse_linear, unpack_bits,
)
from lowconv.ops.linear_site import LinearOp, in_autocast_dtype, linear_info, site_dtype, site_rows
from lowconv.ops.registry import register_op


@dataclass
class SemiSparseOptions:
    target: Literal["weight", "activation"] = "weight"  # which GEMM operand is 2:4
    mask: Literal["fixed", "runtime"] = "fixed"  # weight only: prune once, or by magnitude every forward
    training: bool = False  # fixed mask: keep the kept values trainable (and the mask) instead of compressing
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
    """What both fixed-mask modules share: the CUDA backend, chosen once per device and dtype, and
    prepared (module doc)."""

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

    def backend(self, x: torch.Tensor) -> str:
        """The backend x runs on (see the module doc): masked-dense on the CPU; on a GPU, eagerly,
        the one chosen for x's device and dtype (chosen now if not yet), prepared now if not yet;
        under torch.compile the one chosen and prepared, if any, else masked-dense."""
        if not x.is_cuda:
            return "masked-dense"
        device, dtype = x.device, self.device_and_dtype()[1]
        if not torch.compiler.is_compiling():
            self.decide(device, x.numel() // self.in_features, dtype)
            self.prepare()
        if self.chosen_for == (device, dtype) and self.choice.backend == "cusparselt" and self.cusparselt_ready():
            return "cusparselt"
        return "masked-dense"

    def prepare(self):
        """What the chosen backend needs, made if a choice was made for the module's own device and
        dtype: on the GPU, before any torch.compile trace needs it."""
        if self.choice is not None and self.chosen_for == self.device_and_dtype():
            self.prepare_backend(self.choice.backend)

    def _apply(self, fn, recurse=True):
        before = self.device_and_dtype()
        module = super()._apply(fn, recurse)
        if self.device_and_dtype() != before:  # .to() / .cuda() / .half(): what was made is for the old ones
            self.forget_cuda_state()
            self.prepare()
        return module

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
        # The dense pruned weight of the masked dense product; the weight in cuSPARSELt's layout and
        # its GEMM's plans (a SparseGemm) for the cusparselt backend, on one GPU. Derived from the
        # three tensors above, so they stay out of the checkpoint; the dense weight is empty while
        # cuSPARSELt's copy is in use.
        self.register_buffer("dense_weight", torch.empty(0, dtype=dtype), persistent=False)
        self.register_buffer("cusparselt_weight", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.gemm: SparseGemm | None = None
        self.register_load_state_dict_post_hook(remake_derived_weights)

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.compressed, self.bitmask, self.shape = compress_bitmask(weight * fixed_mask(weight, self.options))
        if bias is not None:
            self.bias.copy_(bias)
        self.forget_cuda_state()
        if weight.is_cuda and self.rows:  # converting on a GPU: the plan gets the measured choice
            self.decide(weight.device, self.rows, weight.dtype)
            self.prepare()

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        return self.compressed.device, self.compressed.dtype

    def dense(self) -> torch.Tensor:
        """The dense pruned weight (out, in), rebuilt from the bitmask format when not kept: kept by
        an eager call, made in the graph (for every call) under torch.compile."""
        if self.dense_weight.numel():
            return self.dense_weight
        if torch.compiler.is_compiling():
            return bitmask_to_dense(self.compressed, self.bitmask, self.in_features)
        self.dense_weight = decompress_bitmask(self.compressed, self.bitmask, self.shape)
        return self.dense_weight

    def prepare_backend(self, backend: str):
        """cuSPARSELt's copy of the weight (the dense one dropped: saving memory is the point), or
        the dense weight."""
        if backend == "masked-dense":
            self.dense()
        elif not self.cusparselt_ready():
            self.gemm = SparseGemm(self.out_features, self.in_features, self.compressed.dtype, self.compressed.device)
            self.cusparselt_weight = self.gemm.compress(self.linear_weight())
            self.dense_weight = self.dense_weight.new_empty(0)

    def cusparselt_ready(self) -> bool:
        return self.gemm is not None

    def forget_cuda_state(self):
        """The derived weights and plans, dropped: new weights, device or dtype."""
        self.dense_weight = self.dense_weight.new_empty(0)
        self.cusparselt_weight = self.cusparselt_weight.new_empty(0)
        self.gemm = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if self.backend(input) == "cusparselt":
            y = compressed_linear(input, self.cusparselt_weight, self.bias, self.compressed, self.bitmask,
                                  self.gemm.key, self.tuned(input))
        else:
            y = semi_sparse_linear(input, self.dense(), self.bias)
        return in_autocast_dtype(y)

    def linear_weight(self) -> torch.Tensor:
        """The (out, in) weight a plain nn.Linear needs to compute what this module does."""
        return decompress_bitmask(self.compressed, self.bitmask, self.shape)

    def loaded_state_problem(self) -> str | None:
        """What is wrong with the 2:4 tensors a checkpoint gave this module (lowconv.load asks), or
        None: a `shape` other than the layer's, or a bitmask that does not keep exactly 2 of every 4
        weights (each would crash at the first call, or compute another layer)."""
        size = [[self.out_features], [self.in_features]]
        if self.shape.tolist() != size:
            return f"shape must be {size}, got {self.shape.tolist()}"
        return two_of_four_problem(unpack_bits(self.bitmask, self.in_features), "bitmask")


@torch.no_grad()
def remake_derived_weights(module: CompressedSemiSparseLinear, incompatible_keys=None):
    """After load_state_dict: the dense and cuSPARSELt copies of the weight that were made are made
    again from the loaded tensors, into the same memory (a CUDA graph that captured a forward reads
    the new ones); copies left on another device or dtype (load_state_dict(assign=True)) are dropped."""
    where = module.device_and_dtype()
    if module.gemm is not None and (module.gemm.device, module.gemm.dtype) != where \
            or module.dense_weight.numel() and (module.dense_weight.device, module.dense_weight.dtype) != where:
        module.forget_cuda_state()
        module.prepare()
        return
    if module.dense_weight.numel():
        module.dense_weight.copy_(module.linear_weight())
    if module.gemm is not None:
        module.cusparselt_weight.copy_(module.gemm.compress(module.linear_weight()))


class MaskedSemiSparseLinear(FixedMaskLinear):
    """Fine-tuning with a fixed 2:4 mask. The trainable `weight` is the kept values alone, (out,
    in/2), two of every 4 along in_features in order (the bitmask format's `compressed`), so pruned
    weights stay zero and the optimizer steps half the entries; the masked-dense forward makes the
    dense pruned weight from them (kept_to_dense). A dense weight with zeros under the mask would cost the
    optimizer more than its share: torch's fused AdamW took 8.7 ms against 5.9 on llama-2048 whose
    MLP weights, gradients and moments were half exact zeros (H200; BENCHMARKS.md). On CUDA with
    cuSPARSELt: the forward (and dX when transposable) through 2:4 GEMMs, which take the kept values
    as they are (a copy, no gather from a dense weight), dW dense."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 options: SemiSparseOptions, rows: int | None = None):
        super().__init__(in_features, out_features, options, rows)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=dtype))
        self.register_buffer("mask", torch.empty(out_features, in_features, dtype=torch.bool))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.gemms: TrainingGemms | None = None  # cuSPARSELt's plans, on one GPU
        self.register_load_state_dict_post_hook(compress_under_loaded_mask)

    @torch.no_grad()
    def set_params(self, weight: torch.Tensor, bias: torch.Tensor | None):
        mask = fixed_mask(weight, self.options)  # on the weight's device, which may not be the module's yet
        self.mask.copy_(mask)
        self.weight.copy_(pack_kept_reference(weight, kept_codes(mask)))
        if bias is not None:
            self.bias.copy_(bias)
        if weight.is_cuda and self.rows:
            self.decide(weight.device, self.rows, weight.dtype)
            self.prepare()

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        return self.weight.device, self.weight.dtype

    def prepare_backend(self, backend: str):
        if backend == "cusparselt" and not self.cusparselt_ready():
            self.gemms = TrainingGemms.of(self.out_features, self.in_features, self.weight.dtype, self.weight.device,
                                          self.options.transposable, self.rows)
            # Their buffers made now: made at the first call, under CUDA graph trees they would be
            # taken from the graph's pool and outlive the call that made them.
            self.gemms.compressions(self.mask)

    def cusparselt_ready(self) -> bool:
        return self.gemms is not None

    def forget_cuda_state(self):
        self.gemms = None  # cuSPARSELt's plans belong to a device and dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass input=
        if self.backend(input) == "cusparselt":
            y = fixed_mask_linear(input, self.weight, self.mask, self.bias, self.gemms.key)
        else:
            y = semi_sparse_linear(input, self.linear_weight(), self.bias)
        return in_autocast_dtype(y)

    def linear_weight(self) -> torch.Tensor:
        """The dense pruned weight (out, in), made from the kept values (differentiably)."""
        return kept_to_dense(self.weight, self.mask)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        """A mask that does not keep exactly 2 of every 4 weights is refused, naming its key,
        before anything of the layer is written (model.load_state_dict and lowconv.load): its
        values would sit where the mask says, which no 2:4 GEMM takes."""
        mask = state_dict.get(prefix + "mask")
        problem = two_of_four_problem(mask, "mask") if mask is not None and mask.shape == self.mask.shape else None
        if problem:
            raise LowconvError(f"{prefix}mask: {problem}")
        super()._load_from_state_dict(state_dict, prefix, *args)


def compress_under_loaded_mask(module: MaskedSemiSparseLinear, incompatible_keys=None):
    """After load_state_dict: cuSPARSELt's compressions follow the loaded mask now, in place (a
    CUDA graph that captured a training step runs under the new mask), not at the next call."""
    if module.gemms is not None:
        module.gemms.compressions(module.mask)


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


def two_of_four_problem(mask: torch.Tensor, name: str) -> str | None:
    """What is wrong with a loaded 2:4 bool mask (rows, cols) that does not keep exactly 2 of every
    4 along cols, or None."""
    groups = mask.reshape(mask.shape[0], -1, 4).sum(-1)
    wrong = (groups != 2).sum().item()
    if not wrong:
        return None
    kept = sorted(set(groups[groups != 2].tolist()))
    return f"{name} must keep 2 of every 4 weights; {wrong} groups of 4 keep {kept}"


def fixed_mask(weight: torch.Tensor, options: SemiSparseOptions) -> torch.Tensor:
    """The 2:4 mask a fixed-mask module keeps: by magnitude along in_features, transposable if asked."""
    return mask_24_transposable(weight) if options.transposable else mask_24(weight)


def module_class(options: SemiSparseOptions) -> type[nn.Module]:
    if options.target == "activation" or options.mask == "runtime":
        return RuntimeSemiSparseLinear
    return MaskedSemiSparseLinear if options.training else CompressedSemiSparseLinear


@register_op(SemiSparseOptions, name="semi_sparse", kind="linear",
             description="2:4 semi-structured sparse linear (weight or activation pruned along in_features)")
class SemiSparse(LinearOp):
    """The op's builder: its module class depends on the options (module_class)."""

    @staticmethod
    def site_problem(site, options: SemiSparseOptions) -> str | None:
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
            return next(filter(None, (shape_problem(*shape, dtype) for shape in shapes)), None)
        return None

    @staticmethod
    def empty(site, options: SemiSparseOptions) -> nn.Module:
        info = linear_info(site)
        module = module_class(options)
        if issubclass(module, FixedMaskLinear):
            return module(info.in_features, info.out_features, info.bias, site_dtype(site), options, site_rows(site))
        return module(info.in_features, info.out_features, info.bias, site_dtype(site), options)
