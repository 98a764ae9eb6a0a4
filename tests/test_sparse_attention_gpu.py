"""The sparse_attention op on CUDA: SDPA where it computes the same thing (against float64), the
backend each converted site runs, and converted models compiled whole by inductor (no graph break)
and captured in CUDA graphs, equal to eager (run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import lowconv
from lowconv.ops.window_attention import SparseWindowAttention
from lowconv.kernels.block_attention import block_attention_reference, block_attention_sdpa
from lowconv.kernels.cuda_timing import captured
from tests.test_block_attention import TOLERANCE, make_problem, outputs_and_grads, rel_error
from tests.test_sparse_attention_op import CausalBlock, attention_recipe, spy_on_plans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# Compiled or captured against eager, float32: the same kernels agree to rounding, but a masked call
# may run SDPA traced where eagerly it ran the Triton kernels (3-pass tf32) on the mask's tiles.
BACKENDS_AGREE = 1e-3


def holes_and_empty_rows(seq_q, seq_k, seed):
    """A (batch, 1, seq_q, seq_k) keep mask with random holes and two query rows with no key."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(2, 1, seq_q, seq_k, generator=gen, device="cuda") > 0.3
    keep[:, :, [3, 500]] = False
    return keep


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["dense", "causal", "causal square gqa", "holes", "additive", "padding"])
def test_sdpa_path_matches_float64_on_cuda(case, dtype):
    """block_attention_sdpa as the op calls it on CUDA (flash with enable_gqa, efficient with a
    mask, rows with no key): the reference's float64 output and gradients within the dtype's bound."""
    seq_k = 1000 if case == "causal square gqa" else 1100
    problem = make_problem(2, 8, 2, 1000, seq_k, 64, seed=21)
    kwargs = {"dense": {}, "causal": dict(layout="causal"), "causal square gqa": dict(layout="causal"),
              "holes": dict(mask=holes_and_empty_rows(1000, seq_k, 22))}.get(case, {})
    if case == "additive":
        keep = holes_and_empty_rows(1000, seq_k, 23)
        kwargs = dict(mask=torch.randn(keep.shape, device="cuda").masked_fill(~keep, float("-inf")))
    if case == "padding":
        kwargs = dict(key_padding_mask=torch.arange(seq_k, device="cuda")[None, :]
                      >= torch.tensor([seq_k, 300], device="cuda")[:, None])
    got = outputs_and_grads(lambda q, k, v: block_attention_sdpa(q, k, v, dtype=dtype, **kwargs), problem)
    want = outputs_and_grads(lambda q, k, v: block_attention_reference(q, k, v, **kwargs), problem)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(x, ref) < TOLERANCE[dtype], name


def tiled_mask(seq):
    """A causal keep mask that also rules out key tile 0 for query tiles 2 and on: tiles to skip."""
    keep = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    keep[128:, :64] = False
    return keep


class MaskedCausalBlock(CausalBlock):
    def forward(self, x, keep):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(out.transpose(1, 2).flatten(2))


def converted_block(options, masked=False, seq=600):
    torch.manual_seed(0)
    model = (MaskedCausalBlock if masked else CausalBlock)(dim=256, heads=4).cuda().eval()
    x = torch.randn(2, seq, 256, device="cuda")
    inputs = (x, tiled_mask(seq)) if masked else (x,)
    converted = lowconv.convert(model, attention_recipe(options), inputs)
    [decision] = converted.lowconv_plan.converted()
    assert decision.op == "sparse_attention", decision.reason
    return model, converted, inputs


@pytest.mark.parametrize("options, masked, backend", [
    ('dtype = "bfloat16"', False, "sdpa"), ('dtype = "bfloat16", layout = "local", window = 128', False, "triton"),
    ('dtype = "bfloat16"', True, "triton"), ('dtype = "bfloat16", backend = "sdpa"', True, "sdpa"),
])
def test_converted_sites_run_the_backend_their_plan_says(options, masked, backend, monkeypatch):
    model, converted, inputs = converted_block(options, masked)
    ran = spy_on_plans(monkeypatch)
    out = converted(*inputs)
    assert [b for b, _, _ in ran] == [backend]
    if "local" not in options:
        assert rel_error(out, model(*inputs)) < 1e-2


COMPILED_CASES = [('', False), ('layout = "local", window = 128', False), ('backend = "triton"', True), ('', True)]


