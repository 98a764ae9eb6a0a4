import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lowconv.kernels.fp16acc import auto_splits, error_ratio, fp16acc_matmul
from lowconv.ops.fp16acc import Fp16AccLinear, Fp16AccOptions
from tests.compiled import (assert_same_run, compile_recording, fallbacks, inductor_with_cuda_graphs, lowconv_ops,
                            run_with_grads)
from tests.sites import linear_site

from_site, empty, site_problem = (Fp16AccLinear.from_site, Fp16AccLinear.empty,
                                  Fp16AccLinear.site_problem)


def relative_error(y, ref):
    assert torch.isfinite(y).all()
    return ((y.double() - ref).norm() / ref.norm()).item()


def scalar_emulation(x, w, bias, splits, combine):
    """The kernel's arithmetic written out one output at a time, in numpy: an independent check."""
    x, w = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    (M, K), N = x.shape, w.shape[0]
    blocks = [(k, min(k + 16, K)) for k in range(0, K, 16)]
    per_split = math.ceil(len(blocks) / splits)
    chunks = [blocks[i:i + per_split] for i in range(0, len(blocks), per_split)]
    y = np.zeros((M, N), dtype=np.float16)
    for m in range(M):
        for n in range(N):
            partials = []
            for chunk in chunks:
                acc = np.float16(0)
                for a, b in chunk:
                    block = np.float32(np.dot(x[m, a:b], w[n, a:b]))
                    acc = np.float16(np.float32(acc) + block)
                partials.append(acc)
            if combine == "fp32":
                total = np.float32(sum(np.float32(p) for p in partials))
            else:
                total = partials[0]
                for p in partials[1:]:
                    total = np.float16(np.float32(total) + np.float32(p))
            y[m, n] = np.float16(np.float32(total) + (np.float32(bias[n]) if bias is not None else np.float32(0)))
    return torch.from_numpy(y)


@pytest.mark.parametrize("K", [40, 100])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("combine", ["fp32", "fp16"])
def test_reference_matches_scalar_emulation(K, splits, combine):
    # Integer data: every block sum is exact in fp32, so the only roundings are the fp16 ones and
    # the two emulations must agree bit for bit.
    torch.manual_seed(K + splits)
    x = torch.randint(-20, 21, (3, K)).half()
    w = torch.randint(-20, 21, (5, K)).half()
    bias = torch.randint(-100, 101, (5,)).half()
    y = fp16acc_matmul(x, w, bias, splits, combine)
    assert y.dtype == torch.float16 and y.shape == (3, 5)
    assert torch.equal(y, scalar_emulation(x, w, bias, splits, combine))


def test_fp16_rounding_is_exercised():
    torch.manual_seed(0)
    x = torch.randint(-20, 21, (3, 100)).half()
    w = torch.randint(-20, 21, (5, 100)).half()
    exact = x.double() @ w.double().t()
    assert not torch.equal(fp16acc_matmul(x, w, None, 1).double(), exact)  # sums past 2048 round


def test_splits_reduce_error_vs_float64():
    torch.manual_seed(0)
    M, N, K = 32, 64, 4096
    x, w = torch.randn(M, K).half(), torch.randn(N, K).half()
    ref = x.double() @ w.double().t()
    one_chain = relative_error(fp16acc_matmul(x, w, None, 1), ref)
    split = relative_error(fp16acc_matmul(x, w, None, auto_splits(K, x.shape[0])), ref)
    fp32_accumulated = relative_error((x.float() @ w.float().t()).half(), ref)
    assert 1e-3 < one_chain < 1e-2  # what fp16 accumulation costs over K=4096 (cuBLAS: 2.4e-3)
    assert one_chain > 2 * split
    assert one_chain > 5 * fp32_accumulated


def test_fp16_combine_costs_accuracy():
    torch.manual_seed(0)
    M, N, K = 32, 64, 4096
    x, w = torch.randn(M, K).half(), torch.randn(N, K).half()
    ref = x.double() @ w.double().t()
    fp32_combine = relative_error(fp16acc_matmul(x, w, None, 64, "fp32"), ref)
    fp16_combine = relative_error(fp16acc_matmul(x, w, None, 64, "fp16"), ref)
    assert fp16_combine > 2 * fp32_combine  # 63 more fp16 roundings of the running total


def test_tails_vs_float64():
    M, N, K = 7, 9, 100  # K is not a multiple of 16; odd M and N
    x, w, b = torch.randn(2, M, K).half(), torch.randn(N, K).half(), torch.randn(N).half()
    y = fp16acc_matmul(x, w, b, 3, "fp32")
    assert y.shape == (2, M, N)
    assert relative_error(y, F.linear(x.double(), w.double(), b.double())) < 2e-3


