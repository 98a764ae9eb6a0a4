"""Never slower: a site whose op measures slower than the original at conversion is kept, and the
plan says why, unless the recipe's rule forces the op. The timing itself runs on CUDA only; here it
is replaced by a stand-in that says what a GPU would have measured."""
import pytest
import torch
from torch import nn

import lowconv
from lowconv import build
from lowconv.analysis import analyze
from lowconv.errors import LowconvError
from lowconv.ops.registry import OPS
from lowconv.recipe import parse_recipe
from lowconv.site_timing import SiteTiming, input_groups, time_linear_site
from tests import sites

RECIPE = """
[[rules]]
kind = "linear"
op = "fp8"
{force}
"""


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def timing_by_fqn(slow_fqns):
    def fake(site, module, params, shared_by=1):
        return SiteTiming(op_ms=2.0 if site.fqn in slow_fqns else 0.5, original_ms=1.0, shape="8 x 64 x 128")
    return fake


def test_a_site_measured_slower_is_kept_with_the_reason(monkeypatch):
    monkeypatch.setattr(build, "time_linear_site", timing_by_fqn({"2"}))
    converted = lowconv.convert(mlp(), parse_recipe(RECIPE.format(force="")), (torch.randn(8, 64),))
    decisions = {d.fqn: d for d in converted.lowconv_plan.decisions}
    assert decisions["0"].op == "fp8" and "measured fp8 500.0 us vs the original's 1000.0 us" in decisions["0"].note
    assert decisions["2"].op == "keep" and "kept: fp8 2000.0 us vs the original's 1000.0 us" in decisions["2"].reason
    assert "force = true" in decisions["2"].reason
    assert type(converted[2]) is nn.Linear and type(converted[0]).__name__ == "Fp8Linear"


def test_a_forced_rule_converts_a_slower_site_without_timing_it(monkeypatch):
    def never(*args):
        raise AssertionError("a forced site is not timed")
    monkeypatch.setattr(build, "time_linear_site", never)
    converted = lowconv.convert(mlp(), parse_recipe(RECIPE.format(force="force = true")), (torch.randn(8, 64),))
    assert all(d.op == "fp8" and d.forced for d in converted.lowconv_plan.decisions)


