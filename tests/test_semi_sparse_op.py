import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lowconv.errors import LowconvError
from lowconv.kernels.pack24 import kept_codes, mask_codes, pack_kept_reference
from lowconv.kernels.sparse24 import (
    compress_bitmask, decompress_bitmask, kept_to_dense, mask_24, mask_24_transposable, prune_24,
)
from lowconv.ops.semi_sparse import (
    CompressedSemiSparseLinear, MaskedSemiSparseLinear, RuntimeSemiSparseLinear, SemiSparse, SemiSparseOptions,
)
from tests.compiled import assert_same_run, compile_recording, run_with_grads
from tests.sites import linear_site

from_site, empty, site_problem = SemiSparse.from_site, SemiSparse.empty, SemiSparse.site_problem


def assert_24(w):
    groups = w.reshape(*w.shape[:-1], -1, 4)
    assert ((groups != 0).sum(-1) == 2).all()


def test_prune_24_keeps_the_two_largest_magnitudes():
    x = torch.randn(3, 5, 32)
    pruned = prune_24(x)
    assert_24(pruned)
    groups, kept = x.reshape(3, 5, 8, 4).abs(), mask_24(x).reshape(3, 5, 8, 4)
    smallest_kept = groups.masked_fill(~kept, float("inf")).amin(-1)
    largest_dropped = groups.masked_fill(kept, -1).amax(-1)
    assert (smallest_kept > largest_dropped).all()
    assert torch.equal(pruned[mask_24(x)], x[mask_24(x)])  # kept values are untouched


def test_prune_24_ties_are_deterministic():
    x = torch.tensor([[1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 3.0, -3.0, 2.0]])
    assert mask_24(x).tolist() == [[True, True, False, False, True, True, False, False, False, True, True, False]]
    with pytest.raises(ValueError, match="divisible by 4"):
        mask_24(torch.zeros(2, 6))


def test_bitmask_format():
    w = torch.tensor([[0.0, 5.0, 0.0, 7.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 3.0, 0.0]])
    compressed, bitmask, shape = compress_bitmask(w)
    assert compressed.tolist() == [[5.0, 7.0, 1.0, 2.0, 0.0, 3.0]]
    # columns 1, 3, 4, 7 -> bits 1+3+4+7 of byte 0; the last group keeps 3.0 and its lower tie (column 8)
    assert bitmask.dtype == torch.uint8 and bitmask.tolist() == [[0b10011010, 0b0101]]
    assert shape.dtype == torch.int64 and shape.tolist() == [[1], [12]]
    with pytest.raises(ValueError, match="not 2:4"):
        compress_bitmask(torch.ones(2, 8))


