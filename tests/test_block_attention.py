"""Block-sparse attention: the torch reference against a float64 definition, and the Triton
kernels (run by Triton's interpreter on the CPU) against both, for every layout, masks, key
padding, GQA and each compute dtype, forward and gradients."""
import pytest
import torch

from lowconv.kernels import block_attention as block_attention_module
from lowconv.kernels.block_attention import (TILES, allows_whole_band, block_attention, block_attention_reference,
                                             block_attention_sdpa, block_layout, flash_takes, skips_tiles)

# On the CPU, the Triton kernels run in Triton's interpreter (switched on in conftest.py). Where
# CUDA is present (a GPU run collects this file too) the same tests run compiled, on CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter's loop over a loaded bound warns about numpy scalar conversion; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

# Relative L2 error bounds vs float64 for the compute dtype: forward and every gradient.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# Several tiles each way (TILES is 64 x 64), none of them whole at the end; cross attention.
SEQ_Q, SEQ_K = 150, 170
LAYOUTS = [("dense", None), ("causal", None), ("local", 40), ("causal_local", 40)]


def rel_error(x, ref):
    x, ref = x.double(), ref.double()
    assert not x.isnan().any(), "NaN in the result"
    return ((x - ref).norm() / ref.norm()).item()


def make_problem(batch=2, heads=4, kv_heads=2, seq_q=SEQ_Q, seq_k=SEQ_K, d=16, seed=0):
    """float64 q, k, v and a random output gradient."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    return (draw(batch, heads, seq_q, d), draw(batch, kv_heads, seq_k, d),
            draw(batch, kv_heads, seq_k, d), draw(batch, heads, seq_q, d))


def outputs_and_grads(fn, problem):
    """fn(q, k, v)'s output and the gradients of q, k, v, with the problem's output gradient."""
    q, k, v = (t.detach().requires_grad_() for t in problem[:3])
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), problem[3].to(out.dtype))]


def allowed_by_definition(layout, window, seq_q, seq_k):
    """The layouts as the module doc defines them, one pair at a time."""
    rule = {"dense": lambda i, j: True, "causal": lambda i, j: j <= i,
            "local": lambda i, j: abs(i - j) < window,
            "causal_local": lambda i, j: 0 <= i - j < window}[layout]
    return torch.tensor([[rule(i, j) for j in range(seq_k)] for i in range(seq_q)], device=DEVICE)


def definition64(q, k, v, allowed, scale, additive=None):
    """float64 softmax attention; rows with no allowed key give 0."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-2, -1) * scale
    if additive is not None:
        s = s + additive
    s = s.masked_fill(~allowed, float("-inf"))
    dead = ~allowed.any(-1, keepdim=True)
    return s.masked_fill(dead, 0).softmax(-1).masked_fill(dead, 0) @ v


def errors(fn, want_fn, problem):
    return [rel_error(x, ref) for x, ref in zip(outputs_and_grads(fn, problem),
                                                outputs_and_grads(want_fn, problem))]


def run(backend, dtype=torch.float32, **kwargs):
    return lambda q, k, v: block_attention(q, k, v, dtype=dtype, backend=backend, **kwargs)


@pytest.mark.parametrize("layout,window", LAYOUTS)
def test_reference_matches_the_definition(layout, window):
    problem = make_problem(seq_q=40, seq_k=50)
    allowed = allowed_by_definition(layout, window, 40, 50)
    got = errors(run("reference", torch.float64, layout=layout, window=window),
                 lambda q, k, v: definition64(q, k, v, allowed, 0.25), problem)
    assert max(got) < TOLERANCE[torch.float64], got


@pytest.mark.parametrize("layout,window", LAYOUTS)
def test_triton_float32_matches_float64(layout, window):
    problem = make_problem(seed=1)
    allowed = allowed_by_definition(layout, window, SEQ_Q, SEQ_K)
    got = errors(run("triton", layout=layout, window=window, scale=0.3),
                 lambda q, k, v: definition64(q, k, v, allowed, 0.3), problem)
    assert max(got) < TOLERANCE[torch.float32], got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout,window", [("causal", None), ("causal_local", 40)])
