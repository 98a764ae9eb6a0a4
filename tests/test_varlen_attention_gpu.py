"""flash-attn varlen calls converted on CUDA (the window-attention Triton kernels), with the torch
stand-in for flash_attn: Point Transformer V3's flash path against the call in float64, compiled
whole by inductor and replayed in CUDA graphs (run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import lowconv
from examples import serialized_attention
from lowconv.recipe import parse_recipe
from tests import flash_attn_stand_in
from tests.compiled import compile_recording, lowconv_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
IN_SITE_DTYPE = parse_recipe('[[rules]]\nop = "sparse_attention"')  # fp16: the call's inputs'


@pytest.fixture
def ptv3(monkeypatch):
    """PTv3's flash path on CUDA, converted, and its input."""
    monkeypatch.setattr(serialized_attention, "flash_attn", flash_attn_stand_in.installed(monkeypatch))
    torch.manual_seed(0)
    model = serialized_attention.SerializedNet(rel_pos=False, flash=True).eval().cuda()
    (points,) = serialized_attention.example_inputs()
    points = points.cuda()
    return model, lowconv.convert(model, IN_SITE_DTYPE, (points,)), points


def sqnr_db(got, want):
    return (10 * torch.log10(want.square().sum() / (got - want).square().sum())).item()


def test_ptv3s_flash_path_runs_the_window_kernel_within_fp16_rounding(ptv3):
    model, converted, points = ptv3
    assert [d.site.info.form for d in converted.lowconv_plan.converted()] == ["varlen", "varlen"]
    traced, graphs = compile_recording(converted)
    with torch.no_grad():
        got, want = traced(points), model.double()(points.double())
    assert "lowconv::window_attention_forward" in lowconv_ops(graphs)
    # The original in float64 around the call, which the stand-in computes in fp32 from the fp16 q, k, v
    # the kernel takes too.
    assert sqnr_db(got.double(), want) > 55


def test_the_converted_model_compiles_whole_and_replays_in_cuda_graphs(ptv3):
    _, converted, points = ptv3
    with torch.no_grad():
        eager = converted(points)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(converted, fullgraph=True)
        torch.testing.assert_close(compiled(points), eager, rtol=2e-3, atol=2e-3)
        assert counters["graph_break"] == {}
        torch._dynamo.reset()
        reduced = torch.compile(converted, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            torch.testing.assert_close(reduced(points), eager, rtol=2e-3, atol=2e-3)


def test_ptv3_with_contextual_relative_position_runs_the_window_kernel():
    """examples/serialized_attention.py's contextual=True on CUDA (the Triton kernel) against the
    same model in float64 on the CPU (the torch reference): the whole model in float32 with the
    tables' gradients, one block's patch attention in float16 (whole-model fp16 rounds the points
    themselves, which moves them between grid cells)."""
    torch.manual_seed(0)
    model = serialized_attention.SerializedNet(rel_pos=False, contextual=True).double()
    for name, parameter in model.named_parameters():
        if "contextual" in name:
            parameter.data.normal_(std=0.5)
    (points,) = serialized_attention.example_inputs()
    want = model(points.double())
    want.square().mean().backward()
    on_gpu = serialized_attention.SerializedNet(rel_pos=False, contextual=True).cuda()
    on_gpu.load_state_dict(model.state_dict())
    got = on_gpu(points.cuda())
    got.square().mean().backward()
    assert sqnr_db(got.double().cpu(), want.detach()) > 100
    for table, want_table in zip(on_gpu.blocks[0].attn.contextual, model.blocks[0].attn.contextual):
        assert sqnr_db(table.grad.double().cpu(), want_table.grad) > 80

    attn = model.blocks[0].attn
    xyz = points[:, :3].double()
    grid = torch.floor((xyz - xyz.amin(0)) / serialized_attention.GRID_SIZE).long()
    order, inverse = serialized_attention.serialize(grid, serialized_attention.PATCH_SIZE)
    feat = torch.randn(points.shape[0], serialized_attention.CHANNELS, dtype=torch.float64)
    half = on_gpu.blocks[0].attn.half()
    got = half(feat.cuda().half(), *(t.cuda() for t in (grid, order, inverse)))
    assert sqnr_db(got.double().cpu(), attn(feat, grid, order, inverse).detach()) > 45
