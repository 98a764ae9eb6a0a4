"""find_attention_sites on small models of each form, and each functional site replaced by the
`sparse_attention` op the way the rewrite will, checked against the original model in float64."""
import copy
import math
from dataclasses import asdict, dataclass
from typing import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import lowconv.ops.attention_calls as calls
import lowconv.ops.sparse_attention as sa
from lowconv.passes import trace, tracer
from lowconv.passes.shapes import propagate_shapes
from lowconv.passes.attention import find_attention_sites
from lowconv.passes.rewrite import relative, replace_in_graph
from lowconv.site import TensorMeta

B, T, H, D = 2, 6, 2, 8
C = H * D


class Attention(nn.Module):
    """Projects x to (B, H, T, D) q, k, v; `core` is the attention under test."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.scale = D ** -0.5

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(self.core(q, k, v, mask).transpose(1, 2).reshape(b, t, C))


class ViT(Attention):  # timm's Attention
    def __init__(self):
        super().__init__()
        self.attn_drop = nn.Dropout(0.1)

    def core(self, q, k, v, mask):
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = self.attn_drop(attn.softmax(dim=-1))
        return attn @ v


class PreScaled(Attention):
    def core(self, q, k, v, mask):
        q = q * self.scale
        return F.softmax(q @ k.transpose(2, 3), dim=-1) @ v


class PreScaledShared(Attention):  # the scaled q has another use: it is the site's input
    def core(self, q, k, v, mask):
        q = q * self.scale
        return torch.matmul(F.softmax(torch.matmul(q, k.mT), dim=-1), v) + q


class NanoGPT(Attention):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def core(self, q, k, v, mask):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), p=0.1, training=self.training)
        return att @ v


class NanoGPTStatic(NanoGPT):  # a constant slice: fx folds the mask into a constant tensor
    def core(self, q, k, v, mask):
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class Additive(Attention):
    def core(self, q, k, v, mask):
        scores = q @ k.transpose(-1, -2) / math.sqrt(D) + mask
        return torch.softmax(scores, -1) @ v


class MaskedFill(Attention):  # mask: True is masked out
    def core(self, q, k, v, mask):
        scores = (q @ k.permute(0, 1, 3, 2)) * self.scale
        return scores.masked_fill(mask, -1e9).softmax(-1) @ v


class Where(Attention):  # mask: True is masked out; where's condition keeps
    def core(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) * self.scale
        return torch.where(~mask, scores, float("-inf")).softmax(-1) @ v


class Float32Softmax(Attention):
    def core(self, q, k, v, mask):
        scores = (q @ k.transpose(-2, -1)) * self.scale
        return scores.float().softmax(-1).to(q.dtype) @ v


class Float32SoftmaxArg(Attention):
    def core(self, q, k, v, mask):
        scores = (q @ k.transpose(-2, -1)) * self.scale
        return F.softmax(scores, dim=-1, dtype=torch.float32).type_as(q) @ v


class SDPA(Attention):
    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


class SDPAMasked(Attention):  # an additive mask, positional
    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, mask)


class SDPABoolMask(Attention):  # mask: True is masked out; SDPA's bool mask keeps
    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)


class SDPABufferMask(Attention):
    def __init__(self, tril):
        super().__init__()
        keep = torch.ones(T, T, dtype=torch.bool).tril() if tril else torch.rand(T, T) > 0.3
        self.register_buffer("keep", keep.logical_or(torch.eye(T, dtype=torch.bool)))

    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)


class SDPACausal(Attention):
    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


class SDPAGQA(Attention):
    def core(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], scale=0.2, enable_gqa=True)


class SDPARepeatKV(Attention):  # Hugging Face's repeat_kv, and a read of the repeated k's shape
    def core(self, q, k, v, mask):
        k, v = (x[:, :1][:, :, None, :, :].expand(B, 1, H, T, D).reshape(B, H, T, D) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v)[:, :, :k.shape[2]]


class SDPARepeatKVLikeQ(Attention):  # reshaped to q.shape: only the reshape knows the sizes, so it stays
    def core(self, q, k, v, mask):
        k, v = (x[:, :1][:, :, None, :, :].expand(B, 1, H, T, D).reshape(q.shape) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v)[:, :, :k.shape[2]]


class TwoMasks(Attention):  # they fold into one additive mask
    def core(self, q, k, v, mask):
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf"))
        return (scores + mask.float()).softmax(-1) @ v


def x_only():
    return (torch.randn(B, T, C),)


def with_drop_mask():
    drop = torch.rand(B, 1, T, T) > 0.6
    drop[..., 0] = False  # every query keeps a key
    return torch.randn(B, T, C), drop


def with_additive_mask():
    x, drop = with_drop_mask()
    return x, torch.randn(B, 1, T, T).masked_fill(drop, float("-inf"))


@dataclass
class Case:
    model: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    info: dict  # the AttentionInfo fields that do not come from shapes
    nargs: int = 3
    kv_heads: int = H
    buffers: bool = False  # trace with buffers as proxies (nanoGPT slices one by a traced length)


HANDWRITTEN = dict(form="handwritten", scale=D ** -0.5, mask="none", causal=False, causal_from_mask=False,
                   finite_fill=False, dropout=0.0)
SDPA_INFO = dict(HANDWRITTEN, form="sdpa", scale=None)
CASES = {
    "vit": Case(ViT, x_only, dict(HANDWRITTEN, dropout=0.1)),
    "pre_scaled": Case(PreScaled, x_only, HANDWRITTEN),
    "pre_scaled_shared": Case(PreScaledShared, x_only, dict(HANDWRITTEN, scale=1.0)),
    # F.dropout(training=self.training) traces as training=False (eval): no dropout, as the graph has none
    "nanogpt": Case(NanoGPT, x_only, dict(HANDWRITTEN, scale=None, causal=True, causal_from_mask=True),
                    buffers=True),
    "nanogpt_static": Case(NanoGPTStatic, x_only, dict(HANDWRITTEN, causal=True, causal_from_mask=True)),
    "additive": Case(Additive, with_additive_mask, dict(HANDWRITTEN, mask="additive"), nargs=4),
    "masked_fill": Case(MaskedFill, with_drop_mask, dict(HANDWRITTEN, mask="drop", finite_fill=True), nargs=4),
    "where": Case(Where, with_drop_mask, dict(HANDWRITTEN, mask="keep"), nargs=4),
    "float32_softmax": Case(Float32Softmax, x_only, HANDWRITTEN),
    "float32_softmax_arg": Case(Float32SoftmaxArg, x_only, HANDWRITTEN),
    "sdpa": Case(SDPA, x_only, SDPA_INFO),
    "sdpa_additive": Case(SDPAMasked, with_additive_mask, dict(SDPA_INFO, mask="additive"),
                          nargs=4),
    "sdpa_bool": Case(SDPABoolMask, with_drop_mask, dict(SDPA_INFO, mask="keep"), nargs=4),
    "sdpa_tril_buffer": Case(lambda: SDPABufferMask(tril=True), x_only,
                             dict(SDPA_INFO, causal=True, causal_from_mask=True)),
    "sdpa_buffer_mask": Case(lambda: SDPABufferMask(tril=False), x_only,
                             dict(SDPA_INFO, mask="keep"), nargs=4),
    "sdpa_causal": Case(SDPACausal, x_only, dict(SDPA_INFO, scale=0.3, causal=True)),
    "sdpa_gqa": Case(SDPAGQA, x_only, dict(SDPA_INFO, scale=0.2), kv_heads=1),
    "sdpa_repeat_kv": Case(SDPARepeatKV, x_only, SDPA_INFO, kv_heads=1),
    "sdpa_repeat_kv_like_q": Case(SDPARepeatKVLikeQ, x_only, SDPA_INFO),
    "two_masks": Case(TwoMasks, with_drop_mask, dict(HANDWRITTEN, scale=1.0, mask="additive"), nargs=4),
}


class BufferProxyTracer(tracer.SiteTracer):
    """nanoGPT slices its mask buffer by a traced length: fx traces that only with buffers as
    proxies, which SiteTracer does not do (yet)."""

    proxy_buffer_attributes = True


def region_of(model, inputs, shapes, buffers=False) -> trace.Region:
    """The model's one region, traced as lowconv does, with shapes propagated or not."""
    if buffers:
        graph = fx.GraphModule(model, BufferProxyTracer().trace(model))
        region = trace.Region("", model, graph, example_args=inputs)
        if shapes:
            propagate_shapes(region)
        return region
    found = trace.trace_model(model, inputs) if shapes else trace.find_regions(model)
    [region] = found.regions
    return region


