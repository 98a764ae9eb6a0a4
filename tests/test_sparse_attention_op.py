"""The attention kernel's torch reference and the `sparse_attention` op's modules, vs float64."""
import typing
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowconv
import lowconv.ops.attention_calls as calls
import lowconv.ops.functional_attention as fa
import lowconv.ops.mha_attention as mhaa
import lowconv.ops.sparse_attention as sa
from lowconv.ops.window_attention import SparseWindowAttention
from lowconv.errors import LowconvError
from lowconv.kernels.block_attention import attention_reference, block_layout, check_inputs
from lowconv.passes.mha import mha_info
from lowconv.recipe import parse_recipe
from lowconv.ops.registry import OPS
from lowconv.site import AttentionInfo, Site, TensorMeta

attention_op = sa.SparseAttentionForms  # the op's builder: site_problem, from_site, empty

# Relative L2 error bounds vs float64 for each compute dtype.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rel_error(x, ref):
    x, ref = x.double(), ref.double()
    assert not x.isnan().any()
    return ((x - ref).norm() / ref.norm()).item()


def softmax_attention64(q, k, v, bias, scale):
    """softmax(q k^T * scale + bias) v in float64, the definition; k, v repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    return torch.softmax(q @ k.transpose(-2, -1) * scale + bias, dim=-1) @ v


def random_masks(b, lq, lk):
    """A bool (b, 1, lq, lk) "keep" matrix with every row keeping at least one key."""
    keep = torch.rand(b, 1, lq, lk) > 0.4
    keep[..., 0] = True
    return keep


def as_bias(keep):
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("mask_kind", ["none", "additive", "keep", "drop"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_float64(mask_kind, causal, kv_heads, dtype):
    torch.manual_seed(0)
    b, h, lq, lk, d = 2, 4, 5, 7, 16
    q = torch.randn(b, h, lq, d)
    k, v = torch.randn(b, kv_heads, lk, d), torch.randn(b, kv_heads, lk, d)
    keep = random_masks(b, lq, lk)
    additive = torch.randn(b, 1, lq, lk).masked_fill(~keep, float("-inf"))
    mask = {"none": None, "additive": additive, "keep": keep, "drop": ~keep}[mask_kind]
    bias = {"none": torch.zeros(()), "additive": additive.double()}.get(mask_kind, as_bias(keep))
    if causal:
        bias = bias + as_bias(torch.ones(lq, lk, dtype=torch.bool).tril())
    out = attention_reference(q, k, v, mask, mask_kind=mask_kind, causal=causal, scale=0.3, dtype=dtype)
    assert out.dtype == dtype
    error = rel_error(out, softmax_attention64(q, k, v, bias, 0.3))
    assert error < TOLERANCE[dtype]
    if dtype != torch.float32:  # the compute dtype's rounding shows
        assert error > 1e-5


def test_probabilities_are_rounded_to_the_compute_dtype_before_pv():
    # One query, two keys, v = (100, -100): the output 100 (p0 - p1) shows p's rounding.
    q, k = torch.ones(1, 1, 1, 1), torch.tensor([0.0, 0.3]).view(1, 1, 2, 1)
    v = torch.tensor([100.0, -100.0]).view(1, 1, 2, 1)
    p = torch.softmax(k.bfloat16().float().view(2), 0)
    rounded = p.bfloat16().float()
    expected = (rounded[0] * 100 - rounded[1] * 100).bfloat16()
    assert expected != (p[0] * 100 - p[1] * 100).bfloat16()
    out = attention_reference(q, k, v, scale=1.0, dtype=torch.bfloat16)
    assert out.item() == expected.item()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = torch.randn(3, 1, 2, 4, 16).unbind(0)
    out = attention_reference(q, k, v)
    assert rel_error(out, softmax_attention64(q, k, v, 0.0, 16 ** -0.5)) < 1e-6


def test_gradients_match_float64():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    keep = random_masks(2, 6, 6)
    attention_reference(q, k, v, keep, mask_kind="keep", causal=True, scale=0.5).pow(2).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    bias = as_bias(keep) + as_bias(torch.ones(6, 6, dtype=torch.bool).tril())
    softmax_attention64(q64, k64, v64, bias, 0.5).pow(2).sum().backward()
    for t, t64 in ((q, q64), (k, k64), (v, v64)):
        assert rel_error(t.grad, t64.grad) < 1e-5


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    keep = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    keep[..., 1, :] = False
    out = attention_reference(q, k, v, keep, mask_kind="keep")
    out.sum().backward()
    assert torch.equal(out[..., 1, :], torch.zeros(1, 1, 4))
    assert out[..., 0, :].abs().sum() > 0
    assert all(t.grad.isfinite().all() for t in (q, k, v))


def test_dropout_keeps_the_expectation():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 1, 4, 8).unbind(0)
    many = [t.expand(20000, 1, 4, 8) for t in (q, k, v)]
    dropped = attention_reference(*many, dropout=0.3)
    plain = attention_reference(q, k, v)
    assert not torch.allclose(dropped[0], plain[0])
    assert (dropped.mean(0) - plain[0]).abs().max() < 0.02 * plain.abs().max()


@pytest.mark.parametrize("change, message", [
    (dict(q=torch.randn(2, 4, 8, dtype=torch.float64).to(torch.int64)), "floating-point"),
    (dict(q=torch.randn(5, 8)), r"\(\.\.\., heads, seq, head_dim\)"),
    (dict(k=torch.randn(1, 2, 7, 6), v=torch.randn(1, 2, 7, 6)), "shapes do not fit"),
    (dict(k=torch.randn(1, 3, 7, 8), v=torch.randn(1, 3, 7, 8)), "not a multiple"),
    (dict(mask_kind="additive"), "needs a mask"),
    (dict(mask=torch.zeros(5, 7), mask_kind="keep"), "must be bool"),
    (dict(mask=torch.zeros(5, 7, dtype=torch.bool), mask_kind="drop", q=torch.randn(1, 4, 6, 8)),
     "does not broadcast"),
    (dict(mask=torch.zeros(5, 7), mask_kind="sometimes"), "mask_kind must be one of"),
    (dict(dropout=1.0), "dropout"),
    (dict(dtype=torch.int8), "dtype"),
])
def test_check_inputs_rejects_bad_inputs(change, message):
    args = dict(q=torch.randn(1, 4, 5, 8), k=torch.randn(1, 2, 7, 8), v=torch.randn(1, 2, 7, 8))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=message):
        check_inputs(q, k, v, args.get("mask"), args.get("mask_kind", "none"), False, None,
                     args.get("dropout", 0.0), args.get("dtype"))


# ---- the op ----

def functional_site(**info) -> Site:
    return Site(kind="attention", fqn="blk.attention", region="", classes=["Block", "Module"],
                info=AttentionInfo(form="handwritten", **info),
                input=TensorMeta((2, 4, 5, 8), "float32"))


def test_op_is_registered_with_typed_options():
    op = OPS["sparse_attention"]
    assert op.kind == "attention" and op.options is calls.SparseAttentionOptions
    dtype = typing.get_type_hints(calls.SparseAttentionOptions)["dtype"]
    assert typing.get_args(dtype) == ("auto", "float32", "float16", "bfloat16")
    assert calls.SparseAttentionOptions().dtype == "auto"


@pytest.mark.parametrize("option, dtype", [
    ("auto", torch.float32), ("float32", torch.float32),
    ("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_functional_module_computes_in_the_chosen_dtype(option, dtype):
    torch.manual_seed(0)
    site = functional_site(mask="drop", causal=True, scale=0.25, dropout=0.1)
    options = calls.SparseAttentionOptions(dtype=option)
    module = attention_op.from_site(site, options, {}).eval()
    assert isinstance(module, fa.SparseAttention) and module.state_dict() == {}
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    drop = ~random_masks(2, 5, 5)
    out = module(q, k, v, drop)
    assert out.dtype == torch.float32
    bias = as_bias(~drop) + as_bias(torch.ones(5, 5, dtype=torch.bool).tril())
    error = rel_error(out, softmax_attention64(q, k, v, bias, 0.25))
    assert error < TOLERANCE[dtype]
    assert (error > 1e-5) == (dtype != torch.float32)
    rebuilt = attention_op.empty(site, options).eval()
    assert torch.equal(rebuilt(q, k, v, drop), out)


def test_functional_module_drops_only_in_training():
    module = attention_op.from_site(functional_site(dropout=0.5), calls.SparseAttentionOptions(), {})
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    assert not torch.equal(module.train()(q, k, v), module.eval()(q, k, v))
    assert torch.equal(module.eval()(q, k, v), module.eval()(q, k, v))


def test_functional_module_checks_its_mask():
    module = attention_op.from_site(functional_site(), calls.SparseAttentionOptions(), {})
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="takes no mask"):
        module(q, q, q, torch.zeros(3, 3))


# ---- nn.MultiheadAttention ----

E, HEADS, N, L, S = 16, 4, 3, 5, 7


def mha_site(mha: nn.MultiheadAttention) -> Site:
    return Site(kind="attention", fqn="mha", region="mha", classes=["MultiheadAttention", "Module"],
                info=mha_info(mha), input=TensorMeta((N, L, E), str(mha.out_proj.weight.dtype)[6:]),
                module_backed=True)


def mha_inputs(batch_first, kdim=E, vdim=E):
    def batch(x):
        return x if batch_first else x.transpose(0, 1)
    return (batch(torch.randn(N, L, E, dtype=torch.float64)),
            batch(torch.randn(N, S, kdim, dtype=torch.float64)),
            batch(torch.randn(N, S, vdim, dtype=torch.float64)))


def some_masks():
    """(key_padding_mask, attn_mask) pairs of each kind nn.MultiheadAttention takes."""
    padding = torch.rand(N, S) > 0.7
    padding[:, 0] = False
    banned = torch.rand(L, S) > 0.7
    banned[:, 1] = False
    return [
        (None, None),
        (padding, None),
        (torch.randn(N, S, dtype=torch.float64), None),
        (None, banned),
        (None, torch.randn(N * HEADS, L, S, dtype=torch.float64)),
        (padding, banned),
        (padding, torch.randn(L, S, dtype=torch.float64)),
    ]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", range(7))
def test_multihead_matches_torch_in_float64(batch_first, masks):
    torch.manual_seed(masks)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, dtype=torch.float64).eval()
    ours = attention_op.from_site(mha_site(mha), calls.SparseAttentionOptions(), mha.state_dict()).eval()
    assert isinstance(ours, mhaa.SparseMultiheadAttention)
    assert ours.state_dict().keys() == mha.state_dict().keys()
    key_padding_mask, attn_mask = some_masks()[masks]
    inputs = mha_inputs(batch_first)
    expected, _ = mha(*inputs, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    out, weights = ours(*inputs, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    assert weights is None
    assert rel_error(out, expected) < 1e-12


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_causal_unbatched_and_gradients(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, dtype=torch.float64).eval()
    ours = attention_op.from_site(mha_site(mha), calls.SparseAttentionOptions(), mha.state_dict()).eval()
    q, k, v = mha_inputs(batch_first)
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    expected, _ = mha(q, k, v, attn_mask=causal, is_causal=True, need_weights=False)
    out, _ = ours(q, k, v, attn_mask=causal, is_causal=True)
    assert rel_error(out, expected) < 1e-12
    one = (lambda x: x[0]) if batch_first else (lambda x: x[:, 0])
    assert rel_error(ours(one(q), one(k), one(v))[0], mha(one(q), one(k), one(v))[0]) < 1e-12

    mha(q, k, v)[0].pow(2).sum().backward()
    ours(q, k, v)[0].pow(2).sum().backward()
    for name, p in ours.named_parameters():
        assert rel_error(p.grad, mha.get_parameter(name).grad) < 1e-12


def test_multihead_separate_projections_without_bias():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, kdim=6, vdim=10, bias=False,
                                dtype=torch.float64).eval()
    ours = attention_op.from_site(mha_site(mha), calls.SparseAttentionOptions(), mha.state_dict()).eval()
    assert ours.state_dict().keys() == mha.state_dict().keys()
    inputs = mha_inputs(False, kdim=6, vdim=10)
    assert rel_error(ours(*inputs)[0], mha(*inputs)[0]) < 1e-12


@pytest.mark.parametrize("option", ["auto", "bfloat16"])
def test_multihead_from_site_equals_empty_then_load(option):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dropout=0.1).eval()
    site, options = mha_site(mha), calls.SparseAttentionOptions(dtype=option)
    built = attention_op.from_site(site, options, mha.state_dict()).eval()
    rebuilt = attention_op.empty(site, options)
    assert {k: (v.shape, v.dtype) for k, v in rebuilt.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in built.state_dict().items()}
    rebuilt.load_state_dict(built.state_dict())
    rebuilt.eval()
    inputs = [x.float() for x in mha_inputs(False)]
    assert torch.equal(rebuilt(*inputs)[0], built(*inputs)[0])
    error = rel_error(built(*inputs)[0], mha(*inputs)[0])
    assert error < 1e-5 if option == "auto" else 1e-4 < error < 2e-2


def test_check_needs_what_rebuilds_an_mha():
    site = mha_site(nn.MultiheadAttention(E, HEADS))
    assert attention_op.site_problem(site, calls.SparseAttentionOptions()) is None
    site.info.batch_first = None
    assert "batch_first" in attention_op.site_problem(site, calls.SparseAttentionOptions())


def test_window_module_names_tables_shorter_than_rel_idx_needs():
    """The kernel reads G off the tables' length and runs unchecked: tables of fewer than 2G-1 rows
    are refused from their shapes (on CUDA they would run with no error and give wrong output)."""
    from lowconv.compat import sptr

    xyz = torch.rand(40, 3) * 0.6
    batch = torch.zeros(40, dtype=torch.long)
    _, index_0_offsets, _, index_1, _, sort_idx = sptr.get_indices_params(xyz, batch, 0.3, False)
    q, k, v = torch.randn(3, 40, 2, 16).unbind(0)
    op = SparseWindowAttention()
    for rows in (9, 10):
        tables = tuple(torch.randn(rows, 3, 2, 16) for _ in range(3))
        with pytest.raises(ValueError, match=rf"tables \(query, key, value\) have {rows}, {rows}, {rows} rows; "
                                             rf"rel_idx needs 2G-1 = 11 \(G = quant_grid_length = 6\)"):
            op(q, k, v, index_0_offsets, index_1, xyz[sort_idx], 0.3, 0.05, 6, False, *tables)
    tables = tuple(torch.randn(13, 3, 2, 16, dtype=torch.float64) for _ in range(3))
    out = op(q, k, v, index_0_offsets, index_1, xyz[sort_idx], 0.3, 0.05, 6, False, *tables)
    assert out.dtype == torch.float32  # q's dtype: window_attention returns it
    assert torch.equal(out, op(q, k, v, index_0_offsets, index_1, xyz[sort_idx], 0.3, 0.05, 6, False,
                               *(t[:11] for t in tables)))


# ---- layouts: which tiles the kernels visit (kernels/block_attention.py) ----

def parse_options(options: str):
    recipe = parse_recipe(f'[[rules]]\nop = "sparse_attention"\noptions = {{ {options} }}', "r.toml")
    return recipe.rules[0].options


def test_layout_options_parse_with_their_defaults():
    assert (calls.SparseAttentionOptions().layout, calls.SparseAttentionOptions().window) == ("auto", None)
    options = parse_options('layout = "local", window = 256, dtype = "bfloat16"')
    assert (options.layout, options.window, options.dtype) == ("local", 256, "bfloat16")
    assert parse_options('layout = "mask"').layout == "mask"


@pytest.mark.parametrize("options, message", [
    ('layout = "sliding"', r"r.toml: rule 1: options.layout: got 'sliding'; expected one of 'auto', "
                           r"'dense', 'causal', 'local', 'mask'"),
    ('layout = "local"', r"options.window: is required with layout = \"local\""),
    ('layout = "local", window = 0', r"options.window: must be a whole number >= 1 \(got 0\)"),
    ('layout = "causal", window = 8', r"options.window: goes with layout = \"local\" only \(layout is 'causal'\)"),
    ('window = 8', r"options.window: goes with layout = \"local\" only \(layout is 'auto'\)"),
    ('layout = "local", window = 2.5', r"options.window: got 2.5; expected an integer \(or leave the key out\)"),
])
def test_bad_layout_options_name_the_option_and_the_choices(options, message):
    with pytest.raises(LowconvError, match=message):
        parse_options(options)


def test_check_keeps_sites_whose_semantics_a_layout_cannot_keep():
    def reason(layout, **info):
        return attention_op.site_problem(functional_site(**info), calls.SparseAttentionOptions(layout=layout))

    assert "attend to later keys" in reason("dense", causal=True)
    assert "needs a site that takes a mask" in reason("mask", causal=True)
    assert reason("mask", mask="keep") is None and reason("dense", mask="additive") is None
    assert reason("causal") is None  # made causal on purpose, as "local" makes it local
    window = Site(kind="attention", fqn="w", region="", classes=[], info=AttentionInfo(form="window"))
    assert "SpTr window chain" in attention_op.site_problem(window, calls.SparseAttentionOptions(layout="causal"))
    with pytest.raises(ValueError, match="attend to later keys"):
        fa.SparseAttention(causal=True, layout="dense")


@pytest.mark.parametrize("layout, window, message", [
    ("local", None, "window is required"), ("local", 0, "window must be a whole number"),
    ("local", True, "window must be a whole number"), ("causal", 4, "window goes with"),
    ("banded", None, "layout must be one of")])
def test_module_refuses_what_its_forward_would_not_check(layout, window, message):
    # forward calls block_attention with validate=False: the module checks its layout and window.
    with pytest.raises(ValueError, match=f"SparseAttention: {message}"):
        fa.SparseAttention(layout=layout, window=window)


def allowed_by_layout(layout, window, causal, seq_q, seq_k):
    """The keys the op's layouts let query i see, pair by pair (the module doc's definitions)."""
    def rule(i, j):
        if layout == "local":
            return 0 <= i - j < window if causal else abs(i - j) < window
        return j <= i if causal or layout == "causal" else True
    return torch.tensor([[rule(i, j) for j in range(seq_k)] for i in range(seq_q)])


def layout_case(layout, causal, mask_kind, seq=9, d=8, seed=0, backend="auto"):
    """A functional site's module, its (q, k, v, mask) and the float64 bias of what it computes."""
    torch.manual_seed(seed)
    window = 3 if layout == "local" else None
    q, k, v = (torch.randn(2, 2, seq, d, dtype=torch.float64) for _ in range(3))
    keep = random_masks(2, seq, seq)
    keep[..., :, :] |= torch.eye(seq, dtype=torch.bool)  # every row keeps a key in any layout
    mask = {"none": None, "keep": keep, "drop": ~keep,
            "additive": torch.randn(2, 1, seq, seq, dtype=torch.float64).masked_fill(~keep, float("-inf"))}[mask_kind]
    bias = {"none": torch.zeros(()), "additive": mask}.get(mask_kind, as_bias(keep))
    bias = bias + as_bias(allowed_by_layout(layout, window, causal, seq, seq))
    module = fa.SparseAttention(mask=mask_kind, causal=causal, scale=0.4, layout=layout, window=window,
                                backend=backend)
    return module.eval(), (q, k, v, mask), bias


