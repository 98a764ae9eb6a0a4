"""The attention kernel's torch reference and the `sparse_attention` op's modules, vs float64."""
import typing

import pytest
import torch
from torch import nn

import lowconv.ops.sparse_attention as sa
from lowconv.kernels.block_attention import attention, attention_reference
from lowconv.passes.mha import mha_info
from lowconv.ops.registry import OPS
from lowconv.site import AttentionInfo, Site, TensorMeta

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
    out = attention(q, k, v, mask, mask_kind=mask_kind, causal=causal, scale=0.3, dtype=dtype)
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
    out = attention(q, k, v, scale=1.0, dtype=torch.bfloat16)
    assert out.item() == expected.item()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = torch.randn(3, 1, 2, 4, 16).unbind(0)
    out = attention_reference(q, k, v)
    assert rel_error(out, softmax_attention64(q, k, v, 0.0, 16 ** -0.5)) < 1e-6


def test_gradients_match_float64():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    keep = random_masks(2, 6, 6)
    attention(q, k, v, keep, mask_kind="keep", causal=True, scale=0.5).pow(2).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    bias = as_bias(keep) + as_bias(torch.ones(6, 6, dtype=torch.bool).tril())
    softmax_attention64(q64, k64, v64, bias, 0.5).pow(2).sum().backward()
    for t, t64 in ((q, q64), (k, k64), (v, v64)):
        assert rel_error(t.grad, t64.grad) < 1e-5


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    keep = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    keep[..., 1, :] = False
    out = attention(q, k, v, keep, mask_kind="keep")
    out.sum().backward()
    assert torch.equal(out[..., 1, :], torch.zeros(1, 1, 4))
    assert out[..., 0, :].abs().sum() > 0
    assert all(t.grad.isfinite().all() for t in (q, k, v))


def test_dropout_keeps_the_expectation():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 1, 4, 8).unbind(0)
    many = [t.expand(20000, 1, 4, 8) for t in (q, k, v)]
    dropped = attention(*many, dropout=0.3)
    plain = attention(q, k, v)
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
def test_entry_point_rejects_bad_inputs(change, message):
    args = dict(q=torch.randn(1, 4, 5, 8), k=torch.randn(1, 2, 7, 8), v=torch.randn(1, 2, 7, 8))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, args.pop("mask", None), **args)


# ---- the op ----

def functional_site(**info) -> Site:
    return Site(kind="attention", fqn="blk.attention", region="", classes=["Block", "Module"],
                info=AttentionInfo(form="handwritten", **info),
                input=TensorMeta((2, 4, 5, 8), "float32"))


def test_op_is_registered_with_typed_options():
    op = OPS["sparse_attention"]
    assert op.kind == "attention" and op.options is sa.SparseAttentionOptions
    dtype = typing.get_type_hints(sa.SparseAttentionOptions)["dtype"]
    assert typing.get_args(dtype) == ("auto", "float32", "float16", "bfloat16")
    assert sa.SparseAttentionOptions().dtype == "auto"


@pytest.mark.parametrize("option, dtype", [
    ("auto", torch.float32), ("float32", torch.float32),
    ("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_functional_module_computes_in_the_chosen_dtype(option, dtype):
    torch.manual_seed(0)
    site = functional_site(mask="drop", causal=True, scale=0.25, dropout=0.1)
    options = sa.SparseAttentionOptions(dtype=option)
    module = sa.from_site(site, options, {}).eval()
    assert isinstance(module, sa.SparseAttention) and module.state_dict() == {}
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    drop = ~random_masks(2, 5, 5)
    out = module(q, k, v, drop)
    assert out.dtype == torch.float32
    bias = as_bias(~drop) + as_bias(torch.ones(5, 5, dtype=torch.bool).tril())
    error = rel_error(out, softmax_attention64(q, k, v, bias, 0.25))
    assert error < TOLERANCE[dtype]
    assert (error > 1e-5) == (dtype != torch.float32)
    rebuilt = sa.empty(site, options).eval()
    assert torch.equal(rebuilt(q, k, v, drop), out)


def test_functional_module_drops_only_in_training():
    module = sa.from_site(functional_site(dropout=0.5), sa.SparseAttentionOptions(), {})
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    assert not torch.equal(module.train()(q, k, v), module.eval()(q, k, v))
    assert torch.equal(module.eval()(q, k, v), module.eval()(q, k, v))


def test_functional_module_checks_its_mask():
    module = sa.from_site(functional_site(), sa.SparseAttentionOptions(), {})
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
    ours = sa.from_site(mha_site(mha), sa.SparseAttentionOptions(), mha.state_dict()).eval()
    assert isinstance(ours, sa.SparseMultiheadAttention)
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
    ours = sa.from_site(mha_site(mha), sa.SparseAttentionOptions(), mha.state_dict()).eval()
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
    ours = sa.from_site(mha_site(mha), sa.SparseAttentionOptions(), mha.state_dict()).eval()
    assert ours.state_dict().keys() == mha.state_dict().keys()
    inputs = mha_inputs(False, kdim=6, vdim=10)
    assert rel_error(ours(*inputs)[0], mha(*inputs)[0]) < 1e-12


@pytest.mark.parametrize("option", ["auto", "bfloat16"])
def test_multihead_from_site_equals_empty_then_load(option):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dropout=0.1).eval()
    site, options = mha_site(mha), sa.SparseAttentionOptions(dtype=option)
    built = sa.from_site(site, options, mha.state_dict()).eval()
    rebuilt = sa.empty(site, options)
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
    assert sa.check(site, sa.SparseAttentionOptions()) is None
    site.info.batch_first = None
    assert "batch_first" in sa.check(site, sa.SparseAttentionOptions())


def test_window_module_names_tables_shorter_than_rel_idx_needs():
    """The kernel reads G off the tables' length and runs unchecked: tables of fewer than 2G-1 rows
    are refused from their shapes (on CUDA they would run with no error and give wrong output)."""
    from lowconv.compat import sptr

    xyz = torch.rand(40, 3) * 0.6
    batch = torch.zeros(40, dtype=torch.long)
    _, index_0_offsets, _, index_1, _, sort_idx = sptr.get_indices_params(xyz, batch, 0.3, False)
    q, k, v = torch.randn(3, 40, 2, 16).unbind(0)
    op = sa.SparseWindowAttention()
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
