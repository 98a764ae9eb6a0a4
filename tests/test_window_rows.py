"""Converted SpTr chains read row windows from get_window_rows: the pair layout (index_0, index_1,
each M = sum n_w^2 long) is no longer built, unless something else reads it."""
from dataclasses import replace

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

import lowconv
from lowconv.compat import sptr
from lowconv.model_file import load_model_file
from lowconv.ops import OPS
from lowconv.ops.window_attention import SparseWindowAttention
from lowconv.recipe import parse_recipe

FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')


def scene(n=300):
    torch.manual_seed(0)
    xyz = torch.rand(n, 3) * torch.tensor([1.5, 1.5, 0.6])
    return torch.randn(n, 32), xyz, (torch.arange(n) >= n // 2).long()


def n_pairs(xyz, batch, window_size, shift_win) -> int:
    """M, the (query, key) pairs of SpTr's layout: the sum of squared window sizes."""
    counts = sptr.window_partition(xyz, batch, window_size, shift_win)[2].diff()
    return int((counts.long() ** 2).sum())


def tensor_shapes(meta) -> list[tuple]:
    """The shapes of the tensors ShapeProp left in a node's meta (a tuple's items included)."""
    if hasattr(meta, "shape"):  # a TensorMetadata, itself a tuple
        return [tuple(meta.shape)]
    return [shape for item in meta for shape in tensor_shapes(item)] if isinstance(meta, (tuple, list)) else []


def pair_sized(gm: fx.GraphModule, inputs, pair_counts) -> list[str]:
    """The nodes of gm whose output has a tensor of M rows, M any of pair_counts."""
    ShapeProp(gm).propagate(*inputs)
    return [node.name for node in gm.graph.nodes
            if any(shape[:1] in {(m,) for m in pair_counts}
                   for shape in tensor_shapes(node.meta.get("tensor_meta")))]


def targets(gm: fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def convert_keeping_pair_layouts(model, recipe, inputs, monkeypatch):
    """The conversion as it was before pair layouts were dropped."""
    with monkeypatch.context() as patch:
        patch.setitem(OPS, "sparse_attention", replace(OPS["sparse_attention"], rewrite_graph=None))
        return lowconv.convert(model, recipe, inputs)


@pytest.mark.parametrize("shift_win", [False, True])
@pytest.mark.parametrize("batches", [(0, 1), (0, 2)])
def test_window_rows_are_the_pair_layouts(shift_win, batches):
    torch.manual_seed(1)
    xyz = torch.rand(500, 3) * torch.tensor([1.2, 0.9, 0.5])
    batch = torch.tensor(batches)[torch.randint(2, (500,))]
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
        xyz, batch, (0.4, 0.3, 0.5), shift_win)
    rows = sptr.get_window_rows(xyz, batch, (0.4, 0.3, 0.5), shift_win)
    for got, want in zip(rows, (sort_idx, *sptr.row_windows_from_pairs(index_0_offsets, index_1))):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert [len(t) for t in sptr.get_window_rows(xyz[:0], batch[:0], 0.3, shift_win)] == [0, 0, 0]


def test_converted_example_computes_nothing_of_the_pair_count(monkeypatch, tmp_path):
    loaded = load_model_file("examples/point_transformer.py")
    model, inputs = loaded.model, loaded.inputs
    _, xyz, batch = inputs
    pair_counts = [n_pairs(xyz, batch, block.attn.window_size, block.attn.shift_win) for block in model.blocks]
    before = convert_keeping_pair_layouts(model, "sparse-attention-bf16", inputs, monkeypatch)
    assert pair_sized(before, inputs, pair_counts)  # what is to go: the pair layout and its items
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert not pair_sized(converted, inputs, pair_counts)
    assert targets(converted).count(sptr.get_window_rows) == 2 and sptr.get_indices_params not in targets(converted)
    with torch.no_grad():
        out = converted(*inputs)
        assert torch.equal(out, before(*inputs))
        lowconv.save(converted, tmp_path)
        loaded_back = lowconv.load(model, tmp_path)
        assert torch.equal(loaded_back(*inputs), out)
    assert targets(loaded_back) == targets(converted)


class Block(nn.Module):
    def __init__(self, pe_type, shift_win=False):
        super().__init__()
        self.attn = sptr.VarLengthMultiheadSA(32, 2, "w", 0.3, shift_win, pe_type=pe_type, quant_size=0.3 / 6)

    def forward(self, feats, xyz, batch):
        return self.attn(feats, xyz, batch)


@pytest.mark.parametrize("pe_type", ["none", "contextual"])
@pytest.mark.parametrize("shift_win", [False, True])
def test_plain_and_contextual_blocks_drop_the_pair_layout(pe_type, shift_win, monkeypatch):
    model, inputs = Block(pe_type, shift_win).eval(), scene()
    pair_counts = [n_pairs(inputs[1], inputs[2], 0.3, shift_win)]
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert not pair_sized(converted, inputs, pair_counts)
    with torch.no_grad():
        before = convert_keeping_pair_layouts(model, "sparse-attention-bf16", inputs, monkeypatch)
        assert torch.equal(converted(*inputs), before(*inputs))
        torch.testing.assert_close(lowconv.convert(model, FLOAT32, inputs)(*inputs), model(*inputs),
                                   rtol=1e-4, atol=1e-5)


class WindowChain(nn.Module):
    def forward(self, q, k, v, layout):
        attn = sptr.attention_step1(q, k, *layout)
        attn = sptr.scatter_softmax_csr(attn, layout[1], dim=0)
        return sptr.attention_step2(attn, v, *layout)


class SharedLayout(nn.Module):
    """Two chains on one get_indices_params; `also_read`, an index tensor of it that other code reads too."""

    def __init__(self, also_read=None):
        super().__init__()
        self.also_read = also_read
        self.qkv = nn.Linear(32, 96)
        self.first, self.second = WindowChain(), WindowChain()

    def forward(self, feats, xyz, batch):
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
            xyz, batch, 0.3, False)
        q, k, v = self.qkv(feats)[sort_idx].reshape(-1, 3, 2, 16).unbind(1)
        layout = (index_0, index_0_offsets, index_1, index_1_offsets, n_max)
        x = self.first(q * 0.25, k, v, layout)
        x = self.second(x * 0.25, k, v, layout)
        out = torch.empty_like(x).index_copy(0, sort_idx, x).flatten(1)
        if self.also_read == "index_0":
            return out, index_0.bincount()  # pairs per point
        if self.also_read == "index_0_offsets":
            return out, index_0_offsets.diff()  # the same, from the CSR pointer
        return out


