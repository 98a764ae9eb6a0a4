"""timm and torchvision models: every linear and attention site found, and each recipe converts and
passes its gate; timm's Swin with fused attention on and off, its shifted-window attention (a
relative position bias plus a shift mask added to reshaped scores) checked against the model.

gpu-marked: the CPU suite's torch has no torchvision beside it, which timm needs. They run on the
GPU machine (scripts/gpu_check.sh, part `real`), and on the CPU wherever timm and torchvision
import (`pytest -m gpu tests/test_real_models_gpu.py` in a venv with both)."""
import pytest
import torch
from torch import nn

import lowconv
from lowconv.analysis import analyze
from lowconv.model_sources import load_model
from lowconv.recipe import parse_recipe

pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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
    loaded = load_model(spec, device=DEVICE)
    linears = {name for name, m in loaded.model.named_modules() if isinstance(m, nn.Linear)}
    for recipe in RECIPES:
        converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
        plan = converted.lowconv_plan
        found = {d.site.info.weight.removesuffix(".weight") for d in plan.decisions if d.site.kind == "linear"}
        expanded = {f"{fqn}.in_proj" for fqn in plan.expanded_mha}  # nn.MultiheadAttention's packed projection
        assert found == linears | expanded, sorted((linears | expanded) ^ found)
        attention = [d for d in plan.decisions if d.site.kind == "attention"]
        assert len(attention) == attention_modules and not any(d.site.unsupported for d in attention)
        report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=loaded.logits)
        assert report.passed, lowconv.report.report_to_table(report)
        if recipe == "sparse-attention-bf16":
            assert len(plan.converted()) == attention_modules
        else:
            assert plan.converted(), recipe


@pytest.mark.parametrize("timm_fused_attention", [True, False], indirect=True, ids=["fused", "not-fused"])
def test_timm_vit(timm_fused_attention):
    check_coverage_and_gates("timm:vit_base_patch16_224", 12)


@pytest.mark.parametrize("timm_fused_attention", [True, False], indirect=True, ids=["fused", "not-fused"])
def test_timm_swin_windowed_attention(timm_fused_attention):
    check_coverage_and_gates("timm:swin_tiny_patch4_window7_224", 12)


def attention_recipe(dtype: str):
    return parse_recipe(f'[[rules]]\nkind = "attention"\nop = "sparse_attention"\noptions = {{ dtype = "{dtype}" }}\n')


def relative_error(x, reference) -> float:
    return ((x.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.mark.parametrize("timm_fused_attention", [True, False], indirect=True, ids=["fused", "not-fused"])
def test_swin_shifted_windows_convert_to_what_the_model_computes(timm_fused_attention):
    """A small Swin: 2 stages of a plain and a shifted-window block. Each attention converts with
    its bias and shift mask as one additive mask; in float32 it computes what the model does
    (the model without its shift masks is 10x further off than bfloat16)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, embed_dim=32, depths=(2, 2),
                              num_heads=(2, 4), img_size=112, num_classes=10).eval().to(DEVICE)
    shifted = [name for name, m in model.named_modules() if getattr(m, "attn_mask", None) is not None]
    assert shifted == ["layers.0.blocks.1", "layers.1.blocks.1"]
    x = torch.randn(2, 3, 112, 112, device=DEVICE)
    with torch.no_grad():
        expected = model(x)
        found = analyze(model, x)  # the graph the attention pass leaves computes what the model does
        assert relative_error(found.trace.regions[0].graph(x), expected) < 1e-6
        without_shift = found.model
        for name in shifted:
            without_shift.get_submodule(name).attn_mask.zero_()
        shift_matters = relative_error(without_shift(x), expected)
    sites = [s for s in found.sites if s.kind == "attention"]
    assert len(sites) == 4 and {(s.info.mask, s.unsupported) for s in sites} == {("additive", None)}
    errors = {}
    for dtype in ("float32", "bfloat16"):
        converted = lowconv.convert(model, attention_recipe(dtype), x)
        assert len(converted.lowconv_plan.converted()) == 4
        with torch.no_grad():
            errors[dtype] = relative_error(converted(x), expected)
    # float32: the CPU reference's roundings, or the CUDA kernel's (its fp32 products are 3-pass tf32)
    assert errors["float32"] < 1e-5 and 1e-5 < errors["bfloat16"] < shift_matters / 5


def test_torchvision_vit_b_16():
    pytest.importorskip("torchvision", reason="the torchvision test needs torchvision")
    check_coverage_and_gates("torchvision:vit_b_16", 12)
