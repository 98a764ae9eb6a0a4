import numpy as np
import pytest
import torch
from torch import nn

from lowconv.passes.trace import find_regions, trace_model
from lowconv.passes.tracer import SiteTracer, trace_module


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
    assert tuple(lone.output_meta.shape) == (3, 4)


def test_replay_of_known_regions():
    trace = find_regions(Model(), only=["a.inner", "b"])
    assert [r.fqn for r in trace.regions] == ["a.inner", "b"]


def test_fresh_inputs_clones_tensors_only():
    from lowconv.inputs import fresh_inputs

    x, w = torch.randn(3), torch.randn(2, requires_grad=True)
    args, kwargs = fresh_inputs((x, [x, 7], "s"), {"w": w, "n": None, "d": {"i": torch.arange(3)}})
    assert torch.equal(args[0], x) and args[0] is not x and args[0].data_ptr() != x.data_ptr()
    assert args[1][0] is args[0]  # a tensor passed twice is one clone: the run sees the aliasing
    assert args[1][1] == 7 and args[2] == "s" and kwargs["n"] is None
    assert kwargs["w"].requires_grad and kwargs["w"].is_leaf and kwargs["w"] is not w
    assert torch.equal(kwargs["d"]["i"], torch.arange(3))


class WritesIntoInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x[:, 0] = x[:, 0] + 1
        return self.lin(x)


def test_trace_model_leaves_written_inputs_alone():
    x = torch.zeros(2, 4)
    trace = trace_model(WritesIntoInput(), (x,))
    assert torch.equal(x, torch.zeros(2, 4))
    root = next(r for r in trace.regions if r.fqn == "")
    # the model's recorded arguments hold the example values, not what the runs wrote into them
    assert torch.equal(root.example_args[0], torch.zeros(2, 4))
    assert "setitem" in root.graph.code


class DuckTypingAttention(nn.Module):
    """transformers' is_jax_jitting: `hasattr(x, "jax")`, then x.jax() where jax imports."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if hasattr(x, "jax"):
            x = x.jax()
        return self.proj(x)


def test_an_attribute_the_example_value_lacks_is_missing_on_the_proxy_too():
    """fx's Proxy answers every attribute; a tensor has no `jax`, so the traced code takes the
    branch a real tensor takes and no call to a missing method is recorded."""
    model = DuckTypingAttention()
    x = torch.randn(2, 8)
    trace = trace_model(model, (x,))
    (region,) = trace.regions
    assert "jax" not in [n.target for n in region.graph.graph.nodes]
    torch.testing.assert_close(region.graph(x), model(x))


class KeywordsFromADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def combine(self, a, b):
        return a - b

    def forward(self, x, parts):
        return self.proj(x) + self.combine(**parts)


def test_the_keys_of_a_mapping_unpacked_with_two_stars_are_guarded():
    """`f(**parts)` with the example's keys: other keys at run time fail loudly, naming them."""
    import pytest

    model, x = KeywordsFromADict(), torch.randn(2, 8)
    parts = {"a": torch.randn(2, 8), "b": torch.randn(2, 8)}
    (region,) = trace_model(model, (x, parts)).regions
    torch.testing.assert_close(region.graph(x, parts), model(x, parts))
    with pytest.raises(AssertionError, match=r"keys \['a', 'b'\] were fixed"):
        region.graph(x, {"a": parts["a"], "b": parts["b"], "c": parts["a"]})


class ChecksItsDict(nn.Module):
    """Point Transformer V3's way with its point dict: `key in point` before reading it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, point):
        scale = point["scale"] if "scale" in point else 1.0
        return sum(self.proj(point[key]) for key in point if key != "scale") * scale


def test_key_in_a_mapping_and_its_keys_in_a_loop_are_the_examples_guarded():
    import pytest

    model, x = ChecksItsDict(), torch.randn(2, 8)
    point = {"feat": x, "scale": torch.tensor(2.0)}
    (region,) = trace_model(model, (point,)).regions
    torch.testing.assert_close(region.graph(point), model(point))
    with pytest.raises(AssertionError, match=r"keys \['feat', 'scale'\] were fixed"):
        region.graph({"feat": x})


class Doubling(nn.Module):
    def forward(self, x):
        for _ in range(8):
            x = x * 2
        return x


def test_the_tracer_holds_an_example_value_only_while_the_traced_code_does():
    """As a forward drops its intermediate tensors: not every node's value for the whole trace."""
    tracer = SiteTracer([torch.randn(4, 4)])
    held, evaluate = [], tracer.example.evaluate

    def counting(node, root):
        evaluate(node, root)
        held.append(sum(isinstance(v, torch.Tensor) for v in tracer.example.values.values()))

    tracer.example.evaluate = counting
    tracer.trace(Doubling())
    assert len(held) == 9 and max(held) <= 3  # the argument, the value read and the one made


