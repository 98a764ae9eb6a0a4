"""fp8_linear's GEMM through torch._scaled_mm against the reference that emulates it: the same
numbers up to fp32 summation order, for every scale granularity, bias placement and output dtype
(torch's CPU _scaled_mm runs the same call, which fp8_linear itself leaves to the reference on
the CPU: it is slow there); and the reference where _scaled_mm cannot take the operands."""
import pytest
import torch

import lowconv.kernels.fp8 as fp8
from lowconv.kernels import fp8_training, gpu
from lowconv.kernels.fp8 import fp8_linear, fp8_linear_reference, quantize
from lowconv.kernels.fp8_training import Fp8LinearFunction

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fake_capability(monkeypatch):
    """fake_capability((major, minor)): what torch.cuda reports from now on; the cached capability
    is cleared before and after."""
    def fake(capability):
        gpu.cached_capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    yield fake
    gpu.cached_capability.cache_clear()


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """How many times fp8_linear called torch._scaled_mm."""
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def operands(x_granularity, w_granularity, shape=(3, 5, 64), n=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.randn(n, shape[-1], generator=gen)
    return (*quantize(x, x_granularity), *quantize(w, w_granularity))


def assert_one_rounding_apart(y, ref):
    """fp32 accumulation in another order: the two differ by about one rounding of the output
    dtype at the output's scale (fp32: a few units of fp32 rounding). The H100's FP8 tensor cores
    accumulate with fewer bits than fp32 (measured: 2.3e-4 of max|y| at K = 512, fp32 output), so
    on CUDA no output is held closer than 2^-10 (fp16's rounding)."""
    eps = torch.finfo(ref.dtype).eps * (8 if ref.dtype == torch.float32 else 1)
    if y.is_cuda:
        eps = max(eps, 2 ** -10)
    torch.testing.assert_close(y.float().cpu(), ref.float().cpu(), rtol=eps,
                               atol=eps * ref.float().abs().max().item())


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, "out", torch.float32], ids=["no bias", "bias in out dtype", "fp32 bias"])
@pytest.mark.parametrize("granularity", [("tensor", "tensor"), ("row", "row"), ("tensor", "row"), ("row", "tensor")],
                         ids=["tensorwise", "rowwise", "tensor x, row w", "row x, tensor w"])
def test_scaled_mm_path_matches_the_reference(granularity, bias_dtype, out_dtype, scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = operands(*granularity)
    bias = None if bias_dtype is None else torch.randn(48).to(out_dtype if bias_dtype == "out" else bias_dtype)
    rowwise = granularity != ("tensor", "tensor")
    if rowwise and not cpu_scaled_mm_takes_rows():
        pytest.skip("this torch's CPU _scaled_mm takes tensor scales only")
    y = fp8.scaled_mm_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, rowwise, fast_accum=False)
    ref = fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    assert scaled_mm_calls, "_scaled_mm not run"
    assert y.shape == ref.shape == (3, 5, 48) and y.dtype == out_dtype
    assert_one_rounding_apart(y, ref)


def cpu_scaled_mm_takes_rows() -> bool:
    """Whether this torch's CPU _scaled_mm takes row scales (2.13 does; 2.11 asserts per-tensor)."""
    a = torch.ones(16, 16).to(fp8.E4M3)
    try:
        torch.ops.aten._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def test_the_cpu_runs_the_reference(scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = operands("tensor", "tensor")
    y = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16)
    assert not scaled_mm_calls
    assert torch.equal(y, fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16))


def test_shapes_scaled_mm_cannot_take_run_the_reference(scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = operands("tensor", "tensor", shape=(4, 40), n=48)  # K = 40
    y = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16)
    assert not scaled_mm_calls
    assert torch.equal(y, fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16))


