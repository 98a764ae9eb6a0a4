"""nn.MultiheadAttention expanded so that linear rules reach its projections (passes/mha_expand.py)."""
import copy

import pytest
import torch
from torch import nn

import lowconv
from lowconv.passes.mha_expand import ExpandedMultiheadAttention, expand_mha, mha_to_expand
from lowconv.recipe import parse_recipe, would_convert

CALLS = {
    "self": {},
    "need weights": dict(need_weights=True),
    "weights per head": dict(need_weights=True, average_attn_weights=False),
    "bool mask": dict(attn_mask="bool"),
    "float mask per head": dict(attn_mask="float3d"),
    "padding": dict(key_padding_mask="bool"),
    "float padding, mask, weights": dict(key_padding_mask="float", attn_mask="bool", need_weights=True),
    "causal hint": dict(attn_mask="causal", is_causal=True),
    "causal hint with padding": dict(attn_mask="causal", is_causal=True, key_padding_mask="bool"),
    "cross": dict(cross=True),
    "cross, k and v of their own width": dict(cross=True, kdim=12),
}


def call_arguments(case: dict, batched: bool, batch_first: bool, heads: int):
    gen = torch.Generator().manual_seed(1)
    n, seq_q, seq_k, embed = 3, 5, 7 if case.get("cross") else 5, 16
    shape = lambda seq: ((n, seq, embed) if batch_first else (seq, n, embed)) if batched else (seq, embed)
    query = torch.randn(shape(seq_q), generator=gen, dtype=torch.float64)
    key = torch.randn(shape(seq_k), generator=gen, dtype=torch.float64) if case.get("cross") else query
    kwargs = {k: v for k, v in case.items() if k in ("need_weights", "average_attn_weights", "is_causal")}
    kwargs.setdefault("need_weights", False)
    mask = case.get("attn_mask")
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(seq_q, seq_k, generator=gen) > 0.7
    elif mask == "float3d":
        kwargs["attn_mask"] = torch.randn((n * heads if batched else heads), seq_q, seq_k, generator=gen,
                                          dtype=torch.float64)
    elif mask == "causal":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(seq_q, dtype=torch.float64)
    padding = case.get("key_padding_mask")
    if padding:
        keys = torch.arange(seq_k) >= torch.tensor([seq_k, 3, 4][:n if batched else 1])[:, None]
        keys = keys if batched else keys[0]
        kwargs["key_padding_mask"] = keys if padding == "bool" else torch.zeros(keys.shape, dtype=torch.float64
                                                                               ).masked_fill(keys, -1e4)
    return (query, key, key), kwargs


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("case", list(CALLS))
def test_the_expansion_computes_what_nn_multihead_attention_does(case, batched, batch_first):
    """float64, with grad on (torch's unfused path): output and attention weights to rounding."""
    kdim = CALLS[case].get("kdim")
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim, dtype=torch.float64).eval()
    expanded = ExpandedMultiheadAttention(copy.deepcopy(mha))
    args, kwargs = call_arguments(CALLS[case], batched, batch_first, 4)
    if kdim is not None:
        args = (args[0], args[1][..., :kdim].contiguous(), args[1][..., :kdim].contiguous())
    want, got = mha(*args, **kwargs), expanded(*args, **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_the_expansion_holds_the_same_parameters():
    mha = nn.MultiheadAttention(16, 4)
    expanded = ExpandedMultiheadAttention(mha)
    assert expanded.in_proj.weight is mha.in_proj_weight and expanded.in_proj.bias is mha.in_proj_bias
    assert expanded.out_proj is mha.out_proj and expanded.in_proj_bias is mha.in_proj_bias


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        y = self.norm(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


def blocks():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).eval(), torch.randn(2, 10, 32)


def test_fp8_converts_the_projections_and_saves_and_loads_them(tmp_path):
    model, x = blocks()
    converted = lowconv.convert(model, "fp8-row", (x,))
    plan = converted.lowconv_plan
    assert plan.expanded_mha == ["0.attn", "1.attn"]
    ops = {d.fqn: d.op for d in plan.decisions}
    assert all(ops[f"{i}.attn.{p}"] == "fp8" for i in (0, 1) for p in ("in_proj", "out_proj"))
    assert ops["0.attn.attention"] == "keep"  # the attention itself: no rule for it
    lowconv.save(converted, tmp_path)
    again = lowconv.load(model, tmp_path, (x,))
    with torch.no_grad():
        assert torch.equal(again(x), converted(x))
    report = lowconv.compare(model, converted, (x,))
    assert report.passed and {"0.attn.in_proj", "1.attn.out_proj"} <= {s.fqn for s in report.sites}


def test_mixed_converts_projections_and_attention_of_the_expansion():
    model, x = blocks()
    ops = {d.fqn: d.op for d in lowconv.convert(model, "mixed", (x,)).lowconv_plan.decisions}
    assert ops["0.attn.in_proj"] == ops["0.attn.out_proj"] == "fp8"
    assert ops["0.mlp.0"] == "semi_sparse" and ops["0.attn.attention"] == "sparse_attention"


@pytest.mark.parametrize("recipe", ["sparse-attention-bf16", "semi-sparse"])
def test_recipes_that_leave_the_projections_leave_the_module(recipe):
    """No linear rule converts in_proj or out_proj: nn.MultiheadAttention stays as it is."""
    model, x = blocks()
    plan = lowconv.convert(model, recipe, (x,)).lowconv_plan
    assert plan.expanded_mha == []
    assert "0.attn.in_proj" not in {d.fqn for d in plan.decisions}


def test_a_rule_that_keeps_the_projections_leaves_the_module():
    model, _ = blocks()
    recipe = parse_recipe("name = 'x'\n[[rules]]\nkind = 'linear'\nmodules = ['re:.*attn.*']\nop = 'keep'\n"
                         "[[rules]]\nkind = 'linear'\nop = 'fp8'\n")
    assert mha_to_expand(model, lambda site: would_convert(site, recipe.rules)) == []


def test_hooked_or_unsupported_modules_are_not_expanded():
    model, _ = blocks()
    model[0].attn.register_forward_hook(lambda *a: None)
    model[1].attn = nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)
    assert mha_to_expand(model, lambda site: True) == []


