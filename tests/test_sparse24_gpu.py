"""cuSPARSELt's 2:4 GEMM through lowconv's plan-caching binding, on CUDA (run on the lent GPU by
scripts/gpu_check.sh): products against float64 of the masked dense product, gradients of
fixed-mask training, plan reuse, graph capture, the op's backend choice, and the custom ops under
torch.compile and in CUDA graphs."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import lowconv
from lowconv.api import plan_of
from lowconv.kernels import cusparselt
from lowconv.kernels.cusparselt import TUNED, FixedMaskCompression, SparseGemm, SparseWeight
from lowconv.kernels.pack24 import kept_codes, pack_kept_reference
from lowconv.kernels.sparse24 import (TrainingGemms, compress_bitmask, compressed_linear, fixed_mask_linear,
                                      kept_to_dense, mask_24, mask_24_transposable, prune_24)
from lowconv.ops.semi_sparse import CompressedSemiSparseLinear, MaskedSemiSparseLinear
from lowconv.recipe import parse_recipe
from lowconv.kernels.cuda_timing import captured
from tests.compiled import compile_recording, fallbacks, inductor_with_cuda_graphs, lowconv_ops, run_with_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # fp32 accumulation, one 16-bit rounding


def relative_error(got, ref):
    assert torch.isfinite(got).all()
    return ((got.double() - ref).norm() / ref.norm()).item()


def operands(m, k, n, dtype, bias=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    w = prune_24((torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype))
    b = torch.randn(n, generator=gen, device="cuda").to(dtype) if bias else None
    return x, w, b


def masked_reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, bias", [(256, 128, 64, True), (13, 64, 32, False), (1, 32, 16, True),
                                           (1000, 512, 256, True)])
@pytest.mark.parametrize("tuned", [False, True])
def test_sparse_linear_matches_float64(dtype, m, k, n, bias, tuned):
    x, w, b = operands(m, k, n, dtype, bias)
    y = SparseWeight(w).linear(x, b, tuned)
    assert y.shape == (m, n) and y.dtype == dtype
    assert relative_error(y, masked_reference(x, w, b)) < TOLERANCE[dtype]


def test_tuned_algorithm_is_reused_by_later_plans_of_the_product():
    x, w, b = operands(512, 1024, 512, torch.float16)
    first, second = SparseWeight(w), SparseWeight(w)
    y = first.linear(x, b, tuned=True)
    assert len(TUNED) >= 1
    tuned = len(TUNED)
    assert torch.equal(second.linear(x, b, tuned=True), y) and len(TUNED) == tuned


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_linear_takes_3d_and_transposed_inputs(dtype):
    x, w, b = operands(48, 64, 32, dtype)
    weight = SparseWeight(w)
    ref = masked_reference(x, w, b)
    assert relative_error(weight.linear(x.reshape(6, 8, 64), b).reshape(48, 32), ref) < TOLERANCE[dtype]
    column_major = x.t().contiguous().t()  # what a transposed layer output looks like
    assert relative_error(weight.linear(column_major, b), ref) < TOLERANCE[dtype]
    assert relative_error(weight.linear(x[:, :], b), ref) < TOLERANCE[dtype]
    offset = torch.cat([torch.zeros(1, 64, dtype=dtype, device="cuda"), x])[1:]  # 128-byte offset: aligned
    assert relative_error(weight.linear(offset, b), ref) < TOLERANCE[dtype]
    sliced = torch.cat([x, x], dim=1)[:, 64:]  # row stride 128, not K: copied
    assert relative_error(weight.linear(sliced, b), ref) < TOLERANCE[dtype]


def test_plans_are_made_once_per_shape_and_later_calls_run_only_the_matmul(monkeypatch):
    x, w, b = operands(64, 4096, 4096, torch.float16)
    weight = SparseWeight(w)
    weight.linear(x, b)
    weight.linear(x, b)
    weight.linear(x[:32], b)
    assert len(weight.gemm.plans) == 2
    called = []
    library_call = weight.gemm.lib.call
    monkeypatch.setattr(weight.gemm.lib, "call", lambda name, *args: called.append(name) or library_call(name, *args))
    for _ in range(5):
        weight.linear(x, b)
    # torch._cslt_sparse_mm makes descriptors and a plan on every call: 0.4-1 ms of host time (h100-anchors.md)
    assert called == ["cusparseLtMatmul"] * 5


def test_sparse_linear_replays_in_a_cuda_graph():
    x, w, b = operands(128, 256, 128, torch.bfloat16)
    weight = SparseWeight(w)
    static_x = x.clone()
    weight.linear(static_x, b)  # plan made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = weight.linear(static_x, b)
    static_x.copy_(operands(128, 256, 128, torch.bfloat16, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(static_y, masked_reference(static_x, w, b)) < TOLERANCE[torch.bfloat16]


def kept(w, mask):
    """The kept values of w under a 2:4 mask, as a training layer holds them."""
    return pack_kept_reference(w, kept_codes(mask))


def training_gemms(w, transposable, rows=None):
    return TrainingGemms.of(*w.shape, w.dtype, w.device, transposable, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposable", [False, True])
def test_fixed_mask_training_gradients_match_float64(dtype, transposable):
    m, k, n = 96, 128, 64
    x, w, b = operands(m, k, n, dtype)
    dense = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    mask = mask_24_transposable(dense) if transposable else mask_24(dense)
    row, col = mask.nonzero()[0].tolist()
    dense[row, col] = 0  # a zero the mask keeps
    values = kept(dense, mask).requires_grad_()
    x.requires_grad_()
    b.requires_grad_()
    grad_out = torch.randn(m, n, device="cuda").to(dtype)
    gemms = training_gemms(dense, transposable)
    for _ in range(2):  # the second call reuses the compressions made for the mask
        y = fixed_mask_linear(x, values, mask, b, gemms.key)
        dx, dvalues, db = torch.autograd.grad(y, (x, values, b), grad_out)
        w64, x64, g64 = (dense * mask).double(), x.double(), grad_out.double()
        assert relative_error(y, x64 @ w64.t() + b.double()) < TOLERANCE[dtype]
        assert relative_error(dx, g64 @ w64) < TOLERANCE[dtype]
        assert relative_error(dvalues, kept(g64.t() @ x64, mask)) < TOLERANCE[dtype]
        assert relative_error(db, g64.sum(0)) < TOLERANCE[dtype]
    assert all(c is None or c.gathers for c in gemms.compressions(mask))
    other = mask_24_transposable(dense.flip(0)) if transposable else mask_24(dense.flip(1))
    mask.copy_(other)  # written in place (as load_state_dict does): the compressions follow
    y = fixed_mask_linear(x, values, mask, b, gemms.key)
    dx, dvalues = torch.autograd.grad(y, (x, values), grad_out)
    w64 = kept_to_dense(values.detach(), other).double()
    assert relative_error(y, x.double() @ w64.t() + b.double()) < TOLERANCE[dtype]
    assert relative_error(dx, g64 @ w64) < TOLERANCE[dtype]
    assert relative_error(dvalues, kept(g64.t() @ x64, other)) < TOLERANCE[dtype]


def test_fixed_mask_training_runs_with_a_mask_made_under_inference_mode():
    x, w, b = operands(32, 128, 64, torch.float16)
    with torch.inference_mode():  # e.g. a model loaded under inference_mode: no version counter
        mask = mask_24_transposable(w)
        gemms = training_gemms(w, transposable=True)
        y = fixed_mask_linear(x, kept(w, mask), mask, b, gemms.key)
    assert relative_error(y, masked_reference(x, w * mask, b)) < TOLERANCE[torch.float16]
    assert all(c.gathers for c in gemms.compressions(mask))


def test_fixed_mask_compression_falls_back_where_the_layout_is_not_the_known_one(monkeypatch):
    """A layout the gather does not reproduce (simulated: the gather writes nothing; cuSPARSELt 0.8.0
    itself lays out K = 32 otherwise) is caught by the per-mask check: cuSPARSELt compresses."""
    monkeypatch.setattr(cusparselt, "pack_kept", lambda src, codes, out: out)
    w = torch.randn(64, 128, device="cuda").to(torch.float16)
    mask = mask_24(w)
    gemm = SparseGemm(64, 128, torch.float16, torch.device("cuda"))
    with pytest.warns(UserWarning, match="in a layout lowconv does not know"):
        compression = FixedMaskCompression(gemm, mask)
    assert not compression.gathers
    assert torch.equal(compression.compress_kept(kept(w, mask)), gemm.compress(w * mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(64, 128), (4096, 1024), (1024, 4096)])
def test_fixed_mask_compression_writes_cusparselts_bytes(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(n, k, generator=gen, device="cuda").to(dtype)
    mask = mask_24_transposable(w)
    for weight, m in ((w, mask), (w.t(), mask.t())):  # W^T packed from W's view, as dX's GEMM needs it
        gemm = SparseGemm(*weight.shape, dtype, torch.device("cuda"))
        compression = FixedMaskCompression(gemm, m)
        assert compression.gathers
        assert torch.equal(compression.compress_kept(kept(weight, m)), gemm.compress(weight * m))


def mlp(width=256, hidden=512):
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def recipe(options):
    return parse_recipe(f'name = "t"\n[[rules]]\nkind = "linear"\nop = "semi_sparse"\noptions = {{ {options} }}\n')


@pytest.mark.parametrize("options, cls", [('backend = "cusparselt"', CompressedSemiSparseLinear),
                                          ('backend = "cusparselt", training = true, transposable = true',
                                           MaskedSemiSparseLinear)])
def test_converted_model_runs_cusparselt_saves_and_loads(options, cls, tmp_path):
    torch.manual_seed(0)
    model = mlp().to("cuda", torch.bfloat16)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.bfloat16)  # M = 200: padded to 208
    converted = lowconv.convert(model, recipe(options), (x,))
    layers = [m for m in converted.modules() if isinstance(m, cls)]
    assert len(layers) == 2 and all(layer.choice.backend == "cusparselt" for layer in layers)
    masked = lowconv.convert(model, recipe(options.replace("cusparselt", "masked-dense")), (x,))
    with torch.no_grad():
        y, ref = converted(x), masked(x)
    assert relative_error(y, ref.double()) < 1e-2
    lowconv.save(converted, tmp_path)
    again = lowconv.load(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(again(x), y)


def test_a_training_step_captured_in_a_cuda_graph_matches_eager():
    """Where an eager 2:4 training step is host-bound, a CUDA graph shows its GPU speed: the step
    must capture (compression by gather, cuSPARSELt's calls, the masked dW) and replay right."""
    torch.manual_seed(0)
    model = mlp().to("cuda", torch.float16)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.float16)
    options = 'backend = "cusparselt", training = true, transposable = true'
    converted = lowconv.convert(model, recipe(options), (x,)).train()
    params = [p for p in converted.parameters() if p.requires_grad]

    def step():
        return torch.autograd.grad(converted(x).float().square().mean(), params)

    eager = step()
    graph, graphed = captured(step)
    with torch.no_grad():
        for p in params:
            p.mul_(0.5)  # new weights: the replay must compress them anew
    graph.replay()
    torch.cuda.synchronize()
    again = step()
    for got, want, before in zip(graphed, again, eager):
        scale = want.abs().max()
        assert (got - want).abs().max() <= 1e-3 * scale  # cuBLAS may pick other kernels in a capture
        assert (got - before).abs().max() > 0.1 * scale