def test_auto_splits():
    """32 chunks (64 for at most SMALL_M rows), none narrower than 64, but 32- or 16-wide where only
    they meet the error bar (fp32 combine; see auto_splits)."""
    widths = (0, 1, 16, 64, 100, 512, 960, 1000, 1024, 1280, 1536, 2048, 4096, 14336)
    assert [auto_splits(K, 65) for K in widths] == [1, 1, 1, 1, 2, 8, 15, 63, 64, 40, 48, 32, 32, 32]
    assert [auto_splits(K, 1) for K in widths] == [1, 1, 1, 1, 2, 8, 15, 63, 64, 40, 48, 32, 64, 64]
    assert auto_splits(14336, 64) == 64 and auto_splits(14336, 65) == 32
    # the fp16 combine rounds the total once per chunk: no narrower chunks for it
    assert [auto_splits(K, 65, "fp16") for K in widths] == [1, 1, 1, 1, 2, 8, 15, 16, 16, 20, 24, 32, 32, 32]


@pytest.mark.parametrize("K", [512, 1024, 1280, 2048])
def test_error_ratio_predicts_the_emulated_error(K):
    """auto_splits chooses by error_ratio: it must predict the emulation's error over one chain's."""
    torch.manual_seed(K)
    x, w = torch.randn(64, K).half(), torch.randn(256, K).half()
    exact = x.double() @ w.double().t()
    one_chain = relative_error(fp16acc_matmul(x, w, None, 1), exact)
    for splits in (K // 64, K // 32, K // 16):
        measured = relative_error(fp16acc_matmul(x, w, None, splits), exact) / one_chain
        assert abs(measured / error_ratio(K, splits) - 1) < 0.04, (splits, measured, error_ratio(K, splits))


def auto_splits_seen(monkeypatch, in_features, options, inputs):
    """The splits a module's calls pass to fp16acc_matmul, one per input of (rows, in_features)."""
    import lowconv.ops.fp16acc as op

    seen = []
    monkeypatch.setattr(op, "fp16acc_matmul", lambda x, w, b, splits, *rest: seen.append(splits) or x[..., :1])
    module = from_site(linear_site(in_features, 16), options, {"weight": torch.zeros(16, in_features).half(),
                                                               "bias": torch.zeros(16).half()})
    for shape in inputs:
        module(torch.zeros(*shape, in_features).half())
    return seen


def test_module_auto_splits_follow_the_rows_of_each_call(monkeypatch):
    """One layer serves prefill and decode: "auto" is resolved per call from x's rows."""
    assert auto_splits_seen(monkeypatch, 4096, Fp16AccOptions(), [(1,), (3, 100)]) == [64, 32]


@pytest.mark.parametrize("combine,splits", [("fp32", 64), ("fp16", 16)])
def test_module_auto_splits_follow_its_combine(monkeypatch, combine, splits):
    assert auto_splits_seen(monkeypatch, 1024, Fp16AccOptions(combine=combine), [(100,)]) == [splits]


def test_module_vs_float64_and_grads():
    K, N = 96, 40
    w, b = torch.randn(N, K).half(), torch.randn(N).half()
    module = from_site(linear_site(K, N), Fp16AccOptions(splits=2), {"weight": w, "bias": b})
    x = torch.randn(5, K).half().requires_grad_()
    y = module(x)
    assert y.dtype == torch.float16
    grad_out = torch.randn(5, N).half()
    (y.float() * grad_out.float()).sum().backward()
    x64, w64 = x.detach().double(), w.double()
    assert relative_error(y, F.linear(x64, w64, b.double())) < 2e-3
    assert relative_error(x.grad, grad_out.double() @ w64) < 2e-3
    assert relative_error(module.weight.grad, grad_out.double().t() @ x64) < 2e-3


@pytest.mark.parametrize("options", [Fp16AccOptions(), Fp16AccOptions(splits=3, combine="fp16")], ids=repr)
def test_from_site_equals_empty_plus_load(options):
    site = linear_site(80, 24)
    original = from_site(site, options, {"weight": torch.randn(24, 80).half(), "bias": torch.randn(24).half()})
    sd = original.state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == {
        "weight": ((24, 80), torch.float16), "bias": ((24,), torch.float16)}
    rebuilt = empty(site, options)
    rebuilt.load_state_dict(sd, strict=True)
    x = torch.randn(3, 4, 80).half()
    y = original(x)
    assert torch.isfinite(y).all() and torch.equal(y, rebuilt(x))


def test_check_reasons():
    assert site_problem(linear_site(64, 32), Fp16AccOptions()) is None
    assert site_problem(linear_site(64, 32, dtype="float32"), Fp16AccOptions()) == (
        "fp16acc runs fp16 models only (site dtype is float32; cast the model and its inputs "
        "first, as `lowconv convert --dtype float16` does)")
    with pytest.raises(ValueError, match="at least 1"):
        Fp16AccOptions(splits=0)
    with pytest.raises(TypeError, match="float16"):
        fp16acc_matmul(torch.randn(2, 16), torch.randn(4, 16), None, 1)


def test_cublas_backend_runs_the_reference_on_cpu():
    site = linear_site(64, 16)
    params = {"weight": torch.randn(16, 64).half(), "bias": torch.randn(16).half()}
    module = from_site(site, Fp16AccOptions(splits=2, backend="cublas"), params)
    assert "backend=cublas" in repr(module)
    x = torch.randn(3, 64).half()
    assert torch.equal(module(x), fp16acc_matmul(x, params["weight"], params["bias"], 2, backend="reference"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_module_on_cuda_vs_float64_and_grads(backend):
    """Both backends train: forward and gradients near float64, and the cuBLAS flag is left as found."""
    K, N = 4096, 256
    torch.manual_seed(0)
    w, b = torch.randn(N, K).half(), torch.randn(N).half()
    module = from_site(linear_site(K, N), Fp16AccOptions(backend=backend), {"weight": w, "bias": b}).cuda()
    x = torch.randn(2, 40, K).half().cuda().requires_grad_()
    grad_out = torch.randn(2, 40, N).half().cuda()
    before = torch.backends.cuda.matmul.allow_fp16_accumulation
    y = module(x)
    y.backward(grad_out)
    assert torch.backends.cuda.matmul.allow_fp16_accumulation == before
    x64, w64, g64 = x.detach().double(), w.double().cuda(), grad_out.double()
    assert relative_error(y, F.linear(x64, w64, b.double().cuda())) < 1e-3
    assert relative_error(x.grad, g64 @ w64) < 2e-3
    assert relative_error(module.weight.grad, g64.reshape(-1, N).t() @ x64.reshape(-1, K)) < 2e-3


@pytest.mark.parametrize("options", [Fp16AccOptions(splits=2), Fp16AccOptions(combine="fp16")], ids=repr)
@pytest.mark.parametrize("bias", [True, False])
def test_the_module_compiles_whole_as_lowconvs_op(options, bias):
    """torch.compile(fullgraph=True) of an fp16acc layer: no graph break, lowconv's op in the graph
    (the CPU runs the reference's), the same output and gradients as eager, 2-D and 3-D inputs."""
    torch.manual_seed(0)
    params = {"weight": torch.randn(40, 96).half(), "bias": torch.randn(40).half()}
    module = from_site(linear_site(96, 40, bias=bias), options, params if bias else {"weight": params["weight"]})
    compiled, graphs = compile_recording(module)
    for shape in [(5, 96), (2, 3, 96)]:
        x = torch.randn(*shape).half()
        assert_same_run(run_with_grads(compiled, module, x), run_with_grads(module, module, x))
    assert lowconv_ops(graphs) == {"lowconv::fp16acc_reference"}


def test_the_triton_kernel_compiles_as_its_op():
    """The Triton backend in a compiled function: lowconv::fp16acc_triton (a triton_op; under Triton's
    interpreter an opaque op), the same result as eager."""
    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 96, generator=gen).half(), torch.randn(40, 96, generator=gen).half(), torch.randn(40).half()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, b = x.to(device), w.to(device), b.to(device)

    def product(x, w, b):
        return fp16acc_matmul(x, w, b, 2, backend="triton") * 2

    compiled, graphs = compile_recording(product)
    assert torch.equal(compiled(x, w, b), product(x, w, b))
    assert lowconv_ops(graphs) == {"lowconv::fp16acc_triton"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cublas"])
@pytest.mark.parametrize("rows", [1, 40, 4096], ids=["decode", "small M", "large M (wgmma on sm_90)"])
def test_the_module_compiled_by_inductor_replays_in_cuda_graphs(backend, rows):
    """fullgraph inductor compile in CUDA graphs (reduce-overhead's cudagraph trees), a training
    step: no graph break, no CUDA graph skipped, lowconv's op in the graph, and each replay's
    output the eager one (the same kernels), its gradients too (inductor's own sums aside)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    k, n = 2048, 4096
    params = {"weight": (torch.randn(n, k) * k ** -0.5).half(), "bias": torch.randn(n).half()}
    module = from_site(linear_site(k, n), Fp16AccOptions(backend=backend), params).cuda()
    counters.clear()
    compiled, graphs = compile_recording(module, backend=inductor_with_cuda_graphs)
    for seed in range(3):  # cudagraph trees: a warm-up run, the recording, then replays
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).half().cuda()
        y, grad_x, grads = run_with_grads(module, module, x)
        y_compiled, grad_x_compiled, grads_compiled = run_with_grads(compiled, module, x)
        assert torch.equal(y_compiled, y)
        for got, want in zip((grad_x_compiled, *grads_compiled), (grad_x, *grads)):
            torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)
    assert not fallbacks()
    assert lowconv_ops(graphs) == {f"lowconv::fp16acc_{backend}"}
