"""Conversion memory on CUDA, where issue 22 measured it: convert's peak within two copies of the
weights and one forward's activations, and nothing of it left allocated once it returns, without
a gc.collect() (run on the lent GPU by scripts/gpu_check.sh)."""
import gc
from pathlib import Path

import pytest
import torch

import lowconv
from lowconv.model_file import import_file
from tests.test_convert_memory import SLACK, held_by

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[1]


def wide_gpt():
    """examples/gpt.py at Llama-like width in bfloat16 (about 540 MB of weights), prefill 8 x 1024."""
    gpt = import_file(ROOT / "examples" / "gpt.py")
    torch.manual_seed(0)
    model = gpt.GPT(vocab=32000, context=1024, dim=2048, depth=4, heads=16).to("cuda", torch.bfloat16).eval()
    return model, (torch.randint(0, 32000, (8, 1024), device="cuda"),)


@pytest.mark.parametrize("recipe", ["fp8-row", "semi-sparse", "sparse-attention-bf16", "mixed"])
def test_convert_peak_and_what_it_leaves_on_cuda(recipe):
    model, inputs = wide_gpt()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    lowconv.convert(model, recipe, inputs)  # once before: kernels compiled, library workspaces allocated
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(*inputs)
    activations = torch.cuda.max_memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    gc.disable()
    try:
        converted = lowconv.convert(model, recipe, inputs)
        peak = torch.cuda.max_memory_allocated() - before
        left = torch.cuda.memory_allocated() - before - sum(held_by(converted, "cuda").values())
    finally:
        gc.enable()
    mib = 2**20
    assert peak <= 2 * weights + activations + SLACK, (
        f"{recipe}: convert peaked {peak / mib:.0f} MiB over the model ({weights / mib:.0f} MiB of weights, "
        f"one forward {activations / mib:.0f} MiB)")
    assert left <= 4 * mib, f"{recipe}: convert left {left / mib:.1f} MiB allocated beside the converted model"