@pytest.mark.parametrize("cols", [4, 8, 12, 16, 20, 36])
def test_compress_roundtrip(cols):
    w = prune_24(torch.randn(5, cols, dtype=torch.bfloat16))
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, -2.0])  # a group with fewer than 2 nonzeros
    compressed, bitmask, shape = compress_bitmask(w)
    assert compressed.shape == (5, cols // 2) and bitmask.shape == (5, -(-cols // 8))
    little_endian = np.packbits(mask_24(w).numpy(), axis=-1, bitorder="little")  # compressed-tensors' packing
    assert np.array_equal(bitmask.numpy(), little_endian)
    dense = decompress_bitmask(compressed, bitmask, shape)
    assert dense.dtype == torch.bfloat16 and torch.equal(dense, w)


def state_bytes(module):
    return {k: v.numel() * v.element_size() for k, v in module.state_dict().items()}


def test_compressed_bytes():
    w = torch.randn(256, 512, dtype=torch.float16)
    module = from_site(linear_site(512, 256, bias=False), SemiSparseOptions(), {"weight": w})
    sizes = state_bytes(module)
    assert set(sizes) == {"compressed", "bitmask", "shape"}
    ratio = (sizes["compressed"] + sizes["bitmask"]) / (w.numel() * w.element_size())
    assert ratio == pytest.approx(0.5625)  # cols/2 fp16 values + cols/8 bitmask bytes per row


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_module_vs_float64_masked_reference(dtype, tolerance):
    K, N = 64, 48
    t = getattr(torch, dtype)
    w, b, x = torch.randn(N, K, dtype=t), torch.randn(N, dtype=t), torch.randn(3, 7, K, dtype=t)
    module = from_site(linear_site(K, N, dtype=dtype), SemiSparseOptions(), {"weight": w, "bias": b})
    assert isinstance(module, CompressedSemiSparseLinear)
    y = module(x)
    assert y.shape == (3, 7, N) and y.dtype == t and torch.isfinite(y).all()
    ref = F.linear(x.double(), prune_24(w).double(), b.double())
    relative = ((y.double() - ref).norm() / ref.norm()).item()
    assert relative < tolerance
    dense = F.linear(x.double(), w.double(), b.double())
    assert ((y.double() - dense).norm() / dense.norm()).item() > 0.1  # half the weight really is gone


OPTIONS = [
    SemiSparseOptions(),
    SemiSparseOptions(training=True),
    SemiSparseOptions(mask="runtime"),
    SemiSparseOptions(target="activation"),
]


@pytest.mark.parametrize("options, cls, keys", [
    (OPTIONS[0], CompressedSemiSparseLinear, {"compressed", "bitmask", "shape", "bias"}),
    (OPTIONS[1], MaskedSemiSparseLinear, {"weight", "mask", "bias"}),
    (OPTIONS[2], RuntimeSemiSparseLinear, {"weight", "bias"}),
    (OPTIONS[3], RuntimeSemiSparseLinear, {"weight", "bias"}),
], ids=repr)
def test_from_site_equals_empty_plus_load(options, cls, keys):
    site = linear_site(64, 32, dtype="bfloat16")
    params = {"weight": torch.randn(32, 64, dtype=torch.bfloat16), "bias": torch.randn(32, dtype=torch.bfloat16)}
    original = from_site(site, options, params)
    assert isinstance(original, cls) and set(original.state_dict()) == keys
    rebuilt = empty(site, options)
    rebuilt.load_state_dict(original.state_dict(), strict=True)
    x = torch.randn(4, 5, 64, dtype=torch.bfloat16)
    y = original(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and torch.equal(y, rebuilt(x))


def test_compressed_module_follows_a_later_load():
    site = linear_site(16, 8, dtype="float32")
    module = from_site(site, SemiSparseOptions(), {"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
    other = from_site(site, SemiSparseOptions(), {"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
    x = torch.randn(2, 16)
    model = torch.nn.Sequential(module)  # checkpoints load at the model level
    model.load_state_dict(torch.nn.Sequential(other).state_dict())
    assert torch.equal(module(x), other(x))


@pytest.mark.parametrize("transposable", [False, True])
def test_kept_values_are_the_bitmask_formats_compressed_and_kept_to_dense_inverts_them(transposable):
    """Eagerly and compiled whole: the kept values of a weight under its 2:4 mask (pack_kept) are
    compress_bitmask's `compressed`, kept_to_dense puts them back (zeros elsewhere), and
    kept_to_dense's gradient is the dense gradient's kept values."""
    torch.manual_seed(0)
    w, grad = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    mask = mask_24_transposable(w) if transposable else mask_24(w)
    assert torch.equal(mask_codes(mask), kept_codes(mask))
    values = pack_kept_reference(w, kept_codes(mask))
    assert torch.equal(values, compress_bitmask(w * mask)[0])
    compiled = torch.compile(kept_to_dense, fullgraph=True)
    for dense_of in (kept_to_dense, compiled):
        leaf = values.clone().requires_grad_()
        dense = dense_of(leaf, mask)
        dense.backward(grad)
        assert torch.equal(dense, w * mask) and torch.equal(leaf.grad, grad[mask].reshape(8, 8))


def test_fixed_mask_training_keeps_24():
    """The trainable weight is the kept values (out, in/2): its gradient is the dense gradient's
    kept entries (against float64), and the dense weight stays 2:4 under the same mask."""
    torch.manual_seed(0)
    K, N = 32, 16
    target = torch.nn.Linear(K, N)
    w = torch.randn(N, K)
    module = from_site(linear_site(K, N, dtype="float32"), SemiSparseOptions(training=True),
                       {"weight": w, "bias": torch.zeros(N)})
    mask = module.mask.clone()
    assert torch.equal(mask, mask_24(w)) and module.weight.shape == (N, K // 2)
    assert torch.equal(module.linear_weight(), w * mask)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    losses = []
    for step in range(20):
        x = torch.randn(64, K)
        y = module(x)
        loss = F.mse_loss(y, target(x).detach())
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            grad_y = 2 * (y.double() - target(x).double()) / y.numel()
            dense_grad = grad_y.t() @ x.double()
            torch.testing.assert_close(module.weight.grad.double(), dense_grad[mask].reshape(N, K // 2))
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    dense = module.linear_weight().detach()
    assert_24(dense)
    assert (dense[~mask] == 0).all() and (dense[mask] != 0).all()


def test_fixed_mask_training_module_follows_a_loaded_mask_and_refuses_a_bad_one():
    """After loading another checkpoint the forward computes that layer (its values where its mask
    keeps); a mask that is not 2:4 is refused by load_state_dict, naming its key, and the layer
    keeps what it had."""
    site, options = linear_site(16, 8, dtype="float32"), SemiSparseOptions(training=True)
    module = from_site(site, options, {"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
    other = from_site(site, options, {"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
    module.load_state_dict(other.state_dict())
    x = torch.randn(3, 16)
    assert torch.equal(module(x), other(x))
    state = {name: value.clone() for name, value in other.state_dict().items()}
    state["mask"][0, :4] = True
    state["weight"] += 1
    with pytest.raises(LowconvError, match=r"^mask: mask must keep 2 of every 4 weights; 1 groups of 4 keep \[4\]$"):
        module.load_state_dict(state)
    assert all(torch.equal(value, other.state_dict()[name]) for name, value in module.state_dict().items())


def test_fixed_mask_training_layer_takes_torch_func_and_weight_averaging():
    """torch.func's grad and vmap (per-sample gradients) through the layer equal autograd's, and an
    EMA of the whole module, buffers included (AveragedModel(use_buffers=True)), keeps its weight
    under its mask: the layer holds no derived integer state that averaging would round."""
    from torch.func import functional_call, grad, vmap
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    module = from_site(linear_site(16, 8, dtype="float32"), SemiSparseOptions(training=True),
                       {"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
    x, target = torch.randn(5, 16), torch.randn(5, 8)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def loss(p, x, t):
        return F.mse_loss(functional_call(module, (p, dict(module.named_buffers())), (x,)), t)

    F.mse_loss(module(x), target).backward()
    torch.testing.assert_close(grad(loss)(params, x, target)["weight"], module.weight.grad)
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:, None], target[:, None])
    assert per_sample["weight"].shape == (5, 8, 8)
    torch.testing.assert_close(per_sample["weight"].mean(0), module.weight.grad)

    ema = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for _ in range(3):
        with torch.no_grad():
            module.weight.add_(0.1)
        ema.update_parameters(module)
    assert torch.equal(ema.module.mask, module.mask)
    dense = ema.module.linear_weight()
    assert (dense[~module.mask] == 0).all() and (dense[module.mask] != 0).all()


def test_runtime_mask_straight_through_grads():
    K, N = 32, 16
    w, x, grad_out = torch.randn(N, K), torch.randn(8, K), torch.randn(8, N)
    site = linear_site(K, N, bias=False, dtype="float32")
    module = from_site(site, SemiSparseOptions(mask="runtime"), {"weight": w})
    y = module(x)
    (y * grad_out).sum().backward()
    torch.testing.assert_close(y.double(), F.linear(x.double(), prune_24(w).double()), rtol=1e-5, atol=1e-5)
    # Straight-through: the dense weight gets the dense gradient, pruned entries included.
    torch.testing.assert_close(module.weight.grad.double(), grad_out.double().t() @ x.double(), rtol=1e-5, atol=1e-5)
    assert (module.weight.grad[~mask_24(w)] != 0).all()


def test_activation_target():
    K, N = 32, 16
    w, b, grad_out = torch.randn(N, K), torch.randn(N), torch.randn(2, 3, N)
    x = torch.randn(2, 3, K, requires_grad=True)
    site = linear_site(K, N, dtype="float32")
    module = from_site(site, SemiSparseOptions(target="activation"), {"weight": w, "bias": b})
    y = module(x)
    (y * grad_out).sum().backward()
    ref = F.linear(prune_24(x.detach()).double(), w.double(), b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad_out.double() @ w.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(module.weight.detach(), w)  # the weight stays dense


def test_check_reasons():
    assert site_problem(linear_site(64, 30), SemiSparseOptions()) is None
    assert site_problem(linear_site(30, 64), SemiSparseOptions()) == (
        "2:4 sparsity needs in_features divisible by 4 (weight is (64, 30))")


def groups_of_4_keep_2(mask: torch.Tensor) -> bool:
    return bool((mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all())


def test_transposable_mask_is_2_4_both_ways_and_the_best_such_block():
    from lowconv.kernels.sparse24 import mask_24_transposable, transposable_patterns

    patterns = transposable_patterns()
    assert patterns.shape == (90, 16) and len({tuple(p.tolist()) for p in patterns}) == 90
    w = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    mask = mask_24_transposable(w)
    assert groups_of_4_keep_2(mask) and groups_of_4_keep_2(mask.t())
    # No transposable pattern keeps more magnitude in any block (brute force over the 90).
    blocks = w.abs().reshape(4, 4, 6, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    kept = (blocks * mask.reshape(4, 4, 6, 4).permute(0, 2, 1, 3).reshape(-1, 16)).sum(1)
    assert torch.allclose(kept, (blocks @ patterns.float().t()).max(1).values)
    assert (w.abs() * mask).sum() <= (w.abs() * mask_24(w)).sum()  # a constrained mask keeps no more
    with pytest.raises(ValueError, match="both dims divisible by 4"):
        mask_24_transposable(torch.randn(6, 8))


@pytest.mark.parametrize("training", [False, True])
def test_transposable_option_prunes_both_ways(training):
    site = linear_site(32, 16, dtype="float32")
    w = torch.randn(16, 32)
    module = from_site(site, SemiSparseOptions(transposable=True, training=training), {"weight": w, "bias": torch.randn(16)})
    weight = module.linear_weight()
    mask = weight != 0
    assert groups_of_4_keep_2(mask) and groups_of_4_keep_2(mask.t())


def test_transposable_needs_a_fixed_weight_mask_and_out_features_by_4():
    with pytest.raises(ValueError, match="fixed weight mask only"):
        SemiSparseOptions(transposable=True, mask="runtime")
    assert site_problem(linear_site(32, 30), SemiSparseOptions(transposable=True)) == (
        "transposable 2:4 sparsity needs out_features divisible by 4 too (weight is (30, 32))")


def test_a_modules_plan_note_is_kept_in_the_plan_through_save_and_load(monkeypatch, tmp_path):
    """What an op module measured when it was built (a 2:4 layer's CUDA backend and its timings)
    lands in its decision and in the plan table; a plan without it (older checkpoints) loads."""
    import lowconv
    from lowconv.api import plan_of
    from lowconv.cli import plan_table
    from lowconv.ops.semi_sparse import FixedMaskLinear

    monkeypatch.setattr(FixedMaskLinear, "plan_note", lambda self: "CUDA backend cusparselt (faster: 0.1 ms vs 0.2 ms)")
    model = torch.nn.Sequential()
    model.add_module("mlp", torch.nn.Sequential(torch.nn.Linear(32, 16)))  # the built-in recipe takes MLPs
    converted = lowconv.convert(model, "semi-sparse", (torch.randn(4, 32),))
    (decision,) = [d for d in plan_of(converted).decisions if d.converted]
    assert decision.note == "CUDA backend cusparselt (faster: 0.1 ms vs 0.2 ms)"
    assert "faster: 0.1 ms vs 0.2 ms" in plan_table(plan_of(converted))
    lowconv.save(converted, tmp_path / "out")
    loaded = lowconv.load(model, tmp_path / "out", (torch.randn(4, 32),))
    assert [d.note for d in plan_of(loaded).decisions if d.converted] == [decision.note]


def test_the_backend_is_chosen_again_for_another_dtype_or_device_only():
    """The CUDA backend was timed for one dtype and device: a bf16 choice of cuSPARSELt would fail
    on float32, so another dtype or device chooses again; .to() the same device keeps the choice
    (conversion moves the module after choosing)."""
    from lowconv.kernels import sparse24

    cuda = torch.device("cuda", 0)
    for module in (CompressedSemiSparseLinear(16, 8, True, torch.bfloat16, SemiSparseOptions(backend="masked-dense")),
                   MaskedSemiSparseLinear(16, 8, True, torch.bfloat16,
                                          SemiSparseOptions(training=True, backend="masked-dense"))):
        first = module.decide(cuda, 16, torch.bfloat16)
        module.to(torch.bfloat16)
        assert module.decide(cuda, 16, torch.bfloat16) is first
        again = module.decide(cuda, 16, torch.float32)
        assert again is not first and module.chosen_for == (cuda, torch.float32)
        assert module.decide(torch.device("cuda", 1), 16, torch.float32) is not again
        assert isinstance(first, sparse24.BackendChoice)


@pytest.mark.parametrize("options", OPTIONS, ids=repr)
def test_each_module_compiles_whole_on_the_cpu(options):
    """torch.compile(fullgraph=True) of each 2:4 module on the CPU's reference path: the output and
    gradients of eager. A compressed layer compiled before its first eager call unpacks its dense
    weight in the graph, and keeps none (the module doc)."""
    torch.manual_seed(0)
    params = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    module = from_site(linear_site(64, 32, dtype="float32"), options, params)
    compiled, graphs = compile_recording(module)
    x = torch.randn(3, 5, 64)
    first = run_with_grads(compiled, module, x)  # before any eager call
    assert graphs and (not isinstance(module, CompressedSemiSparseLinear) or module.dense_weight.numel() == 0)
    assert_same_run(first, run_with_grads(module, module, x))
    x = torch.randn(7, 64)
    assert_same_run(run_with_grads(compiled, module, x), run_with_grads(module, module, x))