@pytest.mark.parametrize("options, masked", COMPILED_CASES)
def test_converted_model_compiles_whole_with_inductor(options, masked):
    """fullgraph=True, no graph break counted; outputs and input gradients as eagerly (float32:
    the Triton kernels' 3-pass tf32 and SDPA's float32 kernels), on two inputs without recompiling."""
    _, converted, inputs = converted_block(options, masked)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(converted, fullgraph=True)
    for _ in range(2):
        x = torch.randn_like(inputs[0]).requires_grad_()
        x_eager = x.detach().clone().requires_grad_()
        got, want = run(x, *inputs[1:]), converted(x_eager, *inputs[1:])
        assert rel_error(got, want) < BACKENDS_AGREE
        got.square().sum().backward()
        want.square().sum().backward()
        assert rel_error(x.grad, x_eager.grad) < BACKENDS_AGREE
    assert counters["graph_break"] == {}
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("options, masked", COMPILED_CASES)
def test_converted_model_replays_in_a_cuda_graph(options, masked):
    """Eager calls captured in a torch.cuda.CUDAGraph (the mask's plan cannot be read while
    capturing: SDPA with it, or with backend "triton" the tiles listed inside the graph) and a
    mode="reduce-overhead" compile: replays with new inputs equal eager calls."""
    _, converted, inputs = converted_block(options, masked)
    static = [t.clone() for t in inputs]
    with torch.no_grad():
        graph, out = captured(lambda: converted(*static))
        torch._dynamo.reset()
        reduced = torch.compile(converted, fullgraph=True, mode="reduce-overhead")
        for step in range(3):
            x = torch.randn_like(inputs[0])
            static[0].copy_(x)
            if masked:
                static[1].copy_(tiled_mask(inputs[0].shape[1]).roll(step, -1))
            graph.replay()
            want = converted(x, *static[1:])
            assert rel_error(out, want) < BACKENDS_AGREE
            assert rel_error(reduced(x, *static[1:]).clone(), want) < BACKENDS_AGREE


def converted_window_block():
    from tests.test_window_attention_pass import Block, scene
    model = Block("contextual").cuda().eval()
    inputs = tuple(t.cuda() for t in scene(2000))
    converted = lowconv.convert(model, attention_recipe('dtype = "float32"'), inputs)
    [decision] = converted.lowconv_plan.converted()
    assert decision.op == "sparse_attention", decision.reason
    return converted, inputs


def test_converted_window_attention_compiles_whole_with_inductor():
    """An SpTr block with relative position: fullgraph=True, no graph break, the window kernels'
    outputs and gradients (feats and the tables) as eagerly."""
    converted, inputs = converted_window_block()
    tables = [p for name, p in converted.named_parameters() if "relative_pos" in name]
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(converted, fullgraph=True)
    results = []
    for call in (converted, run):
        feats = inputs[0].clone().requires_grad_()
        for t in tables:
            t.grad = None
        out = call(feats, *inputs[1:])
        out.square().sum().backward()
        results.append([out.detach(), feats.grad, *(t.grad.clone() for t in tables)])
    for got, want in zip(*reversed(results)):
        assert rel_error(got, want) < BACKENDS_AGREE
    assert counters["graph_break"] == {}


def test_window_attention_replays_in_a_cuda_graph():
    """The window op with its windows and coordinates given (the model's own window search sorts
    and syncs): captured in a torch.cuda.CUDAGraph, replays with new q, k, v equal eager calls."""
    from lowconv.kernels.window_attention import row_windows_from_offsets
    from tests.test_window_attention import make_problem
    q, k, v, offsets, coords, tables, _ = make_problem(sizes=[3, 0, 70, 1, 9, 2] * 50, seed=7)
    q, k, v = (t.float() for t in (q, k, v))
    start, end = (t.int() for t in row_windows_from_offsets(offsets, q.shape[0]))
    module = SparseWindowAttention(torch.float16)
    tq, tk, tv = (t.float() for t in tables)
    grid = (tq.shape[0] + 1) // 2

    def call(q, k, v):
        return module(q, k, v, coords=coords, quant_grid_length=grid, table_q=tq, table_k=tk, table_v=tv,
                      row_windows=(start, end))
    static = [t.clone() for t in (q, k, v)]
    with torch.no_grad():
        graph, out = captured(lambda: call(*static))
        for _ in range(2):
            fresh = [torch.randn_like(t) for t in static]
            for t, new in zip(static, fresh):
                t.copy_(new)
            graph.replay()
            assert torch.equal(out, call(*fresh))