def test_expanding_what_is_not_an_mha_says_so():
    model, _ = blocks()
    with pytest.raises(ValueError, match="0.norm is a LayerNorm"):
        expand_mha(model, ["0.norm"])


def test_the_converted_model_compiles_whole():
    model, x = blocks()
    converted = lowconv.convert(model, "fp8-row", (x,))
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), converted(x))


class DefaultCall(nn.Module):
    """`out, _ = mha(x, x, x)`: need_weights left at True, no mask, the weights dropped."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        out, _ = self.mha(x, x, x)
        return out


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x, memory):
        return self.mha(x, memory, memory, need_weights=False)[0]


@pytest.mark.parametrize("model, inputs, in_proj", [
    (DefaultCall, (torch.randn(2, 10, 32),), "fp8"),
    (CrossAttention, (torch.randn(2, 7, 32), torch.randn(2, 10, 32)), "keep"),
])
def test_converted_calls_save_and_load_without_example_inputs(tmp_path, model, inputs, in_proj):
    torch.manual_seed(0)
    model = model().eval()
    converted = lowconv.convert(model, "fp8-row", inputs)
    decisions = {d.fqn: d for d in converted.lowconv_plan.decisions}
    assert decisions["mha.out_proj"].op == "fp8" and decisions["mha.in_proj"].op == in_proj
    if in_proj == "keep":  # cross-attention projects with slices of in_proj's weight: said, not silent
        assert "query is not its key and value" in decisions["mha.in_proj"].reason
    lowconv.save(converted, tmp_path)
    with torch.no_grad():
        assert torch.equal(lowconv.load(model, tmp_path)(*inputs), converted(*inputs))
        want = model(*inputs)
        assert (converted(*inputs) - want).norm() / want.norm() < 0.1


def test_a_decoder_layer_inside_a_model_is_traced_into():
    """fx keeps torch.nn's modules as calls; a decoder layer's self-attention must be one graph
    with the layer, so that its q, k and v are one tensor and in_proj converts."""
    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

        def forward(self, tgt, memory):
            return self.layer(tgt, memory)

    inputs = (torch.randn(2, 5, 32), torch.randn(2, 7, 32))
    ops = {d.fqn: d.op for d in lowconv.convert(Wrap().eval(), "fp8-row", inputs).lowconv_plan.decisions}
    assert ops["layer.self_attn.in_proj"] == "fp8" and ops["layer.multihead_attn.in_proj"] == "keep"
    assert ops["layer.linear1"] == ops["layer.multihead_attn.out_proj"] == "fp8"