def test_auto_times_both_backends_at_the_site_shape():
    model = nn.Sequential(nn.Linear(1024, 4096)).to("cuda", torch.float16)
    x = torch.randn(13008, 1024, device="cuda", dtype=torch.float16)
    converted = lowconv.convert(model, recipe('backend = "auto"'), (x,))
    layer = next(m for m in converted.modules() if isinstance(m, CompressedSemiSparseLinear))
    choice = layer.choice
    assert choice.rows == 13008 and choice.sparse_ms > 0 and choice.dense_ms > 0
    assert (choice.backend == "cusparselt") == (choice.sparse_ms < 0.97 * choice.dense_ms), choice
    assert plan_of(converted).converted()[0].op == "semi_sparse"


def test_auto_keeps_masked_dense_where_cusparselt_cannot_run():
    model = nn.Sequential(nn.Linear(64, 24)).to("cuda", torch.float16)  # out_features not a multiple of 16
    converted = lowconv.convert(model, recipe('backend = "auto"'), (torch.randn(8, 64, device="cuda",
                                                                              dtype=torch.float16),))
    layer = next(m for m in converted.modules() if isinstance(m, CompressedSemiSparseLinear))
    assert layer.choice.backend == "masked-dense" and "multiples of 16" in layer.choice.reason
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    assert relative_error(layer(x), masked_reference(x, layer.linear_weight(), layer.bias)) < 2e-3


