import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowconv
from lowconv.kernels.fp8 import (
    BLOCK, E4M3, E5M2, FP8_MAX, cast_with_scale, dequantize, expand_blocks, fp8_linear_reference, quantize,
    quantize_rowwise, quantize_tensorwise, quantize_weight, quantize_with_scale, weight_rows,
)
from lowconv.ops.fp8 import Fp8Linear, Fp8Options
from lowconv.recipe import parse_recipe
from tests import sites

from_site, empty, site_problem = Fp8Linear.from_site, Fp8Linear.empty, Fp8Linear.site_problem

# (mantissa bits, exponent of the smallest normal) of each format
FORMATS = {E4M3: (3, -6), E5M2: (2, -14)}


def linear_site(in_features, out_features, bias=True, dtype="bfloat16"):
    return sites.linear_site(in_features, out_features, bias, dtype)


def sqnr_db(ref, y):
    assert torch.isfinite(y).all()
    return (20 * torch.log10(ref.norm() / (ref - y.double()).norm())).item()


def assert_rounded(x, x_fp8, scale, fp8_dtype):
    """x_fp8 * scale is x rounded to the format: within half an ulp, relative for normals."""
    mantissa, min_exp = FORMATS[fp8_dtype]
    x64 = x.double()
    error = (x_fp8.double() * scale.double() - x64).abs()
    bound = torch.maximum(x64.abs() * 2.0 ** -(mantissa + 1), scale.double() * 2.0 ** (min_exp - mantissa - 1))
    assert (error <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_tensorwise_vs_float64(fp8_dtype):
    x = torch.randn(64, 48) * 7
    x_fp8, scale = quantize_tensorwise(x, fp8_dtype)
    assert x_fp8.dtype == fp8_dtype and scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.double().item() == pytest.approx(x.abs().max().double().item() / FP8_MAX[fp8_dtype], rel=1e-6)
    assert x_fp8.float().abs().max().item() == FP8_MAX[fp8_dtype]  # amax lands on the format's max
    assert_rounded(x, x_fp8, scale, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_rowwise_scales_per_row(fp8_dtype):
    x = torch.randn(2, 3, 32) * torch.logspace(-3, 3, 6).reshape(2, 3, 1)
    x_fp8, scale = quantize_rowwise(x, fp8_dtype)
    assert scale.shape == (2, 3, 1) and scale.dtype == torch.float32
    expected = x.abs().amax(-1, keepdim=True).double() / FP8_MAX[fp8_dtype]
    torch.testing.assert_close(scale.double(), expected, rtol=1e-6, atol=0)
    assert_rounded(x, x_fp8, scale, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_with_scale_saturates(fp8_dtype):
    fp8_max = FP8_MAX[fp8_dtype]
    x = torch.tensor([3 * fp8_max, -1e30, 1.5, -0.0])
    x_fp8, scale = quantize_with_scale(x, torch.tensor([1.0]), fp8_dtype)
    assert x_fp8.float().tolist() == [fp8_max, -fp8_max, 1.5, 0.0]
    assert scale.dtype == torch.float32


def test_zero_input_gives_finite_scale():
    x_fp8, scale = quantize_tensorwise(torch.zeros(4, 16), E4M3)
    assert scale.item() > 0 and torch.isfinite(scale).all() and (x_fp8.float() == 0).all()
    x = torch.randn(3, 16)
    x[1] = 0
    x_fp8, scale = quantize_rowwise(x, E4M3)
    assert torch.isfinite(scale).all() and (scale > 0).all() and (x_fp8[1].float() == 0).all()
    assert_rounded(x, x_fp8, scale, E4M3)


def test_weight_scale_rounded_up_to_storage_dtype():
    w = torch.randn(32, 64) * 1e-3
    for dtype in (torch.float16, torch.bfloat16):
        w_fp8, scale = quantize_weight(w, "row", dtype)
        assert scale.dtype == dtype and scale.shape == (32, 1)
        assert (scale.float() * FP8_MAX[E4M3] >= w.abs().amax(-1, keepdim=True)).all()  # nothing saturates
        assert_rounded(w, w_fp8, scale.float(), E4M3)


@pytest.mark.parametrize("granularity", ["tensor", "row", "token", "block"])
def test_weight_quantized_in_chunks_of_rows_is_quantized_whole(granularity):
    """On the CPU quantize_weight reads W 128 rows at a time here (1100 values a row); its numbers are
    those of quantize's one pass over W: the scales of the whole, the last chunk and tile partial."""
    torch.manual_seed(0)
    w = (torch.randn(300, 1100) * torch.logspace(-3, 1, 300).unsqueeze(1)).to(torch.bfloat16)
    w[5, 7], w[200, 3] = float("nan"), 1e4
    assert len(weight_rows(w)) == 3
    w_fp8, stored = quantize_weight(w, granularity, torch.bfloat16)
    scale = quantize(w, {"tensor": "tensor", "row": "row", "token": "tensor", "block": "block"}[granularity])[1]
    rounded = scale.to(torch.bfloat16)
    rounded = torch.where(rounded.float() < scale, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)
    assert torch.equal(stored, rounded)
    whole, _ = cast_with_scale(w, expand_blocks(stored, w.shape), E4M3)
    assert torch.equal(w_fp8.view(torch.uint8), whole.view(torch.uint8))


def test_linear_sqnr_vs_float64():
    K, N, M = 256, 128, 64
    w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(M, K)
    ref = F.linear(x.double(), w.double(), b.double())
    site = linear_site(K, N, dtype="float32")
    db = {g: sqnr_db(ref, from_site(site, Fp8Options(granularity=g), {"weight": w, "bias": b})(x))
          for g in ("tensor", "row")}
    assert 25 < db["tensor"] < 40
    assert db["row"] > db["tensor"] - 0.5  # N(0,1) rows are alike: per-row scales help little here

    # Tokens whose magnitudes span 6 decades: one tensorwise scale flushes the small ones.
    x = torch.randn(M, K) * torch.logspace(-4, 2, M).unsqueeze(1)
    ref = F.linear(x.double(), w.double())
    worst = {}
    for g in ("tensor", "row", "token"):
        y = from_site(linear_site(K, N, bias=False, dtype="float32"), Fp8Options(granularity=g), {"weight": w})(x)
        worst[g] = min(sqnr_db(ref[i], y[i]) for i in range(M))
    assert worst["row"] > 20 and worst["token"] > 20  # per-token scales keep the small tokens
    assert worst["tensor"] < worst["token"] - 10


def test_token_granularity_scales_x_per_token_and_w_once():
    K, N, M = 64, 32, 16
    w, x = torch.randn(N, K), torch.randn(M, K) * torch.logspace(-3, 1, M).unsqueeze(1)
    module = from_site(linear_site(K, N, bias=False, dtype="float32"), Fp8Options(granularity="token"), {"weight": w})
    w_fp8, w_scale = quantize_tensorwise(w, E4M3)
    x_fp8, x_scale = quantize_rowwise(x, E4M3)
    assert module.weight_scale.shape == (1,) and torch.equal(module.weight, w_fp8)
    assert torch.equal(module(x), fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, None, torch.float32))


def test_block_granularity_scales_each_tile_of_w_and_each_group_of_x():
    """A scale per 128 x 128 tile of W and per 128 values of each token: one large tile or group
    does not flush the small ones (as one scale per tensor or per row would)."""
    K, N, M = 384, 256, 8
    w = torch.randn(N, K) * torch.logspace(-6, 1, K // BLOCK).repeat_interleave(BLOCK)  # each K block its magnitude
    x = torch.randn(M, K) * torch.logspace(-6, 1, K // BLOCK).repeat_interleave(BLOCK)
    module = from_site(linear_site(K, N, bias=False, dtype="float32"), Fp8Options(granularity="block"), {"weight": w})
    assert module.weight_scale.shape == (N // BLOCK, K // BLOCK)
    w_fp8, w_scale = quantize(w, "block")
    x_fp8, x_scale = quantize(x, "group")
    assert x_scale.shape == (M, K // BLOCK) and torch.equal(module.weight, w_fp8)
    # per tile: the tile's own amax maps to 448
    tile = w[BLOCK:2 * BLOCK, :BLOCK].abs().max() / 448
    assert torch.equal(w_scale[1, 0], tile)
    y = module(x)
    assert torch.equal(y, fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, None, torch.float32))
    small = slice(0, BLOCK)  # the quietest K block's contribution survives per-block scales
    ref = F.linear(x[:, small].double(), w[:, small].double())
    got = dequantize(x_fp8, x_scale)[:, small] @ dequantize(w_fp8, w_scale)[:, small].t()
    rows = dequantize(*quantize(x, "row"))[:, small] @ dequantize(*quantize(w, "row"))[:, small].t()
    assert sqnr_db(ref, got) > 25 and sqnr_db(ref, got) > sqnr_db(ref, rows) + 10


def test_block_granularity_takes_an_unbatched_input():
    w, x = torch.randn(256, 384), torch.randn(384)
    module = from_site(linear_site(384, 256, bias=False, dtype="float32"), Fp8Options(granularity="block"), {"weight": w})
    torch.testing.assert_close(module(x), module(x.unsqueeze(0))[0])


def test_block_quantizers_scale_a_partial_last_block_by_its_own_values():
    x = torch.cat([torch.randn(3, BLOCK), 1e-3 * torch.randn(3, 40)], dim=1)
    x_fp8, scale = quantize(x, "group")
    assert scale.shape == (3, 2)
    torch.testing.assert_close(scale[:, 1], x[:, BLOCK:].abs().amax(1) / 448)
    assert sqnr_db(x[:, BLOCK:].double(), dequantize(x_fp8, scale)[:, BLOCK:]) > 25


def test_block_granularity_is_for_inference_on_whole_tiles():
    with pytest.raises(ValueError, match='"block" is for inference'):
        Fp8Options(granularity="block", training=True)
    assert "divisible by 128" in site_problem(linear_site(192, 256), Fp8Options(granularity="block"))
    assert site_problem(linear_site(256, 384), Fp8Options(granularity="block")) is None


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("scaling", ["static", "delayed"])
def test_per_token_granularities_are_refused_where_x_has_one_fixed_scale(scaling, granularity):
    with pytest.raises(ValueError, match=f'"{granularity}" scales x per token'):
        Fp8Options(scaling=scaling, granularity=granularity)


@pytest.mark.parametrize("scaling, granularity", [(s, g) for s in ("dynamic", "static", "delayed") for g in ("tensor", "row")]
                         + [("dynamic", "token"), ("dynamic", "block")])
def test_state_dict_layout(scaling, granularity):
    site = linear_site(160, 300)
    sd = empty(site, Fp8Options(scaling=scaling, granularity=granularity, amax_history_len=5)).state_dict()
    expected = {
        "weight": ((300, 160), E4M3),
        "weight_scale": ({"row": (300, 1), "block": (3, 2)}.get(granularity, (1,)), torch.bfloat16),
        "bias": ((300,), torch.bfloat16),
    }
    if scaling == "static":
        expected["input_scale"] = ((1,), torch.float32)
    if scaling == "delayed":
        expected["amax_history"] = ((5,), torch.float32)
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == expected


def test_training_state_dict_keeps_master_weight():
    sd = empty(linear_site(32, 48, bias=False), Fp8Options(training=True)).state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == {"weight": ((48, 32), torch.bfloat16)}


def test_weight_bytes():
    def tensor_bytes(module):  # every tensor the module holds but the bias
        tensors = [t for name, t in [*module.named_parameters(), *module.named_buffers()] if name != "bias"]
        return sum(t.numel() * t.element_size() for t in tensors)

    K, N = 256, 128
    for dtype, ratio in (("bfloat16", 1 / 2), ("float32", 1 / 4)):
        w = torch.randn(N, K, dtype=getattr(torch, dtype))
        params = {"weight": w, "bias": torch.zeros(N)}
        module = from_site(linear_site(K, N, dtype=dtype), Fp8Options(granularity="row"), params)
        assert tensor_bytes(module) / (w.numel() * w.element_size()) == pytest.approx(ratio, rel=0.02)


def calibrate(module, *inputs):
    module.begin_calibration()
    for x in inputs:
        module(x)
    module.end_calibration()


@pytest.mark.parametrize("options", [
    Fp8Options(), Fp8Options(granularity="row"), Fp8Options(granularity="token"), Fp8Options(granularity="block"),
    Fp8Options(scaling="static"),
    Fp8Options(scaling="delayed"), Fp8Options(training=True), Fp8Options(training=True, granularity="token"),
    Fp8Options(training=True, scaling="static", granularity="row"),
], ids=repr)
def test_from_site_equals_empty_plus_load(options):
    site = linear_site(64, 32)
    params = {"weight": torch.randn(32, 64, dtype=torch.bfloat16), "bias": torch.randn(32, dtype=torch.bfloat16)}
    original = from_site(site, options, params).eval()
    calibrate(original, torch.randn(16, 64, dtype=torch.bfloat16))
    rebuilt = empty(site, options).eval()
    rebuilt.load_state_dict(original.state_dict(), strict=True)
    x = torch.randn(4, 7, 64, dtype=torch.bfloat16) * 2
    y = original(x)
    assert y.shape == (4, 7, 32) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all() and torch.equal(y, rebuilt(x))


def test_static_calibration_sets_scale_and_counts_clipping():
    site = linear_site(64, 32, dtype="float32")
    module = from_site(site, Fp8Options(scaling="static"), {"weight": torch.randn(32, 64), "bias": torch.randn(32)})
    with pytest.raises(RuntimeError, match="input_scale is not set"):
        module(torch.randn(2, 64))

    a, b = torch.randn(8, 64), torch.randn(8, 64) * 3
    calibrate(module, a, b)
    amax = torch.cat([a, b]).abs().max()
    assert module.input_scale.item() == pytest.approx(amax.item() / 448, rel=1e-6)
    assert module.report_stats() == {"clipped": 0.0, "elements": 0.0}  # calibration quantizes nothing

    x = torch.randn(10, 64) * 6
    module(x)
    assert module.report_stats() == {"clipped": float((x.abs() > amax).sum()), "elements": float(x.numel())}
    assert module.report_stats()["clipped"] > 0


def test_delayed_history_updates_only_in_training_mode():
    site = linear_site(64, 32, dtype="float32")
    params = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    module = from_site(site, Fp8Options(scaling="delayed", amax_history_len=3), params)
    calibrate(module, torch.full((2, 64), 2.0))
    assert module.amax_history.tolist() == [2.0, 0.0, 0.0]

    x = torch.randn(5, 64)
    module.eval()
    y = module(x)
    assert torch.equal(module(x), y) and module.amax_history.tolist() == [2.0, 0.0, 0.0]
    module.train()
    module(torch.full((1, 64), 4.0))
    module(torch.full((1, 64), 1.0))
    assert module.amax_history.tolist() == [1.0, 4.0, 2.0]
    # The 4.0s exceeded the history's 2.0, as did the tail of x in both eval calls.
    assert module.report_stats() == {"clipped": 64 + 2 * float((x.abs() > 2).sum()), "elements": 2 * 5 * 64 + 2 * 64}


@pytest.mark.parametrize("reentrant", [False, True])
def test_delayed_scaling_under_activation_checkpointing(reentrant):
    """The recompute in the backward computes what the forward did, and records no amax again."""
    from torch.utils.checkpoint import checkpoint
    params = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    inputs = [torch.randn(8, 64) * step for step in (1, 2, 3)]
    runs = []
    for checkpointed in (False, True):
        module = from_site(linear_site(64, 32, dtype="float32"),
                           Fp8Options(scaling="delayed", amax_history_len=3, training=True), params).train()
        grads = []
        for x in inputs:
            x = x.clone().requires_grad_()
            y = checkpoint(module, x, use_reentrant=reentrant) if checkpointed else module(x)
            y.pow(2).mean().backward()
            grads += [x.grad, module.weight.grad.clone()]
        runs.append((module.amax_history.tolist(), grads))
    (history, grads), (history_checkpointed, grads_checkpointed) = runs
    assert history == history_checkpointed and history[2] > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_checkpointed))


def test_delayed_most_recent_reduction_scales_by_the_last_steps_amax():
    site = linear_site(64, 32, dtype="float32")
    params = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    options = Fp8Options(scaling="delayed", amax_history_len=3, amax_reduction="most_recent")
    module = from_site(site, options, params).train()
    calibrate(module, torch.full((2, 64), 8.0))
    module.train()
    module(torch.full((1, 64), 1.0))  # scaled by the calibrated 8.0; the history becomes [1, 8, 0]
    x = torch.full((1, 64), 3.0)
    module(x)  # scaled by the most recent amax, 1.0: every 3.0 is clipped ("max" would use 8.0)
    assert module.amax_history.tolist() == [3.0, 1.0, 8.0]
    assert module.report_stats()["clipped"] == 64


@pytest.mark.parametrize("granularity", ["tensor", "row", "token"])
def test_training_grads_vs_float64(granularity):
    K, N, M = 128, 64, 32
    w, b, x, grad_out = torch.randn(N, K), torch.randn(N), torch.randn(M, K), torch.randn(M, N)
    module = from_site(linear_site(K, N, dtype="float32"), Fp8Options(granularity=granularity, training=True),
                       {"weight": w, "bias": b})
    x_q = x.clone().requires_grad_()
    y = module(x_q)
    (y * grad_out).sum().backward()

    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = F.linear(x64, w64, b64)
    (y64 * grad_out.double()).sum().backward()
    assert 25 < sqnr_db(y64.detach(), y.detach()) < 35
    # e5m2 gradients land near 24.5 dB; unquantized ones (e4m3 operands only) would give ~32 dB.
    assert 21 < sqnr_db(x64.grad, x_q.grad) < 28
    assert 21 < sqnr_db(w64.grad, module.weight.grad) < 28
    assert sqnr_db(b64.grad, module.bias.grad) > 100  # dbias uses the unquantized gradient
    assert x_q.grad.dtype == torch.float32 and module.weight.grad.dtype == torch.float32


def test_training_reduces_loss():
    torch.manual_seed(0)
    K, N = 32, 16
    target = torch.nn.Linear(K, N)
    module = from_site(linear_site(K, N, dtype="float32"), Fp8Options(training=True, scaling="delayed"),
                       {"weight": torch.randn(N, K) * 0.1, "bias": torch.zeros(N)})
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-2)
    losses = []
    for _ in range(30):
        x = torch.randn(64, K)
        loss = F.mse_loss(module(x), target(x).detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_check_reasons():
    assert site_problem(linear_site(64, 32), Fp8Options()) is None
    assert site_problem(linear_site(60, 32), Fp8Options()) == (
        "fp8 GEMM needs in_features and out_features divisible by 16 (got K=60, N=32)")
    assert "N=40" in site_problem(linear_site(64, 40), Fp8Options())
    with pytest.raises(ValueError, match=r"must be in \[1, 1024\]"):
        Fp8Options(scaling="delayed", amax_history_len=0)


def test_inference_module_passes_gradients_straight_through_to_its_input():
    """A model can train around a frozen FP8 layer: dx = dy @ W (dequantized), not dy rounded to e4m3."""
    torch.manual_seed(0)
    w, b = torch.randn(32, 64), torch.randn(32)
    module = from_site(linear_site(64, 32, dtype="float32"), Fp8Options(), {"weight": w, "bias": b})
    x = torch.randn(8, 64, requires_grad=True)
    grad_out = torch.randn(8, 32) * 1e-4  # small gradients: e4m3 without a scale would flush them to 0
    module(x).backward(grad_out)
    w_used = module.weight.double() * module.weight_scale.double()
    expected = grad_out.double() @ w_used
    assert (x.grad.double() - expected).norm() / expected.norm() < 1e-6
    assert torch.allclose(module.bias.grad.double(), grad_out.double().sum(0), rtol=1e-5)


def test_module_casts_keep_the_e4m3_weight():
    model, x = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval(), torch.randn(8, 64)
    converted = lowconv.convert(model, "fp8-dynamic", (x,))
    with torch.no_grad():
        before = converted(x)
        assert torch.equal(converted.float()(x), before)  # a no-op cast changes nothing
        half = converted.half()
        assert half[0].weight.dtype == torch.float8_e4m3fn and half[0].weight_scale.dtype == torch.float16
        y = half(x.half())
    # x rounded to fp16 moves some of its e4m3 roundings: the two runs differ by fp8's own error (~2%)
    assert y.dtype == torch.float16 and (y.float() - before).norm() / before.norm() < 0.05


@pytest.mark.parametrize("scaling", ["static", "delayed", "dynamic"])
def test_training_with_static_scales_warns_that_what_outgrows_them_clips(scaling):
    recipe = parse_recipe(f'name = "t"\n[[rules]]\nkind = "linear"\nop = "fp8"\n'
                          f'options = {{ training = true, scaling = "{scaling}" }}\n', "t")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowconv.convert(nn.Sequential(nn.Linear(16, 16)), recipe, (torch.randn(4, 16),))
    static = [str(w.message) for w in caught if "with static FP8 scales" in str(w.message)]
    assert static == (["1 converted linear (0) trains with static FP8 scales: x's scale stays as calibrated while "
                       "training changes x, and what grows past it clips (each layer's report_stats() counts it); "
                       "scaling = \"delayed\" follows x, \"dynamic\" takes each x's own"] if scaling == "static" else [])