def test_triton_half_precision_matches_float64_like_the_reference(layout, window, dtype):
    """Within the dtype's tolerance, and within 3x the reference's own error (which rounds the
    same operands, but not dS as the kernels do): a kernel bug shows far above it."""
    problem = make_problem(seed=2)
    allowed = allowed_by_definition(layout, window, SEQ_Q, SEQ_K)

    def want(q, k, v):
        return definition64(q, k, v, allowed, 0.25)

    got = errors(run("triton", dtype, layout=layout, window=window), want, problem)
    reference = errors(run("reference", dtype, layout=layout, window=window), want, problem)
    assert max(got) < TOLERANCE[dtype], got
    assert all(e < 3 * r + 1e-6 for e, r in zip(got, reference)), (got, reference)


@pytest.mark.parametrize("kv_heads,d", [(1, 32), (4, 128)])
def test_triton_mqa_and_head_dims(kv_heads, d):
    problem = make_problem(kv_heads=kv_heads, d=d, seq_q=70, seq_k=90, seed=3)
    got = errors(run("triton", layout="causal"), run("reference", torch.float64, layout="causal"),
                 problem)
    assert max(got) < TOLERANCE[torch.float32], got


def test_output_keeps_the_input_dtype():
    q, k, v, _ = make_problem(seed=4)
    q, k, v = (t.float() for t in (q, k, v))
    got = block_attention(q, k, v, layout="causal", dtype=torch.float16, backend="triton")
    want = block_attention_reference(q, k, v, layout="causal", dtype=torch.float16)
    assert got.dtype == want.dtype == torch.float32
    assert rel_error(got, want) < 2e-3


def test_calls_without_gradients_give_the_autograd_path_bits():
    """Under no_grad (or with no input requiring grad) the forward kernel runs without the op's
    autograd (which would save tensors for the backward): the same output, and no graph."""
    q, k, v, _ = make_problem(seed=6)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    recorded = block_attention(q, k, v, layout="causal", backend="triton")

    def saved(t):
        pytest.fail("the op's autograd saved tensors")

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
        with torch.no_grad():
            unrecorded = block_attention(q, k, v, layout="causal", backend="triton")
        plain = block_attention(*(t.detach() for t in (q, k, v)), layout="causal", backend="triton")
    assert recorded.grad_fn is not None and unrecorded.grad_fn is None and plain.grad_fn is None
    assert torch.equal(unrecorded, recorded.detach()) and torch.equal(plain, recorded.detach())


def ragged_padding():
    """Batch 0 has all SEQ_K keys, batch 1 the first 64 (one whole tile): its other tiles
    are padding only."""
    padding = torch.zeros(2, SEQ_K, dtype=torch.bool, device=DEVICE)
    padding[1, 64:] = True
    return padding


@pytest.mark.parametrize("layout,window", [("dense", None), ("causal_local", 40)])
def test_triton_ragged_key_padding(layout, window):
    problem = make_problem(seed=5)
    padding = ragged_padding()
    allowed = allowed_by_definition(layout, window, SEQ_Q, SEQ_K) & ~padding[:, None, None, :]
    got = errors(run("triton", layout=layout, window=window, key_padding_mask=padding),
                 lambda q, k, v: definition64(q, k, v, allowed, 0.25), problem)
    assert max(got) < TOLERANCE[torch.float32], got


def test_triton_never_reads_tiles_of_padding_only():
    """NaN in the padding keys' k and v: a kernel that visited their tiles would spread it
    (0 * NaN in P V); the key padding's BlockLayout lists none of them."""
    q, k, v, grad_out = make_problem(seed=6)
    padding = ragged_padding()
    blocks = block_layout(SEQ_Q, SEQ_K, key_padding_mask=padding)
    assert blocks.count[1].max() == 1 and blocks.count[0].min() == 3
    poisoned = [t.clone() for t in (k, v)]
    for t in poisoned:
        t[1, :, 64:] = float("nan")
    got = outputs_and_grads(run("triton", key_padding_mask=padding), (q, *poisoned, grad_out))
    want = outputs_and_grads(run("reference", torch.float64, key_padding_mask=padding),
                             (q, k, v, grad_out))
    got[2], got[3] = got[2][:, :, :64], got[3][:, :, :64]  # the padding's own gradients aside
    want[2], want[3] = want[2][:, :, :64], want[3][:, :, :64]
    assert max(rel_error(x, ref) for x, ref in zip(got, want)) < TOLERANCE[torch.float32]