def replace_sites(region, sites, dtype) -> fx.GraphModule:
    """The rewrite's replace_in_graph: the op's module under site.fqn, what became dead dropped."""
    gm = region.graph
    replaced = {}
    for site in sites:
        module = sa.SparseAttentionForms.from_site(site, calls.SparseAttentionOptions(dtype=dtype), {})
        replace_in_graph(gm, site, relative(site.fqn, region), module, replaced)
    gm.graph.lint()
    gm.recompile()
    return gm.eval()


def float64_run(model, inputs):
    model64 = copy.deepcopy(model).double()
    inputs64 = [x.double() if x.is_floating_point() else x for x in inputs]
    inputs64[0].requires_grad_()
    out = model64(*inputs64)
    return out, model64, inputs64[0]


def rel_error(x, ref):
    assert not x.isnan().any()
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("shapes", [True, False], ids=["shapes", "no_shapes"])
@pytest.mark.parametrize("name", CASES)
def test_matcher_reads_the_attention(name, shapes):
    case = CASES[name]
    torch.manual_seed(0)
    model, inputs = case.model().eval(), case.inputs()
    [site] = find_attention_sites(region_of(model, inputs, shapes, case.buffers))
    assert site.unsupported is None
    expected = dict(case.info, heads=H if shapes else None, head_dim=D if shapes else None,
                    kv_heads=case.kv_heads if shapes else None, dtype=None)
    assert asdict(site.info) == pytest.approx(expected)
    assert (site.kind, site.fqn, site.region) == ("attention", "attention", "")
    assert site.classes == [c.__name__ for c in type(model).__mro__[:-1]]
    assert site.classes[-2:] == ["Attention", "Module"]
    assert len(site.args) == case.nargs and not site.module_backed
    assert not set(site.args) & set(site.nodes) and site.output_node in site.nodes
    meta = TensorMeta((B, H, T, D), "float32") if shapes else None
    assert (site.input, site.output) == (meta, meta)


