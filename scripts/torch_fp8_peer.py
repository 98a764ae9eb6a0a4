"""The free alternative to lowconv's fp8-row that issue 22 measured: a torch-native FP8 linear, per-token
and per-channel scales in torch ops around torch._scaled_mm (no custom kernel), swapped into a copy of
a model for every nn.Linear but its lm_head (as fp8-row keeps it). Compiled, inductor fuses each
quantization into the op that makes its input. A linear inside nn.MultiheadAttention stays: that module
reads its out_proj's weight itself. A peer for scripts/bench_models.py, not part of lowconv."""
import copy

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def rowwise_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in e4m3, its (rows, 1) float32 dequant scales): one scale per row of a 2D t."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class TorchFp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight, scale = rowwise_e4m3(linear.weight.detach())
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.reshape(1, -1))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp8, x_scale = rowwise_e4m3(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(x_fp8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, bias=self.bias,
                             out_dtype=x.dtype, use_fast_accum=True)
        return y.reshape(*x.shape[:-1], -1)


def torch_fp8_row(model: nn.Module) -> nn.Module:
    """A copy of `model` whose nn.Linear layers but lm_head and those of nn.MultiheadAttention are TorchFp8Linear."""
    model = copy.deepcopy(model)
    in_attention = {f"{name}.{child}" for name, module in model.named_modules()
                    if isinstance(module, nn.MultiheadAttention) for child, _ in module.named_children()}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.split(".")[-1] != "lm_head" and name not in in_attention:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, TorchFp8Linear(module))
    return model