def test_sparse_gemm_rejects_what_it_cannot_take():
    gemm = SparseGemm(32, 64, torch.float16, torch.device("cuda"))
    with pytest.raises(lowconv.LowconvError, match=r"does not fit the weight \(32, 64\)"):
        gemm.linear(gemm.compress(torch.zeros(32, 64, dtype=torch.float16, device="cuda")),
                    torch.randn(4, 48, dtype=torch.float16, device="cuda"), None)
    with pytest.raises(lowconv.LowconvError, match="multiples of 16"):
        SparseGemm(24, 64, torch.float16, torch.device("cuda"))
    with pytest.raises(lowconv.LowconvError, match="float16 or bfloat16"):
        SparseGemm(32, 64, torch.float32, torch.device("cuda"))


def test_a_transposable_layer_refuses_a_mask_whose_transpose_is_not_2_4():
    w = torch.randn(64, 128, device="cuda").to(torch.float16)
    mask = mask_24(w)  # 2:4 along in_features only
    gemms = training_gemms(w, transposable=True)
    with pytest.raises(lowconv.LowconvError, match=r"W\^T's mask \(a transposable mask is 2:4 along out_features "
                                                   r"too\) \(128, 64\) keeps"):
        fixed_mask_linear(torch.randn(8, 128, device="cuda", dtype=torch.float16), kept(w, mask), mask, None,
                          gemms.key)


