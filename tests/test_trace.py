import torch
from torch import nn

from lowconv.passes.trace import find_regions, trace_model


class Untraceable(nn.Module):
    """Data-dependent control flow: symbolic tracing fails here, its children trace."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.lone = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.lone(self.inner(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Untraceable()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_whole_model_traces_as_one_region():
    trace = find_regions(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert [r.fqn for r in trace.regions] == [""]
    assert trace.untraced == []


def test_falls_back_to_largest_traceable_submodules():
    trace = find_regions(Model())
    assert [u.fqn for u in trace.untraced] == ["", "a"]
    assert "Proxy" in trace.untraced[0].error or "symbolically traced" in trace.untraced[0].error
    fqns = {r.fqn: r for r in trace.regions}
    assert set(fqns) == {"a.inner", "a.lone", "b"}
    assert fqns["a.inner"].graph is not None
    assert fqns["a.lone"].graph is None and fqns["b"].graph is None  # lone linears


def test_shapes_propagate_into_regions():
    model = Model()
    trace = trace_model(model, (torch.randn(3, 8),))
    inner = next(r for r in trace.regions if r.fqn == "a.inner")
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in inner.graph.graph.nodes if "tensor_meta" in n.meta}
    assert shapes["input_1"] == (3, 8) or (3, 8) in shapes.values()
    lone = next(r for r in trace.regions if r.fqn == "a.lone")
    assert tuple(lone.example_output.shape) == (3, 4)


def test_replay_of_known_regions():
    trace = find_regions(Model(), only=["a.inner", "b"])
    assert [r.fqn for r in trace.regions] == ["a.inner", "b"]
