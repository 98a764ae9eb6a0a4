"""The few-rows FP8 GEMM (lowconv/kernels/fp8_small_m.py) against fp8.py's reference.

On the CPU the kernel runs in Triton's interpreter, whose fp8 is not faithful: there it is fed
fp16 operands (the kernel loads whatever dtype it is given), which checks its tiling, K splits,
scales and bias exactly as the fp8 run uses them. On the GPU it runs on e4m3 operands through
fp8_linear's dispatch."""
import pytest
import torch

import lowconv.kernels.fp8 as fp8
from lowconv.kernels import fp8_small_m
from lowconv.kernels.fp8 import fp8_linear, fp8_linear_reference, quantize

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def fp16_operands(m, n, k, x_rows, w_rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).half()
    w = torch.randn(n, k, generator=gen).half()
    x_scale = torch.rand(m if x_rows else 1, 1, generator=gen) + 0.5
    w_scale = (torch.rand(n if w_rows else 1, 1, generator=gen) + 0.5).bfloat16()
    return x, x_scale, w, w_scale


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run; the GPU test below runs fp8")
@pytest.mark.parametrize("m,n,k,config,multiprocessors", [
    (3, 80, 512, (32, 3), 64),     # a partial column block, K split in 4
    (16, 128, 1024, None, 8),      # tiles()'s choice, one K range per program
    (5, 64, 768, (64, 3), 64),     # K of 3 blocks in 2 ranges, the last one shorter
    (64, 48, 256, (32, 3), 1),     # a full row tile, no split
])
@pytest.mark.parametrize("x_rows,w_rows", [(True, True), (False, True), (True, False)],
                         ids=["row scales", "tensor x", "tensor w"])
def test_tiles_splits_scales_and_bias_compute_the_linear(m, n, k, config, multiprocessors, x_rows, w_rows, monkeypatch):
    monkeypatch.setattr(fp8_small_m, "multiprocessors", lambda device: multiprocessors)
    x, x_scale, w, w_scale = fp16_operands(m, n, k, x_rows, w_rows)
    bias = torch.randn(n).bfloat16()
    got = fp8_small_m.fp8_gemm_rows(x, x_scale, w, w_scale, bias, torch.float32, False, config)
    ref = (x.double() @ w.double().t()) * x_scale.double() * w_scale.double().reshape(-1) + bias.double()
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_k_splits_give_every_multiprocessor_a_program_and_each_range_its_minimum():
    assert fp8_small_m.split_k(4096, 4096, 132, 32) == 1  # 128 column blocks fill the GPU
    assert fp8_small_m.split_k(1024, 4096, 132, 32) == 4  # 32 blocks x 4 ranges
    assert fp8_small_m.split_k(1024, 512, 132, 32) == 1  # K too short to split
    assert fp8_small_m.split_k(256, 14336, 132, 64) == 28  # 4 blocks, 28 ranges of 2 steps


def test_takes_few_e4m3_rows_with_tensor_or_row_scales_on_sm90(monkeypatch):
    monkeypatch.setattr(fp8_small_m, "cuda_capability", lambda index: (9, 0))
    x = torch.zeros(64, 128, dtype=fp8.E4M3)
    w = torch.zeros(256, 128, dtype=fp8.E4M3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    one, rows = torch.ones(1), torch.ones(64, 1)
    assert fp8_small_m.takes(x, rows, w, torch.ones(256, 1), torch.bfloat16)
    assert fp8_small_m.takes(x, one, w, one, torch.float32)
    assert not fp8_small_m.takes(torch.zeros(65, 128, dtype=fp8.E4M3), one, w, one, torch.bfloat16)  # rows
    assert not fp8_small_m.takes(x[:0], one, w, one, torch.bfloat16)  # no rows
    assert not fp8_small_m.takes(x.view(torch.float8_e5m2), one, w, one, torch.bfloat16)  # a gradient
    assert not fp8_small_m.takes(x, torch.ones(64, 1), w, torch.ones(2, 1), torch.bfloat16)  # block scales
    monkeypatch.setattr(fp8_small_m, "cuda_capability", lambda index: (8, 9))
    assert not fp8_small_m.takes(x, rows, w, torch.ones(256, 1), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("shape,n", [((1, 4096), 1024), ((7, 512), 384), ((4, 16, 1024), 4096), ((64, 14336), 512)],
                         ids=["1 row", "7 rows", "64 rows in 3-D", "64 rows, long K"])
@pytest.mark.parametrize("granularity,out_dtype", [("row", torch.bfloat16), ("tensor", torch.float16),
                                                   ("tensor", torch.float32)])
def test_few_rows_run_the_triton_gemm_and_match_the_reference(shape, n, granularity, out_dtype, monkeypatch):
    calls = []
    real = fp8_small_m.fp8_gemm_rows
    monkeypatch.setattr(fp8_small_m, "fp8_gemm_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).cuda()
    w = torch.randn(n, shape[-1], generator=gen).cuda()
    x_fp8, x_scale = quantize(x, granularity)
    w_fp8, w_scale = quantize(w, granularity)
    bias = torch.randn(n, device="cuda").to(out_dtype)
    ref = fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype).float()
    precise = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum=False).float()
    fast = fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum=True).float()
    assert calls == [1, 1]
    assert precise.shape == ref.shape == (*shape[:-1], n)
    rel = lambda y: ((y - ref).norm() / ref.norm()).item()  # noqa: E731
    # fp32 sums every 32 products; within them the FP8 tensor cores' accumulator holds fewer bits
    # than fp32 (test_fp8_linear.assert_one_rounding_apart): no output closer than 2^-10
    assert rel(precise) < (2 ** -10 if out_dtype == torch.float32 else 2 ** -8)
    assert rel(fast) < 1e-2  # the tensor cores' narrower accumulator, as cuBLASLt's fast accumulation