def test_the_ops_pass_opcheck():
    """Schema, fake implementation (y's strides too), registered autograd and torch.compile's
    dispatch of the cuSPARSELt ops, with gradients, by torch.library.opcheck."""
    x, w, b = operands(40, 128, 64, torch.float16)
    sparse = SparseWeight(w)
    values, bitmask, _ = compress_bitmask(w)
    torch.library.opcheck(compressed_linear, (x.clone().requires_grad_(), sparse.compressed, b.clone().requires_grad_(),
                                              values, bitmask, sparse.gemm.key, True))
    mask = mask_24_transposable(w)
    for transposable in (False, True):
        gemms = training_gemms(w, transposable, rows=40)
        torch.library.opcheck(fixed_mask_linear, (x.clone().requires_grad_(), kept(w, mask).requires_grad_(), mask,
                                                  b.clone().requires_grad_(), gemms.key))


COMPILED_OPTIONS = ['backend = "cusparselt"', 'backend = "auto"', 'backend = "cusparselt", training = true',
                    'backend = "cusparselt", training = true, transposable = true']


@pytest.mark.parametrize("options", COMPILED_OPTIONS)
def test_a_converted_model_compiled_by_inductor_replays_in_cuda_graphs(options):
    """fullgraph inductor compile in CUDA graphs (reduce-overhead's cudagraph trees) of an MLP
    converted on the GPU: no graph break, no CUDA graph skipped, lowconv's op in the graph where
    the layers chose cuSPARSELt, and each replay's output (a training step's gradients too) that of
    eager, up to inductor's own GELU between the layers."""
    torch.manual_seed(0)
    model = mlp().to("cuda", torch.bfloat16)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.bfloat16)
    converted = lowconv.convert(model, recipe(options), (x,))
    training = "training" in options
    layers = [m for m in converted.modules() if isinstance(m, (CompressedSemiSparseLinear, MaskedSemiSparseLinear))]
    counters.clear()
    compiled, graphs = compile_recording(converted, backend=inductor_with_cuda_graphs)
    for seed in range(3):  # a warm-up run, the recording, then replays
        x = torch.randn(4, 50, 256, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda",
                        dtype=torch.bfloat16)
        if training:
            got, want = run_with_grads(compiled, converted, x), run_with_grads(converted, converted, x)
            for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
                assert relative_error(g, w.double()) < 1e-2
        else:
            with torch.no_grad():
                got, want = compiled(x).clone(), converted(x)
            assert relative_error(got, want.double()) < 1e-2
    assert not fallbacks()
    op = "lowconv::sparse24_fixed_mask_linear" if training else "lowconv::sparse24_linear"
    chosen = {layer.choice.backend for layer in layers}
    assert lowconv_ops(graphs) == ({op} if "cusparselt" in chosen else set())