def mask_problem(kind, seed):
    """A mask broadcast over heads (batch, 1, Lq, Lk): random holes, the tiles of query tile 1
    by key tile 0 masked whole, and query rows 3 and 100 with no allowed key at all; bool (True
    attends) or additive (-inf out, finite values in)."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(2, 1, SEQ_Q, SEQ_K, generator=gen) > 0.3
    keep[:, :, 64:128, :64] = False
    keep[:, :, [3, 100]] = False
    keep = keep.to(DEVICE)
    if kind == "bool":
        return keep
    values = torch.randn(2, 1, SEQ_Q, SEQ_K, generator=gen, dtype=torch.float64).to(DEVICE)
    return values.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("layout,window", [("dense", None), ("causal", None)])
def test_triton_model_masks(kind, layout, window):
    problem = make_problem(seed=7)
    mask = mask_problem(kind, seed=8)
    allowed = allowed_by_definition(layout, window, SEQ_Q, SEQ_K)
    allowed = allowed & (mask if kind == "bool" else mask != float("-inf"))
    additive = None if kind == "bool" else mask.masked_fill(~allowed, 0)
    got = errors(run("triton", layout=layout, window=window, mask=mask),
                 lambda q, k, v: definition64(q, k, v, allowed, 0.25, additive), problem)
    assert max(got) < TOLERANCE[torch.float32], got


def test_triton_per_head_mask_with_gqa_and_padding():
    """A mask of its own per query head (each skipping other tiles) under key padding, an
    additive mask and a causal band: the listed tiles are found per head and batch."""
    problem = make_problem(seed=11)
    gen = torch.Generator().manual_seed(12)
    keep = torch.rand(1, 4, SEQ_Q, SEQ_K, generator=gen) > 0.2
    for head in range(4):
        keep[:, head, 64 * (head % 3):64 * (head % 3 + 1), 64 * (head % 2):64 * (head % 2 + 1)] = False
    keep = keep.to(DEVICE)
    mask = torch.randn(1, 4, SEQ_Q, SEQ_K, generator=gen).to(DEVICE).masked_fill(~keep, float("-inf"))
    padding = ragged_padding()
    kwargs = dict(layout="causal", mask=mask, key_padding_mask=padding)
    got = errors(run("triton", **kwargs), run("reference", torch.float64, **kwargs), problem)
    assert max(got) < TOLERANCE[torch.float32], got


def test_mask_block_layout_skips_whole_masked_tiles():
    mask = mask_problem("bool", seed=8)
    blocks = block_layout(SEQ_Q, SEQ_K, mask=mask)
    assert blocks.count.shape == (2, 1, 3)  # (batch, heads of the mask, query tiles)
    assert blocks.count[:, 0].tolist() == [[3, 2, 3]] * 2
    assert blocks.index[0, 0, 1, :2].tolist() == [1, 2]  # query tile 1 skips key tile 0
    assert blocks.count_t[:, 0].tolist() == [[2, 3, 3]] * 2
    causal = block_layout(SEQ_Q, SEQ_K, layout="causal", mask=mask)
    assert causal.count[0, 0].tolist() == [1, 1, 3]


def test_rows_with_no_allowed_key_give_zeros_and_no_gradient():
    """Everything masked: the reference's zeros, and zero gradients, not NaN; the same for the
    one row left without keys by a mask under the band."""
    problem = make_problem(seed=9)
    nothing = torch.zeros(SEQ_Q, SEQ_K, dtype=torch.bool, device=DEVICE)
    assert block_layout(SEQ_Q, SEQ_K, mask=nothing).count.sum() == 0
    for backend in ("triton", "reference"):
        for grad in outputs_and_grads(run(backend, mask=nothing), problem):
            assert torch.equal(grad, torch.zeros_like(grad))
    mask = torch.ones(SEQ_Q, SEQ_K, dtype=torch.bool, device=DEVICE)
    mask[0, 0] = False  # query 0's only causal key
    got = outputs_and_grads(run("triton", layout="causal", mask=mask), problem)
    want = outputs_and_grads(run("reference", torch.float64, layout="causal", mask=mask), problem)
    assert torch.equal(got[0][:, :, 0], torch.zeros_like(got[0][:, :, 0]))
    assert max(rel_error(x, ref) for x, ref in zip(got, want)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("seq_q, seq_k", [(5, 0), (0, 7)])
def test_no_key_or_no_query_gives_zeros(seq_q, seq_k):
    """SDPA's answer: zeros, and zero gradients (the kernels run no program: nothing they would
    have written may be left uninitialized)."""
    problem = make_problem(seq_q=seq_q, seq_k=seq_k)
    for backend in ("triton", "reference"):
        for out in outputs_and_grads(run(backend), problem):
            assert torch.equal(out, torch.zeros_like(out))


def test_finite_additive_mask_values_are_not_skipped():
    """torch.finfo.min masks nothing out: a row of it is a softmax over all its keys."""
    problem = make_problem(seed=10)
    mask = torch.zeros(SEQ_Q, SEQ_K, dtype=torch.float32, device=DEVICE)
    mask[5] = torch.finfo(torch.float32).min
    got = errors(run("triton", mask=mask), run("reference", torch.float64, mask=mask), problem)
    assert max(got) < TOLERANCE[torch.float32], got


@pytest.mark.parametrize("kwargs,message", [
    (dict(layout="banded"), "layout must be one of"),
    (dict(layout="local"), "needs a window"),
    (dict(layout="causal", window=8), "window goes with the local layouts"),
    (dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), "key_padding_mask must be"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_arguments_are_named(kwargs, message):
    q, k, v, _ = make_problem(seq_q=8, seq_k=8)
    with pytest.raises(ValueError, match=message):
        block_attention(q.cpu(), k.cpu(), v.cpu(), **kwargs)


def test_triton_rejects_head_dims_it_cannot_tile():
    q, k, v, _ = make_problem(d=24, seq_q=8, seq_k=8)
    with pytest.raises(ValueError, match="head_dim 16, 32, 64 or 128"):
        block_attention(q.float(), k.float(), v.float(), backend="triton")


def test_tiles_are_what_the_tests_assume():
    assert (TILES.block_m, TILES.block_n) == (64, 64)


SDPA_MASKS = ["none", "bool", "additive", "padding", "bool and padding"]


def sdpa_case_masks(masks):
    """block_attention's mask arguments for a case of SDPA_MASKS (the masks leave rows without keys)."""
    kwargs = {}
    if "bool" in masks or "additive" in masks:
        kwargs["mask"] = mask_problem("bool" if "bool" in masks else "additive", seed=8)
    if "padding" in masks:
        kwargs["key_padding_mask"] = ragged_padding()
    return kwargs


