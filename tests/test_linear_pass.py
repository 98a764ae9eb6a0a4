import torch
import torch.nn.functional as F
from torch import nn

from lowconv.passes.linear import find_linear_sites
from lowconv.passes.trace import trace_model


class Conv1D(nn.Module):
    """Hugging Face GPT-2's linear: weight laid out (in, out), torch.addmm."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.w1 = nn.Parameter(torch.randn(32, 32))
        self.conv1d = Conv1D(16, 32)
        self.mm_w = nn.Parameter(torch.randn(16, 16))
        self.mm_b = nn.Parameter(torch.randn(16))
        self.bare_w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        x = self.lin(x)
        x = F.linear(x, self.w1)
        x = self.conv1d(x)
        x = x @ self.mm_w + self.mm_b
        y = torch.matmul(x, self.bare_w)
        return y + (x @ x.transpose(-2, -1)).sum()  # an activation product is not a linear


def sites_of(model, x):
    trace = trace_model(model, (x,))
    return {s.fqn: s for r in trace.regions for s in find_linear_sites(r)}


def test_every_linear_form_is_found_with_its_layout():
    sites = sites_of(Forms(), torch.randn(2, 5, 16))
    assert set(sites) == {"lin", "w1", "conv1d", "mm_w", "bare_w"}
    assert sites["lin"].module_backed and sites["lin"].info.form == "module"
    assert sites["w1"].info.form == "functional" and sites["w1"].info.weight_layout == "out_in"
    assert sites["conv1d"].info.form == "addmm" and sites["conv1d"].info.weight_layout == "in_out"
    assert (sites["conv1d"].info.in_features, sites["conv1d"].info.out_features) == (32, 16)
    assert sites["mm_w"].info.bias and sites["mm_w"].info.bias_name == "mm_b"
    assert not sites["bare_w"].info.bias and sites["bare_w"].info.out_features == 8
    assert sites["conv1d"].classes[0] == "Conv1D"
    assert sites["conv1d"].input.shape == (10, 32)  # the 2-D view addmm takes
    assert sites["lin"].input.shape == (2, 5, 16) and sites["lin"].output.dtype == "float32"
    assert all(s.unsupported is None for s in sites.values())


def test_shared_weight_is_not_converted():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return F.linear(F.linear(x, self.w), self.w)

    sites = trace_model(Shared(), (torch.randn(2, 8),)).regions[0]
    found = find_linear_sites(sites)
    assert len(found) == 2 and all("also used" in s.unsupported for s in found)


def test_module_called_twice_is_one_site():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return self.l(self.l(x))

    assert list(sites_of(Twice(), torch.randn(2, 8))) == ["l"]


def test_conv1d_traced_on_its_own_gets_a_linear_child():
    from lowconv.passes.trace import Region
    from lowconv.passes.tracer import trace_module

    conv = Conv1D(16, 32)
    [site] = find_linear_sites(Region("h.0.c_attn", conv, trace_module(conv)))
    assert site.fqn == "h.0.c_attn.linear" and site.unsupported is None
    assert site.info.weight == "h.0.c_attn.weight"


class TransposedWeight(nn.Module):
    """Falcon's FalconLinear: an nn.Linear whose forward is `x @ self.weight.T` (+ bias)."""

    def __init__(self):
        super().__init__()
        self.w_t = nn.Parameter(torch.randn(48, 32))
        self.b_t = nn.Parameter(torch.randn(48))
        self.w_method = nn.Parameter(torch.randn(16, 48))

    def forward(self, x):
        x = x @ self.w_t.T + self.b_t
        return torch.matmul(x, self.w_method.transpose(0, 1))


def test_a_transposed_parameter_is_a_linear_laid_out_as_nn_linear():
    sites = sites_of(TransposedWeight(), torch.randn(2, 5, 32))
    assert set(sites) == {"w_t", "w_method"}
    assert sites["w_t"].info.form == "matmul" and sites["w_t"].info.weight_layout == "out_in"
    assert (sites["w_t"].info.in_features, sites["w_t"].info.out_features) == (32, 48)
    assert sites["w_t"].info.bias_name == "b_t" and not sites["w_method"].info.bias
    assert (sites["w_method"].info.in_features, sites["w_method"].info.out_features) == (48, 16)


def test_a_transposed_parameter_converts_and_loads_again(tmp_path):
    import lowconv
    torch.manual_seed(0)
    model, x = TransposedWeight().eval(), torch.randn(2, 5, 32)
    converted = lowconv.convert(model, "fp8-dynamic", (x,))
    assert {d.fqn for d in converted.lowconv_plan.converted()} == {"w_t", "w_method"}
    with torch.no_grad():
        want, got = model(x), converted(x)
    assert ((got - want).norm() / want.norm()) < 0.1
    lowconv.save(converted, tmp_path)
    with torch.no_grad():
        assert torch.equal(lowconv.load(TransposedWeight().eval(), tmp_path, (x,))(x), got)