def test_a_layer_not_chosen_yet_runs_masked_dense_when_compiled_and_chooses_nothing():
    """The rule of the op's module doc: converted on the CPU and moved to the GPU, a layer has no CUDA
    backend yet; compiled, it runs masked-dense and chooses (times) nothing; an eager call then
    chooses, and the compiled model follows (dynamo's guards see the choice) onto cuSPARSELt."""
    torch.manual_seed(0)
    x = torch.randn(4, 50, 256, dtype=torch.bfloat16)
    converted = lowconv.convert(mlp().to(torch.bfloat16), recipe('backend = "cusparselt"'), (x,)).cuda()
    layers = [m for m in converted.modules() if isinstance(m, CompressedSemiSparseLinear)]
    x = x.cuda()
    compiled, graphs = compile_recording(converted)
    with torch.no_grad():
        masked = compiled(x)
        assert all(layer.choice is None for layer in layers) and lowconv_ops(graphs) == set()
        eager = converted(x)
        assert all(layer.choice.backend == "cusparselt" for layer in layers)
        again = compiled(x)
    assert lowconv_ops(graphs[1:]) == {"lowconv::sparse24_linear"}
    assert relative_error(masked, eager.double()) < 1e-2 and torch.equal(again, eager)


def test_a_cuda_graph_replayed_after_load_state_dict_computes_with_the_loaded_weights():
    """load_state_dict remakes cuSPARSELt's copy of the weight (and a fixed-mask layer's
    compressions) in place, so a captured forward reads the loaded weights (up to inductor's GELU:
    stale ones would give another model's output)."""
    torch._dynamo.reset()  # earlier tests' compiles of the same forward count toward dynamo's recompile limit
    torch.manual_seed(0)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.bfloat16)
    for options in ('backend = "cusparselt"', 'backend = "cusparselt", training = true, transposable = true'):
        converted = lowconv.convert(mlp().to("cuda", torch.bfloat16), recipe(options), (x,))
        other = lowconv.convert(mlp().to("cuda", torch.bfloat16), recipe(options), (x,))
        compiled = torch.compile(converted, fullgraph=True, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            converted.load_state_dict(other.state_dict())
            assert relative_error(compiled(x), other(x).double()) < 1e-2


@pytest.mark.parametrize("options", ['backend = "cusparselt"', 'backend = "cusparselt", training = true'])
def test_a_model_converted_on_the_gpu_copies_and_reverts(options):
    """Its layers hold cuSPARSELt's plans from the conversion on: copy.deepcopy (and revert, which
    copies) shares them, and the copy computes what the model does."""
    import copy

    torch.manual_seed(0)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.bfloat16)
    converted = lowconv.convert(mlp().to("cuda", torch.bfloat16), recipe(options), (x,))
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(converted)(x), converted(x))
        reverted = lowconv.revert(converted)
        assert relative_error(reverted(x), converted(x).double()) < 1e-2
