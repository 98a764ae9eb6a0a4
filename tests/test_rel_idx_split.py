"""A rel_idx column rewritten by a split function (SphereFormer's radial split), read as buckets of
per-pair differences and converted: passes/rel_idx_split.py, the window op's split axis."""

import numpy as np
import pytest
import torch
from torch import nn

import lowconv
from lowconv.compat import sptr
from lowconv.kernels.window_attention import SplitAxis, window_attention
from lowconv.model_file import load_model_file
from lowconv.ops.window_attention import SparseWindowAttention
from lowconv.passes.rel_idx_split import FloatOrder, bucket_thresholds
from lowconv.passes.trace import trace_model
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.recipe import parse_recipe

FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')
A = 0.0125


def exponential_buckets(d, a=A):
    """SphereFormer's split of a difference d, as it writes it (log / log 2), then its offset 24,
    the cast into a float rel_idx, the clamp to [0, 2G-1] and `.int()` of SpTr."""
    size, positive = d.abs(), (d >= 0).float()
    idx = 2 * torch.floor(torch.log((size + 2 * a) / a) / float(np.log(2))) - 2
    idx = idx + ((3 * 2 ** (idx // 2) - 2) * a <= size).float()
    idx = idx * (2 * positive - 1) + (positive - 1)
    return (idx.long() + 24).float().clamp(0, 47).int()


def test_thresholds_give_the_buckets_of_every_difference():
    first, thresholds = bucket_thresholds(exponential_buckets, torch.float32)
    assert (first, len(thresholds)) == (0, 47)
    assert thresholds[23:27] == (0.0, np.float32(A), np.float32(2 * A), np.float32(4 * A))
    gen = torch.Generator().manual_seed(0)
    d = torch.cat([torch.randn(200_000, generator=gen) * scale for scale in (0.01, 0.3, 10.0, 100.0)])
    at = torch.tensor(thresholds)
    d = torch.cat([d, at, at.nextafter(at + 1), at.nextafter(at - 1)])  # each threshold and its neighbours
    assert torch.equal(first + torch.searchsorted(at, d, right=True), exponential_buckets(d).long())


@pytest.mark.parametrize("function, why", [
    (lambda d: (d.abs() * 4).floor().long().clamp(0, 9), "not a non-decreasing step function"),
    (lambda d: (d * 3).floor().long(), "buckets run from -50331648 to 50331648"),
    (lambda d: d.clamp(0, 1) * 0.5, "does not give one whole number per difference"),
])
def test_a_split_that_is_no_bucketing_is_refused(function, why):
    try:
        result = bucket_thresholds(function, torch.float32)
    except ValueError as error:
        result = str(error)
    assert isinstance(result, str) and why in result


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_float_order_keys_round_trip(dtype):
    order = FloatOrder(dtype)
    values = np.array([-order.floats(np.array([order.top]))[0], -1.5, -0.0, 0.0, 1e-3, 2.0], order.floats_type)
    keys = order.keys(values)
    assert list(keys) == sorted(keys) and keys[2] == keys[3] == 0
    assert np.array_equal(order.floats(keys)[[0, 1, 3, 4, 5]], values[[0, 1, 3, 4, 5]])


def test_reference_reads_the_split_axis_from_the_values():
    """The torch reference with a split axis against the pair formula in float64."""
    gen = torch.Generator().manual_seed(1)
    n, h, d, g = 40, 2, 16, 4
    q, k, v = (torch.randn(n, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    coords = torch.randint(0, g, (n, 3), generator=gen)
    tables = tuple(torch.randn(2 * g, 3, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    values = torch.randn(n, generator=gen, dtype=torch.float64)
    thresholds = torch.tensor([-1.0, -0.2, 0.0, 0.3, 0.3, 1.0], dtype=torch.float64)
    offsets = torch.tensor([0, 7, 20, 21, 40])
    out = window_attention(q, k, v, offsets, coords=coords, tables=tables, scale=1.0,
                           split=SplitAxis(1, values, thresholds, 1))
    expected = torch.empty_like(out)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for i in range(start, end):
            j = torch.arange(start, end)
            rel = coords[i] - coords[j] + g - 1
            rel[:, 1] = 1 + torch.searchsorted(thresholds, values[i] - values[j], right=True)
            tq, tk, tv = (sum(t[rel[:, a], a] for a in range(3)) for t in tables)
            logits = (q[i] * (k[j] + tq)).sum(-1) + (k[j] * tk).sum(-1)
            expected[i] = (logits.softmax(0)[..., None] * (v[j] + tv)).sum(0)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_bad_splits_are_refused():
    q = torch.randn(4, 1, 16)
    tables = tuple(torch.randn(7, 3, 1, 16) for _ in range(3))
    coords = torch.zeros(4, 3, dtype=torch.int64)
    split = SplitAxis(2, torch.zeros(4), torch.zeros(7), 0)  # buckets 0 to 7: 8 rows
    with pytest.raises(ValueError, match="the split's buckets 0 to 7 are not table rows"):
        window_attention(q, q, q, torch.tensor([0, 4]), coords=coords, tables=tables, split=split)
    split = SplitAxis(2, torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="takes a split axis of float32 values"):
        window_attention(q, q, q, torch.tensor([0, 4]), coords=coords, tables=tables, split=split, backend="triton")


class Radial(nn.Module):
    """compat's sparse_self_attention with a split function on the spherical coordinates' range."""

    def __init__(self, split_func):
        super().__init__()
        self.split_func = split_func
        self.tables = nn.Parameter(torch.randn(3, 12, 3, 2, 16) * 0.5)  # 2G rows, G = 6
        self.qkv = nn.Linear(32, 96)

    def forward(self, feats, xyz, batch):
        q, k, v = self.qkv(feats).reshape(-1, 3, 2, 16).unbind(1)
        r = xyz.norm(dim=1, keepdim=True)
        points = torch.cat([torch.atan2(xyz[:, 1:2], xyz[:, :1]), xyz[:, 2:3] / r, r], 1)
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
            points, batch, [0.5, 0.5, 4.0], False)
        return sptr.sparse_self_attention(
            q * 0.25, k, v, points, index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx,
            [0.5, 0.5, 4.0], False, pe_type="contextual", rel_query=True, rel_key=True, rel_value=True,
            quant_size=[0.5 / 6, 0.5 / 6, 4.0 / 6], quant_grid_length=6, relative_pos_query_table=self.tables[0],
            relative_pos_key_table=self.tables[1], relative_pos_value_table=self.tables[2],
            split_func=self.split_func).flatten(1)


def radial_buckets(xyz, index_0, index_1, rel):
    """Range differences in 0.1 m buckets, 5 each way, offset by G = 6: buckets 1 to 11."""
    d = xyz[:, 2][index_0.long()] - xyz[:, 2][index_1.long()]
    rel[:, 2] = (d / 0.1).floor().clamp(-5, 5).long() + 6
    return rel


def two_differences(xyz, index_0, index_1, rel):
    rel[:, 2] = (xyz[:, 2][index_0.long()] - xyz[:, 1][index_1.long()] > 0).long()
    return rel


def scene(n=300):
    torch.manual_seed(0)
    xyz = torch.randn(n, 3) * torch.tensor([2.0, 2.0, 0.3])
    return torch.randn(n, 32), xyz, (torch.arange(n) >= n // 2).long()


def test_a_radial_split_converts_equal_to_the_original():
    model, inputs = Radial(radial_buckets).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None and site.info.rel_pos == "contextual, axis 2 split into buckets 1 to 11"
    axis, first, thresholds = site.args[-1]
    assert (axis, first) == (2, 1) and np.allclose(thresholds, np.arange(-0.4, 0.55, 0.1), atol=1e-6)
    converted = lowconv.convert(model, FLOAT32, inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["attention"]
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


def test_the_split_survives_a_cast_of_the_converted_model():
    """model.half() casts floating buffers: the op keeps its thresholds as integers (their bits)."""
    model, inputs = Radial(radial_buckets).eval(), scene()
    converted = lowconv.convert(model, FLOAT32, inputs)
    [op] = [m for m in converted.modules() if isinstance(m, SparseWindowAttention)]
    before = op.split_thresholds.view(torch.float64).clone()
    converted.half().float()
    assert torch.equal(op.split_thresholds.view(torch.float64), before)
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-2, atol=1e-2)


def test_a_split_of_two_values_is_kept_with_why():
    model, inputs = Radial(two_differences).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported == ("rel_idx is rewritten by a split function that lowconv cannot read: the column a "
                                "split function writes reads s[index_0] - t[index_1] of two different per-point "
                                "tensors, not the difference of one")


def test_a_split_of_float64_values_is_kept_on_cuda(monkeypatch):
    """The Triton kernel buckets float32 differences: a model in float64 on CUDA keeps the chain."""
    from lowconv.ops import window_attention as window_op
    model = Radial(radial_buckets).double().eval()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in scene())
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None
    monkeypatch.setattr(window_op, "site_may_run_on_cuda", lambda site: True)
    problem = window_op.window_site_problem(site, window_op.SparseAttentionOptions(dtype="float32"))
    assert "takes a split function's values in float32" in problem and "not float64" in problem


def test_sphereformer_example_converts_all_ten_chains_exactly():
    """examples/sphereformer.py on a small scene: both branches of its five blocks convert (the
    spherical one with SphereFormer's exponential radial split), the output equal in float32."""
    loaded = load_model_file("examples/sphereformer.py")
    module = __import__("sphereformer")
    xyz, batch = module.synthetic_lidar_scene(300, module.KITTI_AZIMUTH_STEPS)
    inputs = (torch.cat([xyz, torch.rand(len(xyz), 1)], 1), xyz, batch)
    converted = lowconv.convert(loaded.model, FLOAT32, inputs)
    converted_sites = [d.fqn for d in converted.lowconv_plan.converted()]
    assert converted_sites == [f"blocks.{i}.attn.attention{suffix}" for i in range(5) for suffix in ("", "_1")]
    graph_targets = {n.target for n in converted.graph.nodes if n.op == "call_function"}
    assert not graph_targets & set(sptr.SPTR_OPS)
    with torch.no_grad():
        assert torch.equal(converted(*inputs), loaded.model(*inputs))
