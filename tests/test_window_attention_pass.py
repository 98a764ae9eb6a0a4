"""SpTr chains found in a traced model and rewritten to one fused window-attention call."""
import pytest
import torch
from torch import nn

import lowconv
from lowconv.compat import sptr
from lowconv.compat.sptr import attention_step1, attention_step2, get_indices_params, scatter_softmax_csr
from lowconv.model_file import load_model_file
from lowconv.ops import attention_calls, sparse_attention
from lowconv.passes.trace import trace_model
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.recipe import parse_recipe

SPTR_NODES = set(sptr.SPTR_OPS) | {sptr.relative_position_index}
FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')


class Block(nn.Module):
    def __init__(self, pe_type, split=False):
        super().__init__()
        self.attn = sptr.VarLengthMultiheadSA(32, 2, "w", 0.3, pe_type=pe_type, quant_size=0.3 / 6)
        if pe_type == "contextual":  # nonzero tables, so that relative position changes the output
            for table in (self.attn.relative_pos_query_table, self.attn.relative_pos_key_table,
                          self.attn.relative_pos_value_table):
                nn.init.normal_(table, std=0.5)

    def forward(self, feats, xyz, batch):
        return self.attn(feats, xyz, batch)


def scene(n=300):
    torch.manual_seed(0)
    xyz = torch.rand(n, 3) * torch.tensor([1.5, 1.5, 0.6])
    return torch.randn(n, 32), xyz, (torch.arange(n) >= n // 2).long()


class SparseTrBlock(nn.Module):
    """SphereFormer's call: a SparseTrTensor made in forward (batch in column 0 of the indices),
    attended by two layers (the second on the first's output, a third on the same input: the
    layout cached in it under their key)."""

    def __init__(self):
        super().__init__()
        self.attn = sptr.VarLengthMultiheadSA(32, 2, "w", 0.3, pe_type="contextual", quant_size=0.3 / 6)
        self.again = sptr.VarLengthMultiheadSA(32, 2, "w", 0.3)
        self.beside = sptr.VarLengthMultiheadSA(32, 2, "w", 0.3)

    def forward(self, feats, xyz, batch):
        tensor = sptr.SparseTrTensor(feats, torch.cat([batch[:, None].float(), xyz], 1), None, None)
        out = self.again(self.attn(tensor))
        return out.query_feats + self.beside(tensor).query_feats


def test_sparse_tr_tensor_calls_convert_every_chain_and_match_float64():
    model, inputs = SparseTrBlock().eval(), scene()
    converted = lowconv.convert(model, FLOAT32, inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["attn.attention", "again.attention",
                                                                    "beside.attention"]
    targets = {n.target for n in converted.graph.nodes if n.op == "call_function"}
    assert not targets & SPTR_NODES and sptr.get_indices_params not in targets  # no pair layout built
    with torch.no_grad():
        expected = model.double()(*(t.double() if t.is_floating_point() else t for t in inputs))
        torch.testing.assert_close(converted(*inputs).double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pe_type", ["none", "contextual"])
def test_chain_is_one_site_with_what_the_kernel_needs(pe_type):
    inputs = scene()
    trace = trace_model(Block(pe_type).eval(), inputs)
    [site] = find_window_attention_sites(trace.regions[0])
    assert site.fqn == "attn.attention" and site.unsupported is None
    assert (site.info.form, site.info.heads, site.info.head_dim, site.info.rel_pos) == ("window", 2, 16, pe_type)
    assert len(site.args) == (13 if pe_type == "contextual" else 5)
    assert {n.target for n in site.nodes} >= {sptr.scatter_softmax_csr}


@pytest.mark.parametrize("pe_type", ["none", "contextual"])
def test_conversion_leaves_no_sptr_op_and_matches_float64(pe_type, tmp_path):
    model, inputs = Block(pe_type).eval(), scene()
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    targets = {n.target for n in converted.graph.nodes if n.op == "call_function"}
    assert not targets & SPTR_NODES
    report = lowconv.compare(model, converted, inputs)
    assert 40 < report.sites[0].alone.sqnr_db < 70  # bf16 operands, fp32 accumulation
    lowconv.save(converted, tmp_path)
    with torch.no_grad():
        assert torch.equal(lowconv.load(model, tmp_path)(*inputs), converted(*inputs))
    float32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')
    model64 = Block(pe_type).eval().double()
    model64.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = model64(*(t.double() if t.is_floating_point() else t for t in inputs))
        out = lowconv.convert(model, float32, inputs)(*inputs)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("pe_type", ["none", "contextual"])
def test_no_points_give_no_points_before_and_after_conversion(pe_type):
    """An empty scene (a sweep with nothing in range): the block and its conversion return (0, C)."""
    model = Block(pe_type).eval()
    converted = lowconv.convert(model, FLOAT32, scene())
    feats, xyz, batch = (t[:0] for t in scene())
    with torch.no_grad():
        assert model(feats, xyz, batch).shape == converted(feats, xyz, batch).shape == (0, 32)


def test_rel_idx_rewritten_by_a_split_function_is_kept_with_why():
    class Split(Block):
        def forward(self, feats, xyz, batch):
            a = self.attn
            n, c = feats.shape
            q = a.q(feats).reshape(n, 2, 16) * a.scale
            k, v = a.k(feats).reshape(n, 2, 16), a.v(feats).reshape(n, 2, 16)
            index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
                xyz, batch, 0.3, False)
            return sptr.sparse_self_attention(
                q, k, v, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx, 0.3, False,
                pe_type="contextual", rel_query=True, rel_key=True, rel_value=True, quant_size=0.05,
                quant_grid_length=6, relative_pos_query_table=a.relative_pos_query_table,
                relative_pos_key_table=a.relative_pos_key_table, relative_pos_value_table=a.relative_pos_value_table,
                split_func=lambda xyz, i0, i1, rel: rel.flip(1))

    trace = trace_model(Split("contextual").eval(), scene())
    [site] = find_window_attention_sites(trace.regions[0])
    assert "rel_idx is not relative_position_index" in site.unsupported


def test_point_transformer_example_converts():
    loaded = load_model_file("examples/point_transformer.py")
    converted = lowconv.convert(loaded.model, "sparse-attention-bf16", loaded.inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["blocks.0.attn.attention", "blocks.1.attn.attention"]
    report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=True)
    assert report.passed and report.outputs[0].logits.top1 > 0.99


def test_ops_imported_by_name_are_matched_too():
    class ByName(nn.Module):
        def forward(self, q, k, v, xyz, batch):
            index_0, index_0_offsets, n_max, index_1, index_1_offsets, _ = get_indices_params(xyz, batch, 0.3, False)
            attn = attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
            attn = scatter_softmax_csr(attn, index_0_offsets, dim=0)
            return attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)

    _, xyz, batch = scene()
    order = sptr.window_partition(xyz, batch, 0.3)[1]
    xyz, batch = xyz[order], batch[order]
    q = torch.randn(len(xyz), 2, 16)
    trace = trace_model(ByName(), (q, q, q, xyz, batch))
    [site] = find_window_attention_sites(trace.regions[0])
    assert site.unsupported is None and site.info.rel_pos == "none"


class ShortTables(nn.Module):
    """SpTr's contextual chain with G = 4 (window 0.5, quant 0.125) but tables of `rows` rows, by
    relative_position_index or SpTr's inline form; fine in the original while no rel_idx reaches
    the tables' end (points near their window's corner)."""

    def __init__(self, rows, form):
        super().__init__()
        self.form = form
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(rows, 3, 2, 16) * 0.5) for _ in range(3))

    def forward(self, q, k, v, xyz, batch):
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, _ = sptr.get_indices_params(xyz, batch, 0.5, False)
        if self.form == "function":
            rel_idx = sptr.relative_position_index(xyz, index_0, index_1, 0.5, 0.125, 4)
        else:
            p = torch.div((xyz - xyz.min(0)[0]) % 0.5, 0.125, rounding_mode="floor")
            rel_idx = (p[index_0.long()] - p[index_1.long()] + 3).int()
        tq, tk, tv = self.tables
        attn = sptr.dot_prod_with_idx_all(q, index_0, index_0_offsets, k, index_1, index_1_offsets, tq, tk,
                                          rel_idx, n_max)
        attn = sptr.scatter_softmax_csr(attn, index_0_offsets, dim=0)
        return sptr.attention_step2_with_rel_pos_value(attn, v, index_0, index_0_offsets, n_max, index_1,
                                                       index_1_offsets, tv, rel_idx)


