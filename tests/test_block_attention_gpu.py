"""Block attention's Triton kernels on CUDA at real sizes, and the sparse_attention op running them
through a converted model, against float64 (run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch
import torch.nn.functional as F

import lowconv
import lowconv.ops.sparse_attention as sa
from lowconv.kernels.block_attention import block_attention, block_attention_reference
from tests.test_sparse_attention_op import CausalBlock, attention_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def rel_error(x, ref):
    x, ref = x.double(), ref.double()
    assert not x.isnan().any(), "NaN in the result"
    return ((x - ref).norm() / ref.norm()).item()


def random_inputs(batch, heads, kv_heads, seq, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, grad_out = (torch.randn(batch, heads, seq, d, generator=gen, device="cuda", dtype=torch.float64)
                   for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, d, generator=gen, device="cuda", dtype=torch.float64)
            for _ in range(2))
    return q, k, v, grad_out


def outputs_and_grads(fn, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))]


# Each (dtype, head_dim, banded or not) compiles three kernels: a few pairs, not all of them.
@pytest.mark.parametrize("dtype, d", [(torch.float16, 128), (torch.bfloat16, 64), (torch.float32, 64)])
@pytest.mark.parametrize("layout, window", [("dense", None), ("causal", None), ("causal_local", 256),
                                            ("local", 200)])
def test_layouts_at_real_sizes_with_gqa(layout, window, d, dtype):
    """Ragged seq (not a whole number of tiles), 8 query heads on 2 kv heads, forward and grads."""
    q, k, v, grad_out = random_inputs(2, 8, 2, 1000, d)
    got = outputs_and_grads(lambda *t: block_attention(*(x.to(dtype) for x in t), layout=layout,
                                                       window=window), q, k, v, grad_out)
    want = outputs_and_grads(lambda *t: block_attention_reference(*t, layout=layout, window=window),
                             q, k, v, grad_out)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(x, ref) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_mask_and_key_padding_at_real_sizes(dtype):
    """A per-batch additive mask with whole masked tiles, and ragged key padding."""
    q, k, v, grad_out = random_inputs(2, 4, 4, 900, 64, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    mask = torch.randn(2, 1, 900, 900, generator=gen, device="cuda", dtype=torch.float64)
    mask[:, :, :, 300:600] = float("-inf")
    padding = torch.arange(900, device="cuda")[None, :] >= torch.tensor([900, 500], device="cuda")[:, None]
    got = outputs_and_grads(lambda *t: block_attention(*(x.to(dtype) for x in t), mask=mask.float(),
                                                       key_padding_mask=padding), q, k, v, grad_out)
    want = outputs_and_grads(lambda *t: block_attention_reference(*t, mask=mask, key_padding_mask=padding),
                             q, k, v, grad_out)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(x, ref) < TOLERANCE[dtype], name


@pytest.mark.parametrize("options", ['dtype = "bfloat16"', 'dtype = "float16", layout = "local", window = 128'])
def test_converted_causal_model_runs_the_kernels_on_cuda(options, monkeypatch):
    torch.manual_seed(0)
    model = CausalBlock(dim=256, heads=4).cuda().eval()
    x = torch.randn(2, 600, 256, device="cuda")
    converted = lowconv.convert(model, attention_recipe(options), (x,))
    [decision] = converted.lowconv_plan.converted()
    assert decision.op == "sparse_attention", decision.reason
    ran = []
    monkeypatch.setattr(sa, "block_attention", lambda *a, **kw: ran.append(kw["backend"]) or
                        block_attention(*a, **kw))
    out = converted(x)
    assert ran == ["triton"]
    if "local" in options:
        keys = torch.ones(600, 600, dtype=torch.bool, device="cuda").tril() & \
            ~torch.ones(600, 600, dtype=torch.bool, device="cuda").tril(-128)
        q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in model.qkv(x).chunk(3, -1))
        expected = model.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).flatten(2))
    else:
        expected = model(x)
    assert rel_error(out, expected) < 1e-2
