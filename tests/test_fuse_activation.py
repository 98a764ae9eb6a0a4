"""The activation that makes an FP8 layer's input moves into the layer (passes/fuse_activation.py),
whose quantizer computes it: the same outputs as the layer after the activation, saved and loaded
alike, compiled whole; left in place wherever the pattern is not exactly act(h) [* up] read by
the layer alone."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowconv
from lowconv import build
from lowconv.kernels import fp8
from lowconv.ops.fp8 import Fp8Linear, Fp8Options
from tests import sites

from_site = Fp8Linear.from_site


class GatedMlp(nn.Module):
    """A Llama MLP: down(SiLU(gate(x)) * up(x))."""

    def __init__(self, act=None, up_first=False):
        super().__init__()
        self.gate, self.up = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=False)
        self.act, self.up_first = act or nn.SiLU(), up_first

    def forward(self, x):
        up = self.up(x)
        return self.down(up * self.act(self.gate(x)) if self.up_first else self.act(self.gate(x)) * up)


class Model(nn.Module):
    def __init__(self, **gated):
        super().__init__()
        self.mlp = GatedMlp(**gated)
        self.vit = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.0), nn.Linear(128, 64))

    def forward(self, x):
        return self.vit(self.mlp(x))


def convert(model, recipe="fp8-row"):
    torch.manual_seed(0)
    return lowconv.convert(model, recipe, (torch.randn(4, 64),))


def convert_unfused(model, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(build, "fuse_activations", lambda converted, modules: (converted, {}))
        return convert(model)


def notes(converted) -> dict[str, str]:
    return {d.fqn: d.note for d in converted.lowconv_plan.decisions if "quantization kernel" in d.note}


@pytest.mark.parametrize("up_first", [False, True], ids=["act-times-up", "up-times-act"])
def test_gelu_and_silu_times_up_move_into_the_layer_with_the_same_outputs(up_first, monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = Model(up_first=up_first).eval()
    fused = convert(model)
    assert notes(fused) == {
        "mlp.down": "its input's SiLU * up computed in its quantization kernel (fuse_activation.py)",
        "vit.3": "its input's GELU computed in its quantization kernel (fuse_activation.py)"}
    assert "activation = 'silu', up = up" in fused.mlp.code and "activation = 'gelu'" in fused.vit.code
    unfused = convert_unfused(model, monkeypatch)
    assert not hasattr(fused.mlp, "act") and set(fused.state_dict()) == set(unfused.state_dict())
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        want = unfused(x)
        assert torch.equal(fused(x), want)  # on the CPU both quantize act(h) with the torch reference
        lowconv.save(fused, tmp_path / "out")
        loaded = lowconv.load(model, tmp_path / "out", (torch.randn(4, 64),))
        assert "activation = 'silu'" in loaded.mlp.code and torch.equal(loaded(x), want)
        compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), want)


def test_revert_puts_the_activation_back_before_the_dense_layer():
    torch.manual_seed(0)
    model = Model().eval()
    dense = lowconv.revert(convert(model))
    assert "activation" not in dense.mlp.code and "activation" not in dense.vit.code
    assert notes(dense) == {}
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(dense(x), model(x), rtol=0.1, atol=0.05)  # the dequantized FP8 weights


def test_a_model_that_trains_through_the_layer_gets_the_activations_gradient():
    torch.manual_seed(0)
    fused = convert(Model().eval())
    x = torch.randn(3, 64, requires_grad=True)
    fused(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


class Reads(nn.Module):
    """down(act(h)), h also returned where second_reader; inside Outer, so that the pass traces it
    (it never traces the model itself)."""

    def __init__(self, act, second_reader=False, between=None):
        super().__init__()
        self.fc, self.down, self.act, self.second_reader = nn.Linear(64, 128), nn.Linear(128, 64), act, second_reader
        self.between = between or nn.Identity()

    def forward(self, x):
        h = self.between(self.act(self.fc(x)))
        return (self.down(h), h) if self.second_reader else self.down(h)


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Scaled(nn.Module):
    def forward(self, x):
        return F.silu(x) * 2.0


@pytest.mark.parametrize("between", [None, nn.Dropout(0.0)], ids=["nothing", "dropout 0"])
def test_a_plain_activation_before_the_layer_moves_in(between):
    assert set(notes(convert(Outer(Reads(nn.GELU(), between=between)).eval()))) == {"inner.down"}


@pytest.mark.parametrize("act,second_reader,between", [
    (nn.GELU(), True, None), (nn.GELU(approximate="tanh"), False, None), (nn.ReLU(), False, None),
    (nn.GELU(), False, nn.Dropout(0.1)), (Scaled(), False, None)],
    ids=["read twice", "tanh GELU", "ReLU", "dropout 0.1", "times a number"])
def test_the_activation_stays_where_the_layer_is_not_its_only_reader_or_it_is_not_silu_or_gelu(
        act, second_reader, between):
    assert notes(convert(Outer(Reads(act, second_reader, between)).eval())) == {}


def test_a_layer_the_model_itself_calls_keeps_the_model_as_it_is():
    """The model's own class stays (an nn.Sequential stays subscriptable): no fusion at its top."""
    converted = convert(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval())
    assert notes(converted) == {} and isinstance(converted, nn.Sequential)


@pytest.mark.parametrize("recipe", ["fp8-static", "fp8-block"])
def test_layers_without_a_scale_per_row_of_x_keep_the_activation_before_them(recipe):
    """fp8-dynamic is per token (a row scale): it fuses too, static and block scaling do not."""
    assert notes(convert(Model().eval(), recipe)) == {}
    assert set(notes(convert(Model().eval(), "fp8-dynamic"))) == {"mlp.down", "vit.3"}


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 20000], ids=["one pass", "two loops, a part chunk"])
@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu", False)])
def test_the_layer_computes_the_activation_in_its_kernel_on_the_gpu(activation, gated, k):
    """The layer given h against the layer given act(h): within an e4m3 step of x (the kernel's exp
    and erf differ from torch's in the last bits), compiled with inductor too."""
    torch.manual_seed(0)
    site = sites.linear_site(k, 256, True, "bfloat16")
    layer = from_site(site, Fp8Options(granularity="row"), {"weight": torch.randn(256, k, dtype=torch.bfloat16),
                                                            "bias": torch.randn(256, dtype=torch.bfloat16)}).cuda()
    h = torch.randn(8, 100, k, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(h) if gated else None
    with torch.no_grad():
        want = layer(fp8.activate(h, activation, up))
        compiled = torch.compile(lambda h, up: layer(h, activation=activation, up=up), fullgraph=True)
        for got in (layer(h, activation=activation, up=up), compiled(h, up)):
            error = (got.float() - want.float()).norm() / want.float().norm()
            assert error < 2e-2
