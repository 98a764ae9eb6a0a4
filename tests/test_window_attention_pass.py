"""SpTr chains found in a traced model and rewritten to one fused window-attention call."""
import pytest
import torch
from torch import nn

import lowconv
from lowconv.compat import sptr
from lowconv.compat.sptr import attention_step1, attention_step2, get_indices_params, scatter_softmax_csr
from lowconv.model_file import load_model_file
from lowconv.passes.trace import trace_model
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.recipe import parse_recipe

SPTR_NODES = set(sptr.SPTR_OPS) | {sptr.relative_position_index}


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
