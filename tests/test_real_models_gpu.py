"""timm and torchvision models on the GPU machine (the CPU machines cannot import torchvision
beside their torch, and timm needs it): every linear and attention site found, and each recipe
converts and passes its gate. Run there by scripts/gpu_check.sh (part `real`)."""
import pytest
import torch
from torch import nn

import lowconv
from lowconv.model_sources import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
RECIPES = ["fp8-dynamic", "semi-sparse", "sparse-attention-bf16"]


@pytest.fixture
def timm_fused_attention(request):
    """timm's fused (SDPA) attention on or off for the models built in the test, restored after
    (Swin's fused path is 'experimental' in timm: switched with it)."""
    timm = pytest.importorskip("timm", reason="the timm tests need timm")
    config = timm.layers.config
    before = config._USE_FUSED_ATTN
    timm.layers.set_fused_attn(request.param, experimental=request.param)
    yield request.param
    config._USE_FUSED_ATTN = before


def check_coverage_and_gates(spec: str, attention_modules: int):
    loaded = load_model(spec, device="cuda")
    linears = {name for name, m in loaded.model.named_modules() if isinstance(m, nn.Linear)}
    for recipe in RECIPES:
        converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
        plan = converted.lowconv_plan
        found = {d.site["info"]["weight"].removesuffix(".weight") for d in plan.decisions if d.site["kind"] == "linear"}
        assert found == linears, sorted(linears - found)
        attention = [d for d in plan.decisions if d.site["kind"] == "attention"]
        assert len(attention) == attention_modules and not any(d.site["unsupported"] for d in attention)
        report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=loaded.logits)
        assert report.passed, lowconv.report.report_to_table(report)
        if recipe == "sparse-attention-bf16":
            assert len(plan.converted()) == attention_modules
        else:
            assert plan.converted(), recipe


@pytest.mark.parametrize("timm_fused_attention", [True, False], indirect=True, ids=["fused", "not-fused"])
def test_timm_vit(timm_fused_attention):
    check_coverage_and_gates("timm:vit_base_patch16_224", 12)


@pytest.mark.parametrize("timm_fused_attention", [True], indirect=True, ids=["fused"])
def test_timm_swin_windowed_attention(timm_fused_attention):
    check_coverage_and_gates("timm:swin_tiny_patch4_window7_224", 12)


def test_torchvision_vit_b_16():
    pytest.importorskip("torchvision", reason="the torchvision test needs torchvision")
    check_coverage_and_gates("torchvision:vit_b_16", 12)