LAYOUT_CASES = [("auto", False, "none"), ("auto", True, "none"), ("auto", True, "drop"),
                ("auto", False, "additive"), ("dense", False, "keep"), ("causal", False, "none"),
                ("causal", True, "additive"), ("local", False, "none"), ("local", True, "drop"),
                ("mask", False, "keep"), ("mask", True, "additive")]


@pytest.mark.parametrize("layout, causal, mask_kind", LAYOUT_CASES)
def test_each_layout_computes_what_it_says_in_float64(layout, causal, mask_kind):
    module, (q, k, v, mask), bias = layout_case(layout, causal, mask_kind)
    assert rel_error(module(q, k, v, mask), softmax_attention64(q, k, v, bias, 0.4)) < 1e-12


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The op's Triton path on CPU tensors: Triton's interpreter (conftest) runs the kernels."""
    if torch.cuda.is_available():
        pytest.skip("no interpreter where CUDA is: tests/test_block_attention_gpu.py runs the op's kernels")
    monkeypatch.setattr(calls, "runs_on_kernel_device", lambda q: True)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
@pytest.mark.parametrize("layout, causal, mask_kind", [("auto", True, "none"), ("mask", False, "drop"),
                                                       ("local", True, "additive"), ("dense", False, "keep")])
def test_each_layout_on_the_kernels_matches_float64_with_gradients(kernels_on_cpu, layout, causal, mask_kind,
                                                                   monkeypatch):
    module, (q, k, v, mask), bias = layout_case(layout, causal, mask_kind, seq=70, d=16, backend="triton")
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    ran = spy_on_kernels(monkeypatch)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape)
    outs = [module(q, k, v, mask), softmax_attention64(q64, k64, v64, bias, 0.4)]
    assert ran == ["triton"]
    for out in outs:
        out.backward(grad_out.to(out.dtype))
    assert rel_error(outs[0], outs[1]) < 1e-5
    for t, t64 in zip((q, k, v), (q64, k64, v64)):
        assert rel_error(t.grad, t64.grad) < 1e-5


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
@pytest.mark.parametrize("layout", ["auto", "dense"])
def test_multihead_attention_on_the_kernels_with_padding_and_a_mask(kernels_on_cpu, layout, monkeypatch):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 2, batch_first=True, dtype=torch.float64).eval()
    site = Site(kind="attention", fqn="mha", region="mha", classes=["MultiheadAttention"],
                info=mha_info(mha), input=TensorMeta((2, 70, 32), "float32"), module_backed=True)
    ours = attention_op.from_site(site, calls.SparseAttentionOptions(layout=layout, backend="triton"),
                        mha.state_dict()).float().eval()
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    padding = torch.arange(70)[None, :] >= torch.tensor([70, 20])[:, None]
    banned = torch.rand(70, 70) > 0.8
    banned.fill_diagonal_(False)
    expected = mha(x, x, x, key_padding_mask=padding, attn_mask=banned, need_weights=False)[0]
    ran = spy_on_kernels(monkeypatch)
    assert rel_error(ours(x.float(), x.float(), x.float(), key_padding_mask=padding, attn_mask=banned)[0],
                     expected) < 1e-5
    assert ran == ["triton"]


def spy_on_kernels(monkeypatch):
    """The backends the op's calls run ("triton", "sdpa" or "reference"), in order."""
    ran, real = [], calls.attend
    monkeypatch.setattr(calls, "attend", lambda q, k, v, plan, **kw: ran.append(plan.backend) or real(q, k, v, plan, **kw))
    return ran


