"""flash-attn's varlen calls (passes/varlen_attention.py, ops/varlen_attention.py), with a torch
stand-in for flash_attn (tests/flash_attn_stand_in.py): found as attention sites, converted onto
the window-attention kernels' reference path, equal to what the call computes; what the kernel
does not compute is kept with the reason."""
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import lowconv
from examples import serialized_attention
from lowconv.recipe import parse_recipe
from tests import flash_attn_stand_in
from tests.compiled import compile_recording, fallbacks

FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')
HEADS, HEAD_DIM = 2, 16


@pytest.fixture
def flash_attn(monkeypatch):
    return flash_attn_stand_in.installed(monkeypatch)


class VarlenCall(nn.Module):
    """A projection to q, k, v, then one varlen call in the form `form`, with `extra` arguments;
    `kv_heads` < HEADS: k and v keep their first kv_heads heads (grouped-query attention)."""

    def __init__(self, form: str, cu_seqlens_k=None, head_dim=HEAD_DIM, kv_heads=HEADS, **extra):
        super().__init__()
        self.form, self.extra, self.head_dim, self.kv_heads = form, extra, head_dim, kv_heads
        self.register_buffer("cu_seqlens_k", cu_seqlens_k)  # None: the queries' segments
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * head_dim)

    def forward(self, x, cu_seqlens):
        import flash_attn
        qkv = self.qkv(x).reshape(-1, 3, HEADS, self.head_dim)
        if self.form == "qkv":
            return flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 8, **self.extra)
        q, k, v = qkv.unbind(1)
        k, v = k[:, :self.kv_heads], v[:, :self.kv_heads]
        if self.form == "kv":
            return flash_attn.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_seqlens, cu_seqlens, 8, 8,
                                                              **self.extra)
        cu_seqlens_k = cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
        return flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens_k, 8, 8, **self.extra)


def inputs(dtype=torch.float32, cu_seqlens=(0, 3, 11, 11, 20)):
    torch.manual_seed(0)
    return torch.randn(20, HEADS * HEAD_DIM, dtype=dtype), torch.tensor(cu_seqlens, dtype=torch.int32)


@pytest.mark.parametrize("form", ["qkv", "kv", "q, k, v"])
def test_each_varlen_form_converts_to_what_the_call_computes(flash_attn, form):
    model = VarlenCall(form, softmax_scale=0.3)
    converted = lowconv.convert(model, FLOAT32, inputs())
    (decision,) = converted.lowconv_plan.converted()
    info = decision.site.info
    assert (info.form, info.heads, info.head_dim, info.scale) == ("varlen", HEADS, HEAD_DIM, 0.3)
    assert type(converted.get_submodule(decision.fqn)).__name__ == "VarlenAttention"
    torch.testing.assert_close(converted(*inputs()), model(*inputs()), rtol=1e-6, atol=1e-6)


def test_the_default_scale_is_flash_attns(flash_attn):
    model = VarlenCall("qkv")
    converted = lowconv.convert(model, FLOAT32, inputs())
    assert converted.lowconv_plan.converted()[0].site.info.scale is None
    torch.testing.assert_close(converted(*inputs()), model(*inputs()), rtol=1e-6, atol=1e-6)


def test_gradients_flow_through_the_converted_call(flash_attn):
    model = VarlenCall("qkv")
    converted = lowconv.convert(model, FLOAT32, inputs())
    x, cu_seqlens = inputs(torch.float64)
    model.double(), converted.double()
    for m in (model, converted):
        m(x, cu_seqlens).square().sum().backward()
    torch.testing.assert_close(converted.qkv.weight.grad, model.qkv.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra, reason", [
    ({"causal": True}, "a causal mask within each segment"),
    ({"dropout_p": 0.1}, "dropout (dropout_p = 0.1)"),
    ({"window_size": (4, 4)}, "sliding window"),
    ({"softcap": 30.0}, "softcapped scores"),
    ({"cu_seqlens_k": torch.tensor([0, 5, 11, 15, 20], dtype=torch.int32)}, "cu_seqlens_q is not cu_seqlens_k"),
    ({"head_dim": 24}, "head_dim a power of two >= 16 (got 24)"),
], ids=["causal", "dropout", "sliding window", "softcap", "cross segments", "head_dim 24"])
def test_what_the_window_kernel_does_not_compute_is_kept_with_the_reason(flash_attn, extra, reason):
    model = VarlenCall("q, k, v", **extra)
    converted = lowconv.convert(model, FLOAT32, inputs())
    assert not converted.lowconv_plan.converted()
    (decision,) = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert reason in (decision.site.unsupported or decision.reason)
    assert decision.site.info.causal == extra.get("causal", False)
    assert decision.site.info.dropout == extra.get("dropout_p", 0.0)
    torch.testing.assert_close(converted(*inputs()), model(*inputs()))


