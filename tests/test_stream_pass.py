"""The streamed pass's lockstep (lowconv/stream_pass.py): several runs of a model go through it
module by module, each module's weights read once for all of them, one thread at a time; runs that
go different ways, a run that fails and a site run twice under calibration stop it, by name."""
import threading

import pytest
import torch
from torch import nn

from lowconv.analysis import plan_conversion
from lowconv.errors import LowconvError
from lowconv.ops import OPS
from lowconv.passes.rewrite import linear_site_params
from lowconv.stream_pass import Diverged, Lockstep, streamed_pass


class Stack(nn.Module):
    def __init__(self, width: int = 32, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_runs_read_each_module_once_and_compute_what_the_model_computes():
    model = Stack()
    weights, reads, threads = weights_of(model), [], set()
    xs = [torch.randn(4, 32) for _ in range(3)]
    want = [model(x) for x in xs]
    got = {}

    def read(name):
        reads.append(name)
        return weights[name]

    def run(i):
        def go():
            threads.add(threading.current_thread().name)
            got[i] = model(xs[i])
        return go
    with Lockstep(model, read, lambda stand_in, tensor: None) as lockstep:
        lockstep.runs({f"run {i}": run(i) for i in range(3)})
    assert sorted(reads) == sorted(weights) and len(threads) == 3  # once each, for all three runs
    assert all(torch.equal(got[i], want[i]) for i in range(3))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # its own parameters are back


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_runs_that_go_different_ways_are_named():
    model = Branches()
    weights = weights_of(model)
    with Lockstep(model, weights.__getitem__, lambda s, t: None) as lockstep:
        with pytest.raises(Diverged, match="went different ways through it: up waits before a; down waits before b"):
            lockstep.runs({"up": lambda: model(torch.ones(2, 8)), "down": lambda: model(-torch.ones(2, 8))})
    assert [t.name for t in threading.enumerate() if t.name.startswith("lowconv-run")] == []


def test_a_failed_run_stops_the_others_and_its_error_is_raised():
    model = Stack()
    weights = weights_of(model)
    with Lockstep(model, weights.__getitem__, lambda s, t: None) as lockstep:
        with pytest.raises(RuntimeError, match="cannot be multiplied"):  # in layers.0, both runs inside the model
            lockstep.runs({"good": lambda: model(torch.randn(2, 32)), "bad": lambda: model(torch.randn(2, 31))})
    assert [t.name for t in threading.enumerate() if t.name.startswith("lowconv-run")] == []
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


def build_from(plan):
    def build(site, read):
        decision = next(d for d in plan.converted() if d.fqn == site.fqn)
        op = OPS[decision.op]
        return op.from_site(site, decision.options, linear_site_params(site, read))
    return build


def test_calibrated_scales_are_the_in_memory_ones_and_a_site_run_twice_is_refused():
    """Static scales calibrated over three batches in lockstep equal those lowconv.convert
    calibrates on the same batches; a site whose module runs twice a forward cannot be calibrated
    in one pass of it: refused, by name."""
    import lowconv
    model = Stack()
    weights = weights_of(model)
    batches = [(torch.randn(4, 32) * (i + 1),) for i in range(3)]
    converted = lowconv.convert(model, "fp8-static", batches[0], calibration=batches)
    analysis, plan = plan_conversion(model, "fp8-static", batches[0])
    sites = {s.fqn: s for s in analysis.sites}
    kept = {}
    report = streamed_pass(model, plan, sites, batches[0], weights.__getitem__, build_from(plan),
                           lambda site, op: kept.setdefault(site.fqn, op.input_scale.clone()), lambda s, t: None,
                           calibration=batches)
    assert kept.keys() == {"layers.0", "layers.1", "layers.2"}
    assert all(torch.equal(scale, converted.get_submodule(fqn).input_scale) for fqn, scale in kept.items())
    assert all(row.alone is not None for row in report.sites)

    model = Twice()
    analysis, plan = plan_conversion(model, "fp8-static", (torch.randn(2, 16),))
    with pytest.raises(LowconvError, match="fc runs more than once in a forward"):
        streamed_pass(model, plan, {s.fqn: s for s in analysis.sites}, (torch.randn(2, 16),),
                      weights_of(model).__getitem__, build_from(plan), lambda site, op: None, lambda s, t: None,
                      calibration=[(torch.randn(2, 16),)])