def test_no_rows_run_the_reference(scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = operands("tensor", "tensor", shape=(4, 64))
    assert fp8_linear(x_fp8[:0], x_scale, w_fp8, w_scale, None, torch.float32).shape == (0, 48)
    assert not scaled_mm_calls


def test_cuda_takes_fp8_gpus_and_rowwise_with_bf16_output_only(fake_capability):
    """cuBLASLt's row-wise scaling writes bf16 only; GPUs before sm_89 have no FP8 GEMM."""
    cuda = torch.device("cuda")
    fake_capability((9, 0))
    assert fp8.scaled_mm_takes(cuda, 48, 64, True, rowwise=True, out_dtype=torch.bfloat16)
    assert fp8.scaled_mm_takes(cuda, 48, 64, True, rowwise=False, out_dtype=torch.float16)
    assert not fp8.scaled_mm_takes(cuda, 48, 64, True, rowwise=True, out_dtype=torch.float16)
    assert not fp8.scaled_mm_takes(cuda, 48, 40, True, rowwise=False, out_dtype=torch.bfloat16)
    fake_capability((8, 0))  # an A100
    assert not fp8.scaled_mm_takes(cuda, 48, 64, True, rowwise=False, out_dtype=torch.bfloat16)


def test_triton_quantizes_on_sm90_only(fake_capability):
    """On sm_89 Triton casts fp32 -> fp8 through fp16 (two roundings): the torch reference runs there."""
    cuda_x = type("CudaTensor", (), {"is_cuda": True, "device": torch.device("cuda", 0)})()  # no GPU needed
    fake_capability((8, 9))
    assert not fp8.quantizes_in_triton(cuda_x)
    assert fp8.scaled_mm_takes(torch.device("cuda"), 48, 64, True, rowwise=False, out_dtype=torch.bfloat16)
    fake_capability((9, 0))
    assert fp8.quantizes_in_triton(cuda_x)
    assert not fp8.quantizes_in_triton(torch.empty(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("granularity,out_dtype", [("tensor", torch.bfloat16), ("tensor", torch.float16),
                                                   ("tensor", torch.float32), ("row", torch.bfloat16)])
def test_cublaslt_matches_the_reference(granularity, out_dtype, scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = (t.cuda() for t in operands(granularity, granularity, shape=(256, 512), n=384))
    bias = torch.randn(384, device="cuda").to(out_dtype)
    ref = fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    assert_one_rounding_apart(fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype), ref)
    assert scaled_mm_calls
    # Fast accumulation (Hopper's reduced-precision accumulator) stays near it.
    fast = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum=True)
    assert ((fast.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="cuBLASLt's block scaling runs on sm_90")
@pytest.mark.parametrize("rows", [256, 250], ids=["M 256", "M 250 (padded to 252)"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_cublaslt_block_scaling_matches_the_reference(rows, with_bias, scaled_mm_calls):
    x_fp8, x_scale, w_fp8, w_scale = (t.cuda() for t in operands("group", "block", shape=(2, rows, 512), n=384))
    assert x_scale.shape == (2, rows, 4) and w_scale.shape == (3, 4)
    bias = torch.randn(384, device="cuda").to(torch.bfloat16) if with_bias else None
    ref = fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16)
    got = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16)
    assert scaled_mm_calls
    # block scales apply per K block's partial sum: the same terms in another order (a bias adds a rounding)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3


@pytest.mark.parametrize("granularity", ["tensor", "row", "token"])
def test_training_backward_runs_fp8_gemms_with_the_scales_folded_into_the_gradient(granularity, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    w = torch.randn(48, 64, generator=gen).requires_grad_()
    grad = torch.randn(32, 48, generator=gen)
    gemms = []
    real = fp8.fp8_linear
    monkeypatch.setattr(fp8_training, "fp8_linear", lambda x_fp8, *args, **kwargs: gemms.append(x_fp8.dtype) or
                        real(x_fp8, *args, **kwargs))
    Fp8LinearFunction.apply(x, w, None, None, granularity).backward(grad)
    assert gemms == [fp8.E4M3, fp8.E5M2, fp8.E5M2]  # forward, dX, dW: FP8 GEMMs, e5m2 gradients

    x_granularity, w_granularity = fp8.LINEAR_GRANULARITIES[granularity]
    x_fp8, x_scale = quantize(x.detach(), x_granularity)
    w_fp8, w_scale = quantize(w.detach(), w_granularity)
    g_x = fp8.dequantize(*fp8.quantize_tensorwise(grad * w_scale.reshape(1, -1), fp8.E5M2))
    g_w = fp8.dequantize(*fp8.quantize_tensorwise(grad * x_scale.reshape(-1, 1), fp8.E5M2))
    assert_one_rounding_apart(x.grad, g_x @ w_fp8.float())
    assert_one_rounding_apart(w.grad, g_w.t() @ x_fp8.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "row", "token"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_training_on_cuda_matches_the_cpu_reference(granularity, static, dtype, monkeypatch):
    """The CUDA path (Triton quantizers writing the transposed layouts, cuBLASLt GEMMs) against the
    CPU's (torch quantizers, transposed views): the same fp8 values, fp32 sums in another order.
    fp32 inputs (a model's master weights, LayerNorm outputs under autocast) once broke only here."""
    from lowconv.kernels import fp8_quant

    transposing = []
    for name in ("transposed_with_scale", "quantize_tensorwise_transposed"):
        real = getattr(fp8_quant, name)
        monkeypatch.setattr(fp8_quant, name, lambda *a, real=real, name=name: transposing.append(name) or real(*a))
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 40, 64, generator=gen), torch.randn(48, 64, generator=gen) * 0.1
    bias, grad = torch.randn(48, generator=gen), torch.randn(4, 40, 48, generator=gen)
    results = {}
    for device in ("cpu", "cuda"):
        leaves = [t.to(device, dtype).detach().requires_grad_() for t in (x, w, bias)]
        clipped = torch.zeros((), dtype=torch.int64, device=device) if static else None
        scale = torch.tensor([0.004], device=device) if static else None  # clips the largest x
        y = Fp8LinearFunction.apply(*leaves, scale, granularity, False, clipped)
        y.backward(grad.to(device, dtype))
        results[device] = [y, *(t.grad for t in leaves)], clipped
    (cpu, cpu_clipped), (cuda, cuda_clipped) = results["cpu"], results["cuda"]
    for got, ref in zip(cuda, cpu):
        assert_one_rounding_apart(got, ref)
    if static:
        assert cuda_clipped.item() == cpu_clipped.item() > 0
    assert "quantize_tensorwise_transposed" in transposing  # dY^T for dW, always tensorwise
    assert ("transposed_with_scale" in transposing) == (static or granularity != "row")  # x^T, W^T (tensor scales)