@pytest.mark.parametrize("shapes", [True, False], ids=["shapes", "no_shapes"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 2e-6), ("float16", 1e-3),
                                              ("bfloat16", 8e-3)])
@pytest.mark.parametrize("name", CASES)
def test_replaced_site_computes_the_same_attention(name, dtype, tolerance, shapes):
    case = CASES[name]
    torch.manual_seed(0)
    model, inputs = case.model().eval(), case.inputs()
    expected, _, _ = float64_run(model, inputs)
    region = region_of(model, inputs, shapes, case.buffers)
    sites = find_attention_sites(region)
    gm = replace_sites(region, sites, dtype)
    assert not {s.output_node for s in sites} & set(gm.graph.nodes)
    error = rel_error(gm(*inputs), expected)
    assert error < tolerance
    if dtype != "float32":  # the op's dtype is what ran
        assert error > 1e-5


@pytest.mark.parametrize("name", CASES)
def test_replaced_site_passes_gradients(name):
    case = CASES[name]
    torch.manual_seed(0)
    model, inputs = case.model().eval(), case.inputs()
    region = region_of(model, inputs, False, case.buffers)
    gm = replace_sites(region, find_attention_sites(region), "float32")
    weight = torch.randn(B, T, C)
    x = inputs[0].clone().requires_grad_()
    (gm(x, *inputs[1:]) * weight).sum().backward()
    out64, model64, x64 = float64_run(model, inputs)
    (out64 * weight.double()).sum().backward()
    assert rel_error(x.grad, x64.grad) < 1e-5
    assert rel_error(model.qkv.weight.grad, model64.qkv.weight.grad) < 1e-5