def test_the_kernels_run_where_they_can_and_the_reference_elsewhere(kernels_on_cpu):
    q = torch.randn(1, 2, 4, 16)
    assert calls.kernel_runs(q, q, torch.bfloat16, 0.0)
    assert not calls.kernel_runs(q, q, torch.float64, 0.0)
    assert not calls.kernel_runs(torch.randn(1, 2, 4, 24), q, torch.float32, 0.0)  # head_dim
    assert not calls.kernel_runs(q, torch.randn(1, 2, 4, 32), torch.float32, 0.0)  # v's head_dim is not q's
    assert not calls.kernel_runs(q, q, torch.float32, 0.1)  # dropout in training: the reference draws it
    assert not calls.kernel_runs(q[0], q[0], torch.float32, 0.0)  # (heads, seq, head_dim)
    bias = torch.zeros(4, 4, requires_grad=True)  # a learned bias as the mask: its gradient
    assert not calls.kernel_runs(q, q, torch.float32, 0.0, (None, bias))
    with torch.no_grad():
        assert calls.kernel_runs(q, q, torch.float32, 0.0, (bias,))


def test_a_learned_mask_gets_its_gradient_after_a_call_without_grad():
    """A validation pass under no_grad must not leave a mask without autograd in the cache (the
    mask is a slice of a learned table, a new view on every call)."""
    table = torch.randn(1, 1, 12, 12, requires_grad=True)
    module = fa.SparseAttention(mask="additive").train()
    q = torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        module(q, q, q, table[:, :, :8, :8])
    (module(q, q, q, table[:, :, :8, :8]) * torch.randn(1, 2, 8, 16)).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_takes_the_causal_hint_as_torch_does(need_weights):
    """torch lets is_causal replace attn_mask only without key padding and without weights asked
    for; with need_weights it applies attn_mask (here causal and one more key banned)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 2, batch_first=True, dtype=torch.float64).eval()
    site = Site(kind="attention", fqn="mha", region="mha", classes=["MultiheadAttention"],
                info=mha_info(mha), input=TensorMeta((2, 6, 32), "float64"), module_backed=True)
    ours = attention_op.from_site(site, calls.SparseAttentionOptions(), mha.state_dict()).double().eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    banned = torch.ones(6, 6, dtype=torch.bool).triu(1)
    banned[4:, 0] = True
    expected = mha(x, x, x, attn_mask=banned, is_causal=True, need_weights=need_weights)[0]
    got = ours(x, x, x, attn_mask=banned, is_causal=True, need_weights=need_weights)[0]
    assert rel_error(got, expected) < 1e-12


def test_the_mask_cache_keeps_no_mask_alive():
    module = fa.SparseAttention(mask="additive", layout="mask").eval()
    q = torch.randn(1, 2, 8, 16)
    mask = torch.zeros(1, 1, 8, 8)
    module(q, q, q, mask)
    ref = weakref.ref(mask)
    del mask
    assert ref() is None


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_a_mask_layout_is_made_once_per_mask(kernels_on_cpu, monkeypatch):
    made = []
    monkeypatch.setattr(calls, "block_layout", lambda *a, **kw: made.append(1) or block_layout(*a, **kw))
    module = fa.SparseAttention(mask="additive", layout="mask").eval()
    q = torch.randn(1, 2, 8, 16)
    buffer = torch.zeros(1, 1, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))

    def call(mask):
        return module(q, q, q, mask)

    first = call(buffer[:, :, :8, :8])
    call(buffer[:, :, :8, :8])  # a new view of the same memory, unwritten: the same mask
    assert len(made) == 1
    buffer[..., 0, 1] = 0.0  # written in place: made again, and the output follows
    assert not torch.equal(call(buffer[:, :, :8, :8]), first) and len(made) == 2
    call(buffer[:, :, 1:9, 1:9])  # another part of it
    call(buffer[:, :, :8, :8].clone())  # another tensor
    assert len(made) == 4
    with torch.inference_mode():  # no version counter to trust: made on every call
        mask = buffer[:, :, :8, :8].clone()
        call(mask), call(mask)
    assert len(made) == 6


# ---- which backend a call runs on CUDA (simulated: kernels_on_cpu) ----

SEQ = 130  # three tiles of 64 each way, the last one partial


def spy_on_plans(monkeypatch):
    """(backend, masks in, tiles listed) of each call of the op, in order."""
    ran, real = [], calls.attend

    def spy(q, k, v, plan, **kw):
        ran.append((plan.backend, plan.masked, plan.blocks is not None))
        return real(q, k, v, plan, **kw)
    monkeypatch.setattr(calls, "attend", spy)
    return ran


def dispatch_masks():
    """Keep masks over SEQ x SEQ: everything; the causal band; holes in every tile; and holes plus
    key tile 0 out for query tiles 1 and 2 (whole tiles the kernels skip)."""
    gen = torch.Generator().manual_seed(3)
    holes = torch.rand(SEQ, SEQ, generator=gen) > 0.3
    holes.fill_diagonal_(True)
    tiled = holes.clone()
    tiled[64:, :64] = False
    return {"all": torch.ones(SEQ, SEQ, dtype=torch.bool), "causal": torch.ones(SEQ, SEQ, dtype=torch.bool).tril(),
            "holes": holes, "tiled": tiled}


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
@pytest.mark.parametrize("layout, causal, mask, backend, expected", [
    ("auto", False, None, "auto", ("sdpa", True, False)),  # dense band
    ("auto", True, None, "auto", ("sdpa", True, False)),  # causal band: SDPA's is_causal
    ("causal", False, None, "auto", ("sdpa", True, False)),
    ("local", True, None, "auto", ("triton", True, False)),  # the kernels visit the band's tiles only
    ("auto", False, "holes", "auto", ("sdpa", True, False)),  # no whole tile to skip: SDPA, the mask in
    ("auto", False, "tiled", "auto", ("triton", True, True)),  # whole tiles out: the kernels skip them
    ("mask", False, "tiled", "auto", ("triton", True, True)),
    ("dense", False, "tiled", "auto", ("sdpa", True, False)),  # "dense" visits every tile
    ("auto", True, "causal", "auto", ("sdpa", False, False)),  # nothing beyond the band: SDPA on it alone
    ("auto", False, "all", "auto", ("sdpa", False, False)),
    ("auto", True, "tiled", "auto", ("triton", True, True)),
    ("local", True, "holes", "sdpa", ("sdpa", True, False)),  # forced
    ("auto", True, None, "triton", ("triton", True, False)),
    ("auto", False, "holes", "triton", ("triton", True, True)),
])
def test_calls_run_sdpa_unless_the_kernels_skip_tiles(kernels_on_cpu, monkeypatch, layout, causal, mask, backend,
                                                      expected):
    torch.manual_seed(0)
    keep = None if mask is None else dispatch_masks()[mask]
    module = fa.SparseAttention(mask="none" if keep is None else "keep", causal=causal, scale=0.4, layout=layout,
                                window=5 if layout == "local" else None, backend=backend).eval()
    q, k, v = (torch.randn(1, 2, SEQ, 16, dtype=torch.float64) for _ in range(3))
    reference = fa.SparseAttention(mask=module.mask, causal=causal, scale=0.4, layout=layout, window=module.window)
    with monkeypatch.context() as off_the_kernels_device:  # the torch reference, not SDPA in float64
        off_the_kernels_device.setattr(calls, "runs_on_kernel_device", lambda q: False)
        want = reference(q, k, v, keep)
    ran = spy_on_plans(monkeypatch)
    got = module(*(t.float() for t in (q, k, v)), keep)
    assert ran == [expected]
    assert rel_error(got, want) < 1e-5


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_calls_the_kernels_cannot_run_take_sdpa_or_with_backend_triton_the_reference(kernels_on_cpu, monkeypatch):
    q = torch.randn(1, 2, 20, 24)  # head_dim 24: not one the kernels tile
    ran = spy_on_plans(monkeypatch)
    fa.SparseAttention(causal=True, layout="local", window=4)(q, q, q)
    fa.SparseAttention(causal=True, layout="local", window=4, backend="triton")(q, q, q)
    fa.SparseAttention(causal=True, dropout=0.5).train()(q[..., :16], q[..., :16], q[..., :16])  # dropout
    assert ran == [("sdpa", True, False), ("reference", True, False), ("sdpa", True, False)]


def test_off_cuda_every_backend_runs_the_reference(monkeypatch):
    q = torch.randn(1, 2, 20, 16)
    ran = spy_on_plans(monkeypatch)
    for backend in calls.BACKEND_CHOICES:
        fa.SparseAttention(causal=True, backend=backend)(q, q, q)
    assert ran == [("reference", True, False)] * 3


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_layers_share_what_their_mask_decides(kernels_on_cpu, monkeypatch):
    """Two layers, one mask: its BlockLayout made and read once; a new mask, once more."""
    made = []
    monkeypatch.setattr(calls, "block_layout", lambda *a, **kw: made.append(1) or block_layout(*a, **kw))
    layers = [fa.SparseAttention(mask="keep", scale=0.4).eval() for _ in range(2)]
    q = torch.randn(1, 2, SEQ, 16)
    mask = dispatch_masks()["tiled"]
    ran = spy_on_plans(monkeypatch)
    for layer in layers * 2:
        layer(q, q, q, mask)
    assert len(made) == 1 and ran == [("triton", True, True)] * 4
    layers[0](q, q, q, dispatch_masks()["holes"])
    assert len(made) == 2 and ran[-1] == ("sdpa", True, False)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_masked_calls_being_traced_run_sdpa_with_the_mask(kernels_on_cpu, monkeypatch):
    """Under torch.compile or CUDA graph capture the mask cannot be read: SDPA, the mask in."""
    monkeypatch.setattr(calls, "traced", lambda q: True)
    made = []
    monkeypatch.setattr(calls, "block_layout", lambda *a, **kw: made.append(1) or block_layout(*a, **kw))
    q = torch.randn(1, 2, SEQ, 16)
    ran = spy_on_plans(monkeypatch)
    fa.SparseAttention(mask="keep", causal=True)(q, q, q, dispatch_masks()["causal"])
    fa.SparseAttention(mask="keep", backend="triton")(q, q, q, dispatch_masks()["tiled"])  # made in the graph
    assert ran == [("sdpa", True, False), ("triton", True, True)] and len(made) == 1


def test_backend_options_parse_and_bad_ones_name_the_choices():
    assert calls.SparseAttentionOptions().backend == "auto"
    assert parse_options('backend = "sdpa"').backend == "sdpa"
    with pytest.raises(LowconvError, match=r"options.backend: got 'cuda'; expected one of 'auto', 'sdpa', 'triton'"):
        parse_options('backend = "cuda"')
    with pytest.raises(ValueError, match="SparseAttention: backend must be one of 'auto', 'sdpa', 'triton'"):
        fa.SparseAttention(backend="flash")
    window = Site(kind="attention", fqn="w", region="", classes=[], info=AttentionInfo(form="window"))
    assert 'backend "sdpa" is for ordinary attention sites' in attention_op.site_problem(window, calls.SparseAttentionOptions(backend="sdpa"))


# ---- layouts through lowconv.convert ----

class CausalBlock(nn.Module):
    """A GPT-like block: qkv projection, SDPA with is_causal=True, output projection."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(2))


