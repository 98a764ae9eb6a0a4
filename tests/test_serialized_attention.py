"""Point Transformer V3's serialized-patch attention (examples/serialized_attention.py, its path
without flash-attn): each block's patch attention is found as a hand-written attention site, its
relative position bias as the additive mask, and converts exactly in float32 on the CPU, the
bias table's gradient included."""
import pytest
import torch

import lowconv
from examples import serialized_attention
from lowconv.recipe import parse_recipe

FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')


@pytest.mark.parametrize("rel_pos", [True, False], ids=["relative position bias", "no bias"])
def test_each_patch_attention_converts_exactly_with_its_gradients(rel_pos):
    torch.manual_seed(0)
    model = serialized_attention.SerializedNet(rel_pos=rel_pos)
    (points,) = serialized_attention.example_inputs()
    converted = lowconv.convert(model, FLOAT32, (points,))
    sites = converted.lowconv_plan.converted()
    assert [d.fqn for d in sites] == ["blocks.0.attn.attention", "blocks.1.attn.attention"]
    patches = -(-serialized_attention.N_POINTS // serialized_attention.PATCH_SIZE)
    for decision in sites:
        info = decision.site.info
        assert (info.form, info.mask, info.heads, info.head_dim) == (
            "handwritten", "additive" if rel_pos else "none", serialized_attention.HEADS, 16)
        assert decision.site.input.shape == (patches, serialized_attention.HEADS, serialized_attention.PATCH_SIZE, 16)
    out, want = converted(points), model(points)
    assert torch.equal(out, want)
    out.square().mean().backward()
    want.square().mean().backward()
    grads = dict(converted.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(grads[name].grad, parameter.grad), name
    if rel_pos:
        assert model.blocks[0].attn.rpe.table.grad.norm() > 0


def test_the_bf16_recipe_converts_it_within_bf16_rounding():
    model = serialized_attention.build_model()
    inputs = serialized_attention.example_inputs()
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert len(converted.lowconv_plan.converted()) == 2
    assert lowconv.compare(model, converted, inputs).outputs[0].metrics.sqnr_db > 60