@pytest.mark.parametrize("masks", SDPA_MASKS)
@pytest.mark.parametrize("layout,window", LAYOUTS)
def test_sdpa_path_matches_the_reference_in_float64(layout, window, masks):
    """block_attention_sdpa: the band and the key padding folded into SDPA's mask (a causal band
    alone: its is_causal), GQA, rows with no allowed key: the reference's output and gradients."""
    kwargs = dict(layout=layout, window=window, **sdpa_case_masks(masks))
    got = errors(lambda q, k, v: block_attention_sdpa(q, k, v, scale=0.25, **kwargs),
                 run("reference", torch.float64, scale=0.25, **kwargs), make_problem(seed=13))
    assert max(got) < TOLERANCE[torch.float64], got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sdpa_path_computes_in_the_compute_dtype(dtype):
    """q, k, v rounded to the compute dtype, the output back in q's: float64's errors within the
    compute dtype's bound, forward and gradients (causal band, GQA)."""
    problem = make_problem(seed=14)
    got = errors(lambda q, k, v: block_attention_sdpa(q, k, v, layout="causal", dtype=dtype),
                 run("reference", torch.float64, layout="causal"), problem)
    assert max(got) < TOLERANCE[dtype], got
    q, k, v, _ = problem
    assert block_attention_sdpa(q.float(), k.float(), v.float(), dtype=dtype).dtype == torch.float32