def attention_recipe(options: str):
    return parse_recipe(f'[[rules]]\nkind = "attention"\nop = "sparse_attention"\noptions = {{ {options} }}')


@pytest.mark.parametrize("options, window", [("", None), ('layout = "local", window = 3', 3)])
def test_converted_causal_block_keeps_or_narrows_its_attention(options, window):
    torch.manual_seed(0)
    model = CausalBlock().double().eval()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    converted = lowconv.convert(model, attention_recipe(options), (x,))
    [decision] = converted.lowconv_plan.converted()
    assert decision.op == "sparse_attention" and decision.options.window == window
    keys = allowed_by_layout("local" if window else "causal", window, True, 10, 10)
    q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in model.qkv(x).chunk(3, -1))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
    expected = model.proj(expected.transpose(1, 2).flatten(2))
    assert rel_error(converted(x), expected) < 1e-12
    if window:  # the window changes what the model computes: visibly
        assert rel_error(converted(x), model(x)) > 1e-3


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)

    def forward(self, x, padding):
        return self.mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]


@pytest.mark.parametrize("layout", ["auto", "mask", "dense", "causal"])
def test_converted_multihead_attention_with_key_padding(layout):
    torch.manual_seed(0)
    model = PaddedEncoder().double().eval()
    x = torch.randn(N, S, E, dtype=torch.float64)
    padding = torch.arange(S)[None, :] >= torch.tensor([S, 4, 2])[:, None]  # ragged lengths
    converted = lowconv.convert(model, attention_recipe(f'layout = "{layout}"'), (x, padding))
    [decision] = converted.lowconv_plan.converted()
    assert decision.op == "sparse_attention"
    out = converted(x, padding)
    if layout == "causal":  # causal on top of the padding, on purpose
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        expected = model.mha(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]
        assert rel_error(out, model(x, padding)) > 1e-3
    else:
        expected = model(x, padding)
    assert rel_error(out, expected) < 1e-12