def corner_scene(n=200):
    """Points in window order, each in the first two quant cells of its window on every axis."""
    torch.manual_seed(0)
    window = torch.randint(0, 4, (n, 3)).float()
    xyz = window * 0.5 + torch.rand(n, 3) * 0.2
    xyz[0] = 0  # the windows' origin, exactly
    batch = torch.zeros(n, dtype=torch.long)
    xyz = xyz[sptr.window_partition(xyz, batch, 0.5)[1]]
    q, k, v = torch.randn(3, n, 2, 16).unbind(0)
    return q * 0.25, k, v, xyz, batch


@pytest.mark.parametrize("form", ["function", "inline"])
def test_tables_shorter_than_rel_idx_needs_keep_the_site_with_why(form):
    inputs = corner_scene()
    trace = trace_model(ShortTables(5, form), inputs)
    [site] = find_window_attention_sites(trace.regions[0])
    assert site.unsupported == ("the relative position tables (query, key, value) have 5, 5, 5 rows; "
                                "rel_idx needs 2G-1 = 7 (G = 4)")
    plan = lowconv.convert(ShortTables(5, form), "sparse-attention-bf16", inputs).lowconv_plan
    assert [d.op for d in plan.decisions if d.fqn == site.fqn] == ["keep"]
    # 2G-1 rows or more (the op reads the first 2G-1) convert
    for rows in (7, 9):
        model = ShortTables(rows, form)
        [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
        assert site.unsupported is None
        converted = lowconv.convert(model, FLOAT32, inputs)
        assert converted.lowconv_plan.converted()
        with torch.no_grad():
            torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def test_window_site_the_kernel_cannot_run_on_cuda_is_kept_with_why():
    """head_dim 24 (not a power of two) and float64: the Triton kernel cannot run them. On the CPU
    the op runs the torch reference, which can: the sites convert there."""
    model = sptr.VarLengthMultiheadSA(48, 2, "w", 0.3).eval()
    feats, xyz, batch = scene()
    inputs = (torch.randn(len(xyz), 48), xyz, batch)
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    options = attention_calls.SparseAttentionOptions()
    site_problem = sparse_attention.SparseAttentionForms.site_problem
    assert site.info.head_dim == 24 and site_problem(site, options) is None  # a CPU model
    site.output_node = None  # no graph to say where it runs: taken as CUDA
    assert site_problem(site, options) == (
        "the window-attention kernel on CUDA needs head_dim a power of two >= 16 (got 24)")
    site.info.head_dim = 32
    assert site_problem(site, options) is None
    site.input.dtype = "float64"
    assert "computes in float32, float16 or bfloat16, not float64" in site_problem(site, options)
    assert site_problem(site, attention_calls.SparseAttentionOptions(dtype="float32")) is None
    converted = lowconv.convert(model, FLOAT32, inputs)
    assert converted.lowconv_plan.converted()


class Changed(nn.Module):
    """SpTr's contextual chain with one thing the op could not see changed: rel_idx edited in place,
    rel_idx of the index tensors swapped, xyz or q written in place between the steps, v with
    another head_dim."""

    def __init__(self, change):
        super().__init__()
        self.change = change
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(7, 3, 2, 16) * 0.5) for _ in range(3))

    def forward(self, q, k, v, xyz, batch):
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, _ = sptr.get_indices_params(xyz, batch, 0.5, False)
        first, second = (index_1, index_0) if self.change == "swapped" else (index_0, index_1)
        rel_idx = sptr.relative_position_index(xyz, first, second, 0.5, 0.125, 4)
        if self.change == "rel_idx":
            rel_idx[:, 2] = 3
        if self.change == "xyz":
            xyz.mul_(0.5)
        if self.change == "v":
            v = v[..., :8]
        tq, tk, tv = self.tables
        attn = sptr.dot_prod_with_idx_all(q, index_0, index_0_offsets, k, index_1, index_1_offsets, tq, tk,
                                          rel_idx, n_max)
        if self.change == "q":
            q.mul_(2.0)
        attn = sptr.scatter_softmax_csr(attn, index_0_offsets, dim=0)
        return sptr.attention_step2_with_rel_pos_value(attn, v, index_0, index_0_offsets, n_max, index_1,
                                                       index_1_offsets, tv if self.change != "v" else tv[..., :8],
                                                       rel_idx)


@pytest.mark.parametrize("change, why", [
    ("rel_idx", "relative_position_index is changed in place while the chain runs"),
    ("swapped", "relative_position_index(...) of other index tensors"),
    ("xyz", "xyz is changed in place while the chain runs"),
    ("q", "q is changed in place while the chain runs"),
    ("v", "v's (heads, head_dim) [2, 8] are not q's and k's [2, 16]"),
])
def test_a_chain_changed_where_the_op_cannot_see_is_kept_with_why(change, why):
    inputs = corner_scene()
    model = Changed(change)
    converted = lowconv.convert(model, FLOAT32, [t.clone() for t in inputs])
    [decision] = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert decision.op == "keep" and why in decision.reason, decision.reason
    with torch.no_grad():
        torch.testing.assert_close(converted(*[t.clone() for t in inputs]), model(*[t.clone() for t in inputs]))
