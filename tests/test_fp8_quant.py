"""The Triton FP8 quantizers (lowconv/kernels/fp8_quant.py) against fp8.py's torch reference.

On a GPU the outputs must be equal bit for bit. On the CPU the kernels run in Triton's
interpreter, whose fp8 casts are not faithful (ties round away from even; a value that rounds up
to a power of two comes back halved): there the scales and clipped counts must still be exact,
most fp8 values (> 75%) equal to the reference's and the rest within a factor of two (or
subnormals flushed to zero)."""
import pytest
import torch

import lowconv.kernels.fp8 as fp8
from lowconv.kernels import fp8_quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_DTYPES = [fp8.E4M3, fp8.E5M2]
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def sample(shape, dtype, seed=0):
    """Normal values at a few magnitudes, some exact zeros and one large outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
    x[..., ::7] = 0
    x.view(-1)[x.numel() // 2] = 1e4
    return x.to(dtype).to(DEVICE)


def assert_same_fp8(got, ref):
    """got (from the kernel, on DEVICE) equals ref (the torch reference, on the CPU)."""
    got = got.cpu()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if DEVICE == "cuda":
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), "fp8 bits differ from the reference"
        return
    g, r = got.float(), ref.float()
    assert (g == r).float().mean() > 0.75
    within_two = (g.abs() >= r.abs() / 2) & (g.abs() <= r.abs() * 2) & (g * r >= 0)
    assert (within_two | ((g - r).abs() <= torch.finfo(ref.dtype).smallest_normal)).all()


@pytest.fixture
def few_programs(monkeypatch):
    """At most 3 programs, so that each loops over several blocks (as large tensors do on a GPU)."""
    monkeypatch.setattr(fp8_quant, "MAX_PROGRAMS", 3)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# (7, 2000): 7 blocks over 3 programs, so the amax pass's last program has steps past the end
@pytest.mark.parametrize("shape", [(37, 70), (5, 3, 2048), (7, 2000), (1, 1)], ids=str)
def test_tensorwise_matches_the_reference(shape, dtype, fp8_dtype, few_programs):
    x = sample(shape, dtype)
    got, scale = fp8_quant.quantize_tensorwise(x, fp8_dtype)
    ref, ref_scale = fp8.quantize_tensorwise(x.cpu(), fp8_dtype)
    assert torch.equal(scale.cpu(), ref_scale)
    assert_same_fp8(got, ref)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 70), (2, 3, 5000), (4, 1)], ids=str)  # 5000: rows longer than a block
def test_rowwise_matches_the_reference(shape, fp8_dtype):
    x = sample(shape, torch.bfloat16)
    x[0] = 0  # an all-zero row has scale 1
    got, scale = fp8_quant.quantize_rowwise(x, fp8_dtype)
    ref, ref_scale = fp8.quantize_rowwise(x.cpu(), fp8_dtype)
    assert scale.shape == (*shape[:-1], 1) and torch.equal(scale.cpu(), ref_scale)
    assert_same_fp8(got, ref)


@pytest.mark.parametrize("mul_axis", ["columns", "rows"])
def test_a_multiplier_is_folded_in_as_the_reference_multiplies(mul_axis, few_programs):
    x = sample((6, 5, 96), torch.float16)
    length = 96 if mul_axis == "columns" else 30
    mul = torch.rand(length, generator=torch.Generator().manual_seed(3)).add(0.5).to(DEVICE)
    got, scale = fp8_quant.quantize_tensorwise(x, fp8.E5M2, mul, mul_axis)
    product = x.cpu().float() * (mul.cpu() if mul_axis == "columns" else mul.cpu().reshape(6, 5, 1))
    ref, ref_scale = fp8.quantize_tensorwise(product, fp8.E5M2)
    assert torch.equal(scale.cpu(), ref_scale)
    assert_same_fp8(got, ref)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
def test_a_given_scale_saturates_and_counts_what_it_clips(fp8_dtype, few_programs):
    x = sample((33, 300), torch.bfloat16)
    scale = torch.tensor([0.05], device=DEVICE)
    clipped = torch.full((), 5, dtype=torch.int64, device=DEVICE)  # counts add to what is there
    got, _ = fp8_quant.quantize_with_scale(x, scale, fp8_dtype, clipped)
    ref, _ = fp8.cast_with_scale(x.cpu(), scale.cpu(), fp8_dtype)
    expected = fp8.count_clipped(x.cpu(), scale.cpu(), fp8_dtype).item()
    assert 0 < expected < x.numel()
    assert clipped.item() == 5 + expected
    assert got.float().abs().max().item() == torch.finfo(fp8_dtype).max
    assert_same_fp8(got, ref)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(37, 70), (2, 3, 1024), (3, 5000), (2, 17000)], ids=str)
def test_rows_after_an_activation_match_the_activation_then_the_row_quantizer(shape, dtype, gated, activation):
    """One kernel for act(x) [* up] and its row quantization, against the torch activation then the
    reference quantizer: the activation's fp32 math differs from torch's in the last bits (exp,
    erf), so a value rounded to the model's dtype may land one step away: scales within that step,
    fp8 values equal but for a few."""
    x = sample(shape, dtype) / 100
    up = sample(shape, dtype, seed=1) / 100 if gated else None
    got, scale = fp8_quant.quantize_rows_after(x, activation, up, fp8.E4M3)
    ref, ref_scale = fp8.quantize_rowwise(fp8.activate(x.cpu(), activation, None if up is None else up.cpu()),
                                          fp8.E4M3)
    assert scale.shape == ref_scale.shape == (*shape[:-1], 1)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=2 ** -6, atol=0)  # two bf16 steps
    g, r = got.cpu().float(), ref.float()
    assert (g == r).float().mean() > (0.99 if DEVICE == "cuda" else 0.75)
    if DEVICE == "cuda":  # one e4m3 step at most
        assert ((g - r).abs() <= torch.maximum(r.abs(), g.abs()) / 8 + 2 ** -9).all()
    else:  # the interpreter's casts: within a factor of two
        assert (((g.abs() >= r.abs() / 2) & (g.abs() <= r.abs() * 2) & (g * r >= 0)) | ((g - r).abs() <= 2 ** -6)).all()


def test_the_activation_times_its_own_input_is_gated():
    """SiLU(x) * x: up is x itself, and still multiplies."""
    x = sample((5, 64), torch.float32) / 100
    got, scale = fp8_quant.quantize_rows_after(x, "silu", x, fp8.E4M3)
    ref, ref_scale = fp8.quantize_rowwise(torch.nn.functional.silu(x.cpu()) * x.cpu(), fp8.E4M3)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=2 ** -6, atol=0)


def test_the_activation_quantizer_falls_back_to_torch_ops_off_the_gpu_and_for_long_rows():
    x = torch.randn(3, 64)
    got, scale = fp8.quantize_rows_after(x, "silu", x * 2)
    ref, ref_scale = fp8.quantize_rowwise(torch.nn.functional.silu(x) * (x * 2), fp8.E4M3)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(scale, ref_scale)


def test_empty_and_zero_tensors_get_scale_one():
    """As the reference: scale 1 where there is nothing (or only zeros) to scale, in every quantizer."""
    zeros = torch.zeros(4, 16, device=DEVICE)
    for quantize in (fp8_quant.quantize_tensorwise, fp8_quant.quantize_rowwise,
                     fp8_quant.quantize_tensorwise_transposed):
        got, scale = quantize(zeros, fp8.E4M3)
        assert (scale == 1).all() and (got.float() == 0).all()
    for empty in (torch.zeros(0, 16), torch.zeros(16, 0)):
        for quantize in (fp8_quant.quantize_tensorwise, fp8_quant.quantize_rowwise,
                         fp8_quant.quantize_tensorwise_transposed):
            got, scale = quantize(torch.full_like(empty, float("nan")).to(DEVICE), fp8.E4M3)
            _, ref_scale = (fp8.quantize_tensorwise if quantize is not fp8_quant.quantize_rowwise
                            else fp8.quantize_rowwise)(empty, fp8.E4M3)
            assert got.numel() == 0 and torch.equal(scale.cpu(), ref_scale)


@pytest.mark.parametrize("quantize", ["tensorwise", "rowwise", "rows_after"])
def test_a_nan_does_not_enter_the_scale(quantize):
    x = sample((8, 64), torch.float32)
    x[3, 5] = float("nan")
    if quantize == "rows_after":  # SiLU(x) * x: the NaN reaches the activation and the gate
        got, scale = fp8_quant.quantize_rows_after(x, "silu", x, fp8.E4M3)
        _, ref_scale = fp8.quantize_rows_after(x.cpu(), "silu", x.cpu())
    else:
        got, scale = getattr(fp8_quant, f"quantize_{quantize}")(x, fp8.E4M3)
        _, ref_scale = getattr(fp8, f"quantize_{quantize}")(x.cpu(), fp8.E4M3)
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0 if quantize != "rows_after" else 2 ** -6, atol=0)
    if DEVICE == "cuda":  # the interpreter does not cast NaN to fp8 faithfully
        nan = got.float().isnan()
        assert nan[3, 5] and nan.sum() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the torch quantizers dispatch to Triton on CUDA")
@pytest.mark.gpu
def test_the_public_quantizers_run_triton_on_an_fp8_gpu(monkeypatch):
    calls = []
    real = fp8_quant.quantize_tensorwise
    monkeypatch.setattr(fp8_quant, "quantize_tensorwise", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = sample((64, 64), torch.bfloat16)
    got, scale = fp8.quantize_tensorwise(x, fp8.E4M3)
    assert calls == [1]
    ref, ref_scale = fp8.quantize_tensorwise(x.cpu(), fp8.E4M3)
    assert torch.equal(scale.cpu(), ref_scale)
    assert_same_fp8(got, ref)


@pytest.mark.parametrize("shape", [(70, 200), (130, 33), (1, 16)], ids=str)
@pytest.mark.parametrize("mul_axis", [None, "columns", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_transposing_cast_writes_the_row_quantizers_values_transposed(shape, mul_axis, dtype):
    """Against the flat kernel (same cast, same interpreter): exact, on the CPU too. fp32 inputs are
    the case a two-layout version of this kernel got wrong on the H100."""
    x = sample(shape, dtype)
    mul = None if mul_axis is None else \
        torch.rand(shape[1] if mul_axis == "columns" else shape[0]).add(0.5).to(DEVICE)
    rows_t, scale = fp8_quant.quantize_tensorwise_transposed(x, fp8.E5M2, mul, mul_axis)
    flat, flat_scale = fp8_quant.quantize_tensorwise(x, fp8.E5M2, mul, mul_axis)
    assert rows_t.shape == shape[::-1] and rows_t.is_contiguous()
    assert torch.equal(scale, flat_scale)
    assert torch.equal(rows_t.view(torch.uint8), flat.t().view(torch.uint8))
    again = fp8_quant.transposed_with_scale(x, scale, fp8.E5M2) if mul is None else None
    assert again is None or torch.equal(again.view(torch.uint8), rows_t.view(torch.uint8))


OPCHECK_CASES = {
    "fp8_quantize_tensorwise": lambda x: (x, fp8.E4M3, torch.rand(x.shape[-1], device=DEVICE) + 0.5, 1),
    "fp8_quantize_with_scale": lambda x: (x, torch.tensor([0.01], device=DEVICE), fp8.E5M2,
                                          torch.zeros((), dtype=torch.int64, device=DEVICE)),
    "fp8_quantize_tensorwise_transposed": lambda x: (x, fp8.E5M2, None, 0),
    "fp8_transposed_with_scale": lambda x: (x, torch.tensor([0.02], device=DEVICE), fp8.E4M3),
    "fp8_quantize_rowwise": lambda x: (x, fp8.E4M3),
    "fp8_quantize_rows_after": lambda x: (x, fp8_quant.ROW_ACTIVATIONS["silu"], x * 2, fp8.E4M3),
}


@pytest.mark.parametrize("name", OPCHECK_CASES)
def test_quantizer_ops_pass_opcheck(name):
    """Each quantizer is a torch.library op whose schema, fake implementation and registration
    torch.compile can rely on."""
    x = sample((33, 80), torch.bfloat16)
    torch.library.opcheck(getattr(torch.ops.lowconv, name).default, OPCHECK_CASES[name](x),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