@pytest.mark.parametrize("options, says", [
    ("", "on CUDA: SDPA: a causal band, no tile to skip"),
    ('layout = "local", window = 3', "on CUDA: lowconv's Triton kernels: they visit only the tiles of the local band"),
    ('backend = "triton"', 'on CUDA: lowconv\'s Triton kernels (backend "triton"'),
    ('backend = "sdpa"', 'on CUDA: SDPA (backend "sdpa")'),
])
def test_plan_says_which_backend_a_site_runs(options, says):
    model = CausalBlock().eval()
    x = torch.randn(2, 10, 32)
    [decision] = lowconv.convert(model, attention_recipe(options), (x,)).lowconv_plan.converted()
    assert decision.note.startswith(says), decision.note


def test_plan_of_a_masked_site_says_the_mask_decides():
    model = PaddedEncoder().eval()
    x, padding = torch.randn(N, S, E), torch.arange(S)[None, :] >= torch.tensor([S, 4, 2])[:, None]
    [decision] = lowconv.convert(model, attention_recipe(""), (x, padding)).lowconv_plan.converted()
    assert decision.note.startswith("on CUDA: SDPA on a dense band, no tile to skip; calls with a mask or key "
                                    "padding, per mask: lowconv's Triton kernels where the mask rules out whole "
                                    "tiles"), decision.note
    site = functional_site(mask="keep", causal=True)
    assert attention_op.from_site(site, calls.SparseAttentionOptions(), {}).plan_note().startswith(
        "on CUDA: per mask, on a causal band: lowconv's Triton kernels where the mask rules out whole tiles")