class ThreeReadOneInput(nn.Module):
    """q, k and v read x (one quantization of x under torch.compile); out reads what they give."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 64), nn.Linear(160, 16)

    def forward(self, x):
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], -1))


@pytest.mark.parametrize("quantization_ms,converted", [(0.6, True), (1.2, False)],
                         ids=["shared quantization pays", "slower even shared"])
def test_layers_reading_one_input_share_its_quantization_and_are_kept_or_converted_together(
        quantization_ms, converted, monkeypatch):
    """Each of q, k, v measures 0.2 ms of GEMM plus x's quantization against 0.5 ms of bf16: alone
    each is slower where the quantization costs 0.6 ms, shared by three they are faster."""
    seen = {}

    def fake(site, module, params, shared_by=1):
        seen[site.fqn] = shared_by
        gemm_ms = 0.2 if site.fqn != "k" else 0.45  # k's own share is slower: the group decides
        return SiteTiming(op_ms=gemm_ms + quantization_ms / shared_by, original_ms=0.5, shape="8 x 64 x 64",
                          shared_by=shared_by)
    monkeypatch.setattr(build, "time_linear_site", fake)
    converted_model = lowconv.convert(ThreeReadOneInput(), parse_recipe(RECIPE.format(force="")), (torch.randn(8, 64),))
    decisions = {d.fqn: d for d in converted_model.lowconv_plan.decisions}
    assert seen == {"q": 3, "k": 3, "out": 1}  # v is q's GEMM: timed once
    assert {fqn: decisions[fqn].op for fqn in "qkv"} == {fqn: "fp8" if converted else "keep" for fqn in "qkv"}
    if converted:
        assert "x's quantization shared by 3 sites" in decisions["k"].note


def test_fp8_layers_know_whether_another_layer_quantizes_their_input(tmp_path):
    """Converted and loaded alike: q, k and v read one x (under torch.compile inductor quantizes it
    once for the three), `out` reads its own (lowconv's row kernel may take it)."""
    model = ThreeReadOneInput()
    example = (torch.randn(8, 64),)
    converted = lowconv.convert(model, parse_recipe(RECIPE.format(force="")), example)
    shared = {fqn: converted.get_submodule(fqn).input_shared for fqn in ("q", "k", "v", "out")}
    assert shared == {"q": True, "k": True, "v": True, "out": False}
    lowconv.save(converted, tmp_path / "out")
    loaded = lowconv.load(model, tmp_path / "out", example)
    assert {fqn: loaded.get_submodule(fqn).input_shared for fqn in shared} == shared


def test_input_groups_join_linears_of_one_op_and_options_reading_one_node():
    found = analyze(ThreeReadOneInput(), (torch.randn(8, 64),))
    sites_ = {s.fqn: s for s in found.sites}
    same = {fqn: "fp8 {}" for fqn in sites_}
    groups = input_groups(list(sites_.values()), same)
    assert groups["q"] == groups["k"] == groups["v"] != groups["out"]
    other = {**same, "k": "fp8 {'granularity': 'row'}"}  # another quantization of x: not shared
    groups = input_groups(list(sites_.values()), other)
    assert groups["q"] == groups["v"] != groups["k"]


def test_force_must_be_a_boolean():
    with pytest.raises(LowconvError, match=r"rule 1: force: expected boolean, got 'yes'"):
        parse_recipe(RECIPE.format(force='force = "yes"'), "r.toml")


def test_sites_are_not_timed_off_the_gpu():
    site = sites.linear_site(64, 128, dtype="float32")
    module = nn.Linear(64, 128)
    assert time_linear_site(site, module, {"weight": module.weight, "bias": module.bias}) is None


@pytest.mark.gpu
def test_timing_on_the_gpu_compares_the_op_with_f_linear():
    site = sites.linear_site(4096, 4096, dtype="bfloat16")
    site.input = type(site.input)((4096, 4096), "bfloat16")
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    timing = time_linear_site(site, nn.Linear(4096, 4096, bias=False).cuda().bfloat16(), {"weight": weight})
    assert timing is not None and 0.5 < timing.op_ms / timing.original_ms < 2  # the same GEMM, timed twice
    assert timing.shape == "4096 x 4096 x 4096"


@pytest.mark.gpu
def test_an_fp8_layer_is_charged_its_share_of_a_shared_input_quantization():
    site = sites.linear_site(4096, 4096, bias=False, dtype="bfloat16")
    site.input = type(site.input)((4096, 4096), "bfloat16")
    linear = nn.Linear(4096, 4096, bias=False).cuda().bfloat16()
    module = OPS["fp8"].from_site(site, OPS["fp8"].options(granularity="row"), {"weight": linear.weight.detach()})
    alone = time_linear_site(site, module, {"weight": linear.weight})
    shared = time_linear_site(site, module, {"weight": linear.weight}, shared_by=3)
    assert shared.op_ms < alone.op_ms and shared.shared_by == 3 and alone.shared_by == 1
    assert "shared by 3 sites" in shared.describe("fp8")


class Branching(nn.Module):
    """One functional linear (a traced region's site) after a branch on the input's shape."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 64))

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        return torch.nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("slower", [False, True])
def test_the_plan_warns_of_a_rewritten_region_only_if_a_site_in_it_stays_converted(monkeypatch, slower):
    monkeypatch.setattr(build, "time_linear_site", timing_by_fqn({"linear"} if slower else set()))
    converted = lowconv.convert(Branching(), parse_recipe(RECIPE.format(force="")), (torch.randn(8, 64),))
    [decision] = converted.lowconv_plan.decisions
    assert decision.op == ("keep" if slower else "fp8")
    assert any("branches decided" in w for w in converted.lowconv_plan.warnings) == (not slower)
    assert (type(converted) is Branching) == slower


def test_sites_of_the_same_gemm_are_timed_once(monkeypatch):
    timed = []

    def fake(site, module, params, shared_by=1):
        timed.append(site.fqn)
        return SiteTiming(op_ms=0.5, original_ms=1.0, shape="")
    monkeypatch.setattr(build, "time_linear_site", fake)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    converted = lowconv.convert(model, parse_recipe(RECIPE.format(force="")), (torch.randn(8, 64),))
    assert timed == ["0", "4"]  # "2" has layer 0's GEMM: its timing is reused
    assert all("measured fp8" in d.note for d in converted.lowconv_plan.decisions)