@pytest.mark.parametrize("masks", ["none", "bool", "additive", "padding"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sdpa_path_runs_a_grouped_decode_step_without_repeating_the_cache(masks, dtype, monkeypatch):
    """One query per sequence on GQA's k and v with a mask (a decode step over a KV cache): each kv
    head's query heads run as rows of one SDPA call, k and v not repeated (the repeat copies the
    cache); the reference's output and gradients, a batch row with no allowed key zero."""
    keep = torch.rand(2, 1, 1, SEQ_K, generator=torch.Generator().manual_seed(31)) > 0.3
    keep[1] = False
    kwargs = {"none": {}, "bool": dict(mask=keep.to(DEVICE)), "padding": dict(key_padding_mask=~keep[:, 0, 0].to(DEVICE)),
              "additive": dict(mask=torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(DEVICE))}[masks]
    problem = make_problem(heads=8, kv_heads=2, seq_q=1, seed=32)
    want = outputs_and_grads(run("reference", torch.float64, **kwargs), problem)
    monkeypatch.setattr(block_attention_module, "repeat_kv", None)  # called: TypeError
    got = outputs_and_grads(lambda q, k, v: block_attention_sdpa(q, k, v, dtype=dtype, **kwargs), problem)
    assert max(map(rel_error, got, want)) < TOLERANCE[dtype]


def test_sdpa_path_takes_grouped_heads_only_where_flash_runs():
    """enable_gqa where SDPA's flash kernel serves the call; where it does not, SDPA's math kernel
    would take over: k and v are repeated for its efficient kernel instead."""
    q, k, v = torch.zeros(2, 8, 16, 64), torch.zeros(2, 2, 16, 64), torch.zeros(2, 2, 16, 64)
    half = [t.bfloat16() for t in (q, k, v)]
    assert flash_takes(*half, None, causal=True)
    assert not flash_takes(*half, torch.ones(16, 16, dtype=torch.bool), causal=False)  # a mask
    assert not flash_takes(q, k, v, None, causal=False)  # float32
    assert not flash_takes(half[0][:, :, :8], *half[1:], None, causal=True)  # causal, 8 queries on 16 keys
    assert not flash_takes(*(t[..., :12] for t in half), None, causal=False)  # head_dim 12


def test_masks_the_band_alone_computes_and_tiles_a_layout_skips():
    causal = torch.ones(SEQ_Q, SEQ_K, dtype=torch.bool, device=DEVICE).tril()
    additive_causal = torch.zeros(SEQ_Q, SEQ_K, device=DEVICE).masked_fill(~causal, float("-inf"))
    padding = ragged_padding()
    assert allows_whole_band(causal, None, "causal", None, SEQ_Q, SEQ_K)  # nothing beyond the causal band
    assert allows_whole_band(additive_causal, None, "causal", None, SEQ_Q, SEQ_K)
    assert not allows_whole_band(causal, None, "dense", None, SEQ_Q, SEQ_K)
    assert not allows_whole_band(additive_causal + 0.5, None, "causal", None, SEQ_Q, SEQ_K)  # adds to scores
    assert allows_whole_band(None, torch.zeros_like(padding), "dense", None, SEQ_Q, SEQ_K)
    assert not allows_whole_band(causal, padding, "causal", None, SEQ_Q, SEQ_K)

    def skips(mask, layout="dense", key_padding_mask=None):
        blocks = block_layout(SEQ_Q, SEQ_K, layout=layout, mask=mask, key_padding_mask=key_padding_mask)
        return bool(skips_tiles(blocks, layout, None, SEQ_Q, SEQ_K))

    assert skips(causal) and not skips(causal, "causal")  # the causal band skips them already
    assert skips(mask_problem("bool", seed=8))  # query tile 1 by key tile 0
    holes = torch.rand(SEQ_Q, SEQ_K, device=DEVICE) > 0.3
    assert not skips(holes)
    assert skips(None, key_padding_mask=padding)  # batch 1's padding-only tiles