class ShapeReadTwice(nn.Module):
    def forward(self, x):
        shape = x.shape  # one fx Attribute: its node is made once, then read by both branches
        if shape[0] > 1:
            x = x * 2
        if shape[-1] == 8:
            x = x + 1
        return x


def test_an_attribute_read_again_after_its_value_was_dropped_still_decides():
    x = torch.randn(3, 8)
    (region,) = trace_model(ShapeReadTwice(), (x,)).regions
    assert len(region.decided) == 2
    torch.testing.assert_close(region.graph(x), ShapeReadTwice()(x))


class NumpyScalars(nn.Module):
    """SphereFormer's exponential split scales by `np.log(2)` (np.float64); other code divides by
    an np.float32 or indexes with an np.int64."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * np.log(2) + x[:, np.int64(1):].sum(-1, keepdim=True) / np.float32(3.0)


def test_numpy_scalars_become_the_numbers_they_hold_in_the_traced_code():
    model, x = NumpyScalars(), torch.randn(4, 8)
    region = trace_model(model, (x,)).regions[0]
    assert "np." not in region.graph.code  # numpy 2 prints np.float64(0.69...), which the code cannot run
    torch.testing.assert_close(region.graph(x), model(x))


class PicksByType(nn.Module):
    """spconv's SparseSequential picks its branch with isinstance on its input: a Proxy is no
    Tensor, so tracing takes the other branch, which reads an attribute tensors lack."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return self.fc(x)
        return self.fc(x.features)


def test_a_branch_on_the_input_s_type_falls_back_to_the_children_with_the_reason():
    model = nn.Sequential(PicksByType(), nn.ReLU(), nn.Linear(16, 4))
    trace = trace_model(model, (torch.randn(3, 16),))
    assert {r.fqn for r in trace.regions} >= {"0.fc", "2"}
    assert any(u.fqn == "0" and "features" in u.error for u in trace.untraced)


class SizedByItsInput(nn.Module):
    """OPT's pattern: `torch.ones(x.shape[0], n)`, a factory sized by separate traced arguments,
    which torch's argument parser refuses before fx sees the call."""

    def forward(self, x):
        return x + torch.ones(x.shape[0], x.shape[1], dtype=x.dtype) + torch.zeros((x.shape[0], 1))


def test_a_factory_sized_by_traced_values_traces_and_follows_the_input():
    trace = trace_model(SizedByItsInput(), (torch.randn(2, 3),))
    assert [r.fqn for r in trace.regions] == [""] and trace.untraced == []
    x = torch.randn(4, 5)
    assert torch.equal(trace.regions[0].graph(x), SizedByItsInput()(x))


class BranchOnLength(nn.Module):
    """transformers' masking code: a branch on a sequence length, which tracing decides."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[1] == 1:
            x = x * 2
        return self.proj(x)


def test_a_decided_branch_compiles_with_dynamic_shapes():
    """The guard of a branch on a size compares a SymBool under torch.compile(dynamic=True): a
    new length takes the branch the example took, and one that branches the other way still fails."""
    model = BranchOnLength()
    (region,) = trace_model(model, (torch.randn(2, 5, 8),)).regions
    assert len(region.decided) == 1
    compiled = torch.compile(region.graph, fullgraph=True, dynamic=True, backend="eager")
    for length in (5, 7):
        x = torch.randn(2, length, 8)
        torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(AssertionError, match="this branch was decided as False"):
        region.graph(torch.randn(2, 1, 8))


def test_an_argument_fixed_by_the_example_says_how_to_pass_it():
    """fx guards an argument traced as the example's None or constant; the message names the way out."""
    class Masked(nn.Module):
        def forward(self, x, mask=None, scale=1.0):
            return (x if mask is None else x * mask) * scale

    traced = trace_module(Masked(), fixed={"mask": None, "scale": 2.0})
    x = torch.randn(3)
    assert torch.equal(traced(x, scale=2.0), x * 2.0)
    with pytest.raises(AssertionError, match="mask was None in the example inputs at conversion, and the converted "
                                             "code takes only None there: convert with mask in the example inputs"):
        traced(x, mask=torch.ones(3), scale=2.0)
    with pytest.raises(AssertionError, match="scale was 2.0 in the example inputs at conversion"):
        traced(x, scale=3.0)
