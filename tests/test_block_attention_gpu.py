"""Block attention's Triton kernels on CUDA at real sizes, and the sparse_attention op running them
through a converted model, against float64 (run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch
import torch.nn.functional as F

import lowconv
from lowconv.kernels.block_attention import block_attention, block_attention_reference
from tests.test_block_attention import TOLERANCE, make_problem, outputs_and_grads, rel_error
from tests.test_sparse_attention_op import CausalBlock, allowed_by_layout, attention_recipe, spy_on_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# Each (dtype, head_dim, banded or not) compiles three kernels: a few pairs, not all of them.
@pytest.mark.parametrize("dtype, d", [(torch.float16, 128), (torch.bfloat16, 64), (torch.float32, 64)])
@pytest.mark.parametrize("layout, window", [("dense", None), ("causal", None), ("causal_local", 256),
                                            ("local", 200)])
def test_layouts_at_real_sizes_with_gqa(layout, window, d, dtype):
    """Ragged seq (not a whole number of tiles), 8 query heads on 2 kv heads, forward and grads."""
    problem = make_problem(2, 8, 2, 1000, 1000, d)
    got = outputs_and_grads(lambda *t: block_attention(*(x.to(dtype) for x in t), layout=layout,
                                                       window=window), problem)
    want = outputs_and_grads(lambda *t: block_attention_reference(*t, layout=layout, window=window), problem)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(x, ref) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_mask_and_key_padding_at_real_sizes(dtype):
    """A per-batch additive mask with whole masked tiles, and ragged key padding."""
    problem = make_problem(2, 4, 4, 900, 900, 64, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    mask = torch.randn(2, 1, 900, 900, generator=gen, device="cuda", dtype=torch.float64)
    mask[:, :, :, 300:600] = float("-inf")
    padding = torch.arange(900, device="cuda")[None, :] >= torch.tensor([900, 500], device="cuda")[:, None]
    got = outputs_and_grads(lambda *t: block_attention(*(x.to(dtype) for x in t), mask=mask.float(),
                                                       key_padding_mask=padding), problem)
    want = outputs_and_grads(lambda *t: block_attention_reference(*t, mask=mask, key_padding_mask=padding),
                             problem)
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
    ran = spy_on_kernels(monkeypatch)
    out = converted(x)
    assert ran == ["triton" if "local" in options else "sdpa"]  # a causal band alone: SDPA's flash kernel
    if "local" in options:
        keys = allowed_by_layout("local", 128, True, 600, 600).cuda()
        q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in model.qkv(x).chunk(3, -1))
        expected = model.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).flatten(2))
    else:
        expected = model(x)
    assert rel_error(out, expected) < 1e-2
