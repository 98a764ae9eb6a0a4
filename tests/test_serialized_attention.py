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


def test_contextual_patches_are_sptrs_attention_within_each_patch():
    """contextual=True: each patch attended with SpTr's contextual relative position on its
    points' patch_coordinates, as the float64 definition computes it (one dense softmax per patch);
    with its tables at zero, the same as PTv3's attention without bias."""
    from tests.test_window_attention import dense_window_attention64

    torch.manual_seed(0)
    model = serialized_attention.SerializedNet(rel_pos=False, contextual=True).double()
    (points,) = serialized_attention.example_inputs()
    attn = model.blocks[0].attn
    K, H = serialized_attention.PATCH_SIZE, serialized_attention.HEADS
    for table in attn.contextual:
        table.data.normal_(std=0.5)  # terms that move the logits visibly
    xyz = points[:, :3].double()
    grid = torch.floor((xyz - xyz.amin(0)) / serialized_attention.GRID_SIZE).long()
    order, inverse = serialized_attention.serialize(grid, K)
    feat = torch.randn(points.shape[0], serialized_attention.CHANNELS, dtype=torch.float64)
    coords = serialized_attention.patch_coordinates(grid[order], K)
    assert coords.min() >= 0 and coords.max() == serialized_attention.CONTEXT_GRID - 1
    q, k, v = attn.qkv(feat)[order].reshape(-1, 3, H, 16).unbind(dim=1)
    offsets = torch.arange(0, q.shape[0] + 1, K)
    want = attn.proj(dense_window_attention64(q, k, v, offsets, attn.scale, coords, tuple(attn.contextual))
                     .reshape(-1, serialized_attention.CHANNELS)[inverse])
    torch.testing.assert_close(attn(feat, grid, order, inverse), want, rtol=1e-10, atol=1e-10)

    plain = serialized_attention.SerializedNet(rel_pos=False).double()
    plain.load_state_dict(model.state_dict(), strict=False)
    for block in model.blocks:
        for table in block.attn.contextual:
            table.data.zero_()
    torch.testing.assert_close(model(points.double()), plain(points.double()), rtol=1e-10, atol=1e-10)