@pytest.mark.parametrize("form", ["kv", "q, k, v"])
def test_grouped_query_calls_convert(flash_attn, form):
    model = VarlenCall(form, kv_heads=1)
    converted = lowconv.convert(model, FLOAT32, inputs())
    (decision,) = converted.lowconv_plan.converted()
    assert (decision.site.info.heads, decision.site.info.kv_heads) == (HEADS, 1)
    assert "one window of the window-attention kernel" in decision.note
    torch.testing.assert_close(converted(*inputs()), model(*inputs()), rtol=1e-6, atol=1e-6)


def test_rows_past_the_last_segment_leave_the_others_as_they_were(flash_attn):
    model = VarlenCall("qkv")
    converted = lowconv.convert(model, FLOAT32, inputs())
    x, cu_seqlens = inputs(cu_seqlens=(0, 3, 11, 16))  # rows 16-19 in no segment (flash-attn leaves them unwritten)
    torch.testing.assert_close(converted(x, cu_seqlens)[:16], model(x, cu_seqlens)[:16], rtol=1e-6, atol=1e-6)


def test_cu_seqlens_past_the_rows_is_an_error_that_says_so(flash_attn):
    converted = lowconv.convert(VarlenCall("qkv"), FLOAT32, inputs())
    with pytest.raises(ValueError, match="non-decreasing"):
        converted(*inputs(cu_seqlens=(0, 3, 11, 24)))


def test_a_max_seqlen_passed_to_forward_is_a_warned_constant(flash_attn):
    class MaxSeqlenArgument(VarlenCall):
        def forward(self, x, cu_seqlens, max_seqlen):
            import flash_attn
            return flash_attn.flash_attn_varlen_qkvpacked_func(self.qkv(x).reshape(-1, 3, HEADS, HEAD_DIM),
                                                               cu_seqlens, max_seqlen)

    converted = lowconv.convert(MaxSeqlenArgument("qkv"), FLOAT32, (*inputs(), 8))
    assert any("max_seqlen=8" in w and "refuses calls with other values" in w
               for w in converted.lowconv_plan.warnings)


def test_ptv3s_flash_path_converts_within_fp16_rounding(flash_attn, monkeypatch):
    monkeypatch.setattr(serialized_attention, "flash_attn", flash_attn)
    torch.manual_seed(0)
    model = serialized_attention.SerializedNet(rel_pos=False, flash=True).eval()
    (points,) = serialized_attention.example_inputs()
    converted = lowconv.convert(model, FLOAT32, (points,))
    sites = converted.lowconv_plan.converted()
    assert [d.fqn for d in sites] == ["blocks.0.attn.attention", "blocks.1.attn.attention"]
    assert all(d.site.info.form == "varlen" and d.site.input.dtype == "float16" for d in sites)
    # The call's fp16 inputs, computed in fp32 by both: the outputs differ by fp16 rounding of their sums only.
    report = lowconv.compare(model, converted, (points,))
    assert report.outputs[0].metrics.sqnr_db > 60


def test_the_flash_path_needs_flash_attn(monkeypatch):
    monkeypatch.setattr(serialized_attention, "flash_attn", None)
    with pytest.raises(ImportError, match="flash-attn"):
        serialized_attention.SerializedNet(rel_pos=False, flash=True)


def test_the_converted_call_compiles_whole(flash_attn):
    converted = lowconv.convert(VarlenCall("qkv"), FLOAT32, inputs())
    counters.clear()
    compiled, graphs = compile_recording(converted)
    torch.testing.assert_close(compiled(*inputs()), converted(*inputs()))
    assert len(graphs) == 1 and not fallbacks()