# ---- naming, regions, nn.MultiheadAttention ----

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ViT(), ViT()])
        self.blocks[1].attention = nn.Identity()  # the name is taken there

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class TwoInOne(Attention):
    def core(self, q, k, v, mask):
        return (F.scaled_dot_product_attention(q, k, v)
                + F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_site_names_are_under_their_owner_and_free():
    stack = Stack().eval()
    sites = find_attention_sites(region_of(stack, x_only(), shapes=False))
    assert [(s.fqn, s.classes) for s in sites] == [
        ("blocks.0.attention", ["ViT", "Attention", "Module"]),
        ("blocks.1.attention_1", ["ViT", "Attention", "Module"])]
    two = find_attention_sites(region_of(TwoInOne(), x_only(), shapes=False))
    assert [(s.fqn, s.info.causal) for s in two] == [("attention", False), ("attention_1", True)]


class MHABlock(nn.Module):
    def __init__(self, batch_first, use_weights=False, **kwargs):
        super().__init__()
        self.mha = nn.MultiheadAttention(C, H, dropout=0.1, batch_first=batch_first, **kwargs)
        self.use_weights = use_weights

    def forward(self, x):
        out, weights = self.mha(x, x, x)
        return out + weights.sum() if self.use_weights else out


@pytest.mark.parametrize("shapes", [True, False], ids=["shapes", "no_shapes"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_is_a_module_backed_site(batch_first, shapes):
    x = torch.randn(B, T, C) if batch_first else torch.randn(T, B, C)
    region = region_of(MHABlock(batch_first), (x,), shapes)
    [site] = find_attention_sites(region)
    assert (site.fqn, site.region, site.classes) == ("mha", "", ["MultiheadAttention", "Module"])
    assert site.module_backed and site.args == () and site.nodes == []
    assert site.output_node.op == "call_module" and site.output_node.target == "mha"
    info = site.info
    assert (info.form, info.embed_dim, info.heads, info.head_dim) == ("mha", C, H, D)
    assert (info.batch_first, info.dropout, site.unsupported) == (batch_first, 0.1, None)
    meta = TensorMeta(tuple(x.shape), "float32") if shapes else None
    assert (site.input, site.output) == (meta, meta)


@pytest.mark.parametrize("block, reason", [
    (MHABlock(True, use_weights=True), "weights"),
    (MHABlock(True, add_bias_kv=True), "add_bias_kv"),
    (MHABlock(True, add_zero_attn=True), "add_zero_attn"),
])
def test_multihead_attention_that_cannot_be_converted_is_listed_with_why(block, reason):
    [site] = find_attention_sites(region_of(block, (torch.randn(B, T, C),), shapes=False))
    assert reason in site.unsupported


def test_multihead_attention_without_bias_is_rebuilt_from_its_site_alone():
    from lowconv.ops.attention_calls import SparseAttentionOptions
    from lowconv.ops.sparse_attention import SparseAttentionForms

    block = MHABlock(True, bias=False)
    [site] = find_attention_sites(region_of(block, (torch.randn(B, T, C),), shapes=True))
    assert site.unsupported is None and site.info.bias is False
    built = SparseAttentionForms.from_site(site, SparseAttentionOptions(), block.mha.state_dict()).eval()
    rebuilt = SparseAttentionForms.empty(site, SparseAttentionOptions()).eval()
    rebuilt.load_state_dict(built.state_dict())
    x = torch.randn(B, T, C)
    assert torch.equal(rebuilt(x, x, x)[0], built(x, x, x)[0])


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ViT()
        self.mha = nn.MultiheadAttention(C, H)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: the root does not trace, its children do
            x = -x
        return self.mha(self.attn(x), x, x)[0]


def test_regions_under_untraceable_code():
    model, x = Untraceable().eval(), torch.randn(T, B, C)
    sites = [s for r in trace.trace_model(model, x).regions for s in find_attention_sites(r)]
    assert [(s.fqn, s.region, s.module_backed) for s in sites] == [
        ("attn.attention", "attn", False), ("mha", "mha", True)]
    meta = TensorMeta((T, B, C), "float32")
    assert (sites[1].input, sites[1].output, sites[1].info.batch_first) == (meta, meta, False)


# ---- what is not attention, or not convertible ----

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(C, 4)

    def forward(self, x):
        probs = F.softmax(self.head(x), dim=-1)
        return probs @ torch.ones(4, 3)


class TensorScale(Attention):
    def __init__(self):
        super().__init__()
        self.register_buffer("learned_scale", torch.tensor(0.3))

    def core(self, q, k, v, mask):
        return ((q @ k.transpose(-2, -1)) * self.learned_scale).softmax(-1) @ v


class ShapeScaled(Attention):  # the head_dim from x's shape, not q's: no fold, and the reason says how
    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // H)
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


class InPlaceMask(Attention):
    def core(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1)
        scores.masked_fill_(mask, float("-inf"))
        return scores.softmax(-1) @ v


class TwoMasksScaledBetween(Attention):  # masks around a scaling are not folded
    def core(self, q, k, v, mask):
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf")) * self.scale
        return (scores + mask.float()).softmax(-1) @ v


class ScaledAdditiveMask(Attention):
    def core(self, q, k, v, mask):
        return ((q @ k.transpose(-2, -1) + mask) * self.scale).softmax(-1) @ v


def test_a_softmax_that_is_not_attention_is_no_site():
    assert find_attention_sites(region_of(Classifier(), x_only(), shapes=False)) == []


@pytest.mark.parametrize("model, inputs, reason", [
    (TensorScale, x_only, "scaled by a tensor (mul)"),
    (ShapeScaled, x_only, "computed from the shape of x (truediv), which lowconv folds only from q's or k's last size"),
    (InPlaceMask, with_drop_mask, "in-place"),
    (TwoMasksScaledBetween, with_drop_mask, "more than one attention mask"),
    (ScaledAdditiveMask, with_additive_mask, "scaled with the scores"),
])
def test_attention_that_cannot_be_converted_is_listed_with_why(model, inputs, reason):
    [site] = find_attention_sites(region_of(model(), inputs(), shapes=False))
    assert reason in site.unsupported


def test_sdpa_mask_kind_without_shapes():
    """With shapes the dtype decides; without, a mask is bool only where the graph shows it."""
    x, drop = with_drop_mask()
    [with_shapes] = find_attention_sites(region_of(SDPAMasked(), (x, drop), shapes=True))
    [without] = find_attention_sites(region_of(SDPAMasked(), (x, drop), shapes=False))
    assert (with_shapes.info.mask, without.info.mask) == ("keep", "additive")


class NanoGPTCross(NanoGPT):  # rows and columns sliced by lengths that only shapes show equal
    def core(self, q, k, v, mask):
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.bias[:, :, :q.size(-2), :k.size(-2)] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def test_a_causal_slice_of_unequal_lengths_needs_shapes():
    model, inputs = NanoGPTCross(), x_only()
    [with_shapes] = find_attention_sites(region_of(model, inputs, True, buffers=True))
    [without] = find_attention_sites(region_of(model, inputs, False, buffers=True))
    assert (with_shapes.info.causal, with_shapes.info.mask, len(with_shapes.args)) == \
        (True, "none", 3)
    assert (without.info.causal, without.info.mask, len(without.args)) == (False, "drop", 4)


def test_scale_from_the_head_dim_needs_shapes_unless_it_is_the_default():
    class HalfDefault(Attention):
        def core(self, q, k, v, mask):
            return ((q @ k.transpose(-2, -1)) * (0.5 / math.sqrt(q.size(-1)))).softmax(-1) @ v

    model, inputs = HalfDefault(), x_only()
    [without] = find_attention_sites(region_of(model, inputs, shapes=False))
    [with_shapes] = find_attention_sites(region_of(model, inputs, shapes=True))
    assert "trace with example inputs" in without.unsupported
    assert with_shapes.unsupported is None
    assert with_shapes.info.scale == pytest.approx(0.5 / math.sqrt(D))
    assert len(with_shapes.args) == 3


# ---- masks on reshaped scores (timm's Swin) ----

WINDOWS = 2  # B is (batch 1) x (2 windows)


class ShiftedWindows(Attention):
    """timm's Swin with fused attention off: a relative position bias, then each window's shift
    mask added to the scores viewed as (batch, windows, heads, T, T), and viewed back."""

    def __init__(self, back=True):
        super().__init__()
        self.bias_table = nn.Parameter(torch.randn(1, H, T, T))
        shift = torch.zeros(WINDOWS, T, T)
        shift[1, :T // 2, T // 2:] = shift[1, T // 2:, :T // 2] = -100.0
        self.register_buffer("shift", shift)
        self.back = back

    def core(self, q, k, v, mask):
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.bias_table
        windows = self.shift.shape[0]
        attn = attn.view(-1, windows, H, T, T) + self.shift.unsqueeze(1).unsqueeze(0)
        if self.back:
            return attn.view(-1, H, T, T).softmax(-1) @ v
        return (attn.view(-1, T, T).softmax(-1) @ v.reshape(-1, T, D)).view(B, H, T, D)


def test_masks_on_reshaped_scores_fold_into_one_mask():
    torch.manual_seed(0)
    model, inputs = ShiftedWindows().eval(), x_only()
    expected, _, _ = float64_run(model, inputs)
    region = region_of(model, inputs, shapes=True)
    [site] = find_attention_sites(region)
    assert site.unsupported is None and len(site.args) == 4
    assert (site.info.mask, site.info.scale, site.info.heads) == ("additive", D ** -0.5, H)
    with torch.no_grad():  # the graph the pass left computes what the model computes
        assert rel_error(region.graph(*inputs), model(*inputs)) < 1e-6
    error = rel_error(replace_sites(region, [site], "float32")(*inputs), expected)
    without_shift = ShiftedWindows().eval()
    without_shift.load_state_dict(model.state_dict())
    without_shift.shift.zero_()
    assert error < 2e-6 < rel_error(without_shift(*inputs), expected)


@pytest.mark.parametrize("back, shapes, reason", [
    (True, False, "trace with example inputs"),
    (False, True, "the softmax gets them in shape (4, 6, 6), not q @ k^T's (2, 2, 6, 6)"),
])
def test_masks_on_reshaped_scores_that_cannot_fold_say_why(back, shapes, reason):
    model = ShiftedWindows(back).eval()
    [site] = find_attention_sites(region_of(model, x_only(), shapes))
    assert "the scores are reshaped (view" in site.unsupported and reason in site.unsupported


# ---- Hugging Face's causal & padding mask ----

class SDPACausalPadding(Attention):
    """Hugging Face's sdpa_mask without a KV cache: (kv_idx <= q_idx) & padding[batch_idx, kv_idx],
    index ranges offset by `q_offset` and 0, expanded to the scores; mask: (B, T) bool, True attends."""

    def __init__(self, q_offset=0):
        super().__init__()
        self.q_offset = q_offset

    def core(self, q, k, v, mask):
        b, _, t, _ = q.shape
        q_idx = (torch.arange(t) + self.q_offset)[None, None, :, None]
        kv_idx = torch.arange(k.shape[2])[None, None, None, :]
        batch_idx = torch.arange(b)[:, None, None, None]
        allowed = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx).to(q.device)
        allowed = allowed & mask[batch_idx, kv_idx].to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.expand(b, -1, t, k.shape[2]))


def with_padding():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, T - 2:] = False
    return torch.randn(B, T, C), keep


@pytest.mark.parametrize("q_offset, shapes, causal", [(0, True, True), (0, False, False), (1, True, False)],
                         ids=["causal", "no_shapes", "offset"])
def test_a_causal_and_padding_mask_becomes_causal_and_the_padding(q_offset, shapes, causal):
    """Causal when the ranges start alike and shapes show they span the scores; else the mask as it is."""
    torch.manual_seed(0)
    model, inputs = SDPACausalPadding(q_offset).eval(), with_padding()
    expected, _, _ = float64_run(model, inputs)
    region = region_of(model, inputs, shapes)
    [site] = find_attention_sites(region)
    assert (site.unsupported, site.info.causal, site.info.mask, len(site.args)) == (None, causal, "keep", 4)
    padding_only = site.args[3].op == "call_method" and site.args[3].target == "to"  # padding[...].to(q.device)
    assert padding_only == causal
    unread_before = unread_computations(region.graph)
    converted = replace_sites(region, [site], "float32")
    assert rel_error(converted(*inputs), expected) < 2e-6
    assert unread_computations(converted) <= unread_before  # causal=True's index ranges went with the mask


def unread_computations(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method") and not n.users}