def window_op_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes
            if node.op == "call_module" and isinstance(gm.get_submodule(node.target), SparseWindowAttention)]


def test_chains_sharing_a_layout_share_one_get_window_rows():
    model, inputs = SharedLayout().eval(), scene()
    converted = lowconv.convert(model, FLOAT32, inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["first.attention", "second.attention"]
    assert targets(converted).count(sptr.get_window_rows) == 1 and sptr.get_indices_params not in targets(converted)
    first, second = window_op_calls(converted)
    assert first.kwargs["row_windows"] == second.kwargs["row_windows"]
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


KEEP_SECOND = parse_recipe('[[rules]]\nmodules = ["second.attention"]\nop = "keep"\n\n'
                           '[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')


@pytest.mark.parametrize("model, recipe", [
    (SharedLayout(also_read="index_0"), FLOAT32),
    (SharedLayout(also_read="index_0_offsets"), FLOAT32),  # what the converted ops read too
    (SharedLayout(), KEEP_SECOND),
], ids=["index_0 read elsewhere", "index_0_offsets read elsewhere", "a kept chain"])
def test_a_pair_layout_read_by_anything_else_stays(model, recipe):
    model, inputs = model.eval(), scene()
    converted = lowconv.convert(model, recipe, inputs)
    assert converted.lowconv_plan.converted()[0].fqn == "first.attention"
    assert sptr.get_indices_params in targets(converted) and sptr.get_window_rows not in targets(converted)
    assert all("row_windows" not in call.kwargs for call in window_op_calls(converted))
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


class GivenLayout(nn.Module):
    """A chain whose pair layout is made outside it: a forward argument."""

    def __init__(self):
        super().__init__()
        self.chain = WindowChain()

    def forward(self, q, k, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets):
        return self.chain(q, k, v, (index_0, index_0_offsets, index_1, index_1_offsets, n_max))


def test_a_pair_layout_from_outside_the_region_is_read_as_given():
    _, xyz, batch = scene()
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
        xyz, batch, 0.3, False)
    q, k, v = torch.randn(3, len(xyz), 2, 16)
    inputs = (q * 0.25, k, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets)
    converted = lowconv.convert(GivenLayout(), FLOAT32, inputs)
    [call] = window_op_calls(converted)
    assert [a.name for a in call.args[3:5]] == ["index_0_offsets", "index_1"]
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), GivenLayout()(*inputs), rtol=1e-4, atol=1e-5)


def test_the_op_reads_row_windows_as_it_reads_the_pair_layout():
    _, xyz, batch = scene()
    _, index_0_offsets, _, index_1, _, sort_idx = sptr.get_indices_params(xyz, batch, 0.3, True)
    row_windows = sptr.get_window_rows(xyz, batch, 0.3, True)[1:]
    q, k, v = torch.randn(3, len(xyz), 2, 16)
    coords = torch.randint(0, 50, (len(xyz), 3))  # per-point whole numbers: SpTr's inline rel_idx form
    tables = tuple(torch.randn(11, 3, 2, 16) for _ in range(3))
    op = SparseWindowAttention()
    given_pairs = op(q, k, v, index_0_offsets, index_1, None, None, None, 6, False, *tables, coords)
    given_rows = op(q, k, v, None, None, None, None, None, 6, False, *tables, coords, row_windows=row_windows)
    assert torch.equal(given_rows, given_pairs)
