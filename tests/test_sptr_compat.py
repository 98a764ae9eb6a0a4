"""lowconv.compat.sptr against SpTr's layout and a dense per-window float64 reference."""
import importlib
import operator
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from lowconv.cli import main
from lowconv.compat import sptr
from lowconv.compat.sptr import attention_step1 as imported_attention_step1
from lowconv.model_file import import_file, load_model_file
from lowconv.passes.trace import find_regions

F64 = torch.float64
EXAMPLE = "examples/point_transformer.py"
WINDOW = (0.4, 0.3, 0.5)  # unequal sides catch mixed-up axes
CUBE, QUANT = 0.4, 0.1  # rel pos: G = 4 quant cells per side, tables of 7 rows


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: on two busy cores, intra-op threads cost far more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_points(n=300, seed=0, batches=(0, 1)):
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.rand(n, 3, generator=gen, dtype=F64) * 1.2 - 0.7
    batch = torch.tensor(batches)[torch.randint(len(batches), (n,), generator=gen)]
    return xyz, batch


def reference_windows(xyz, batch, window, shift):
    """Input indices of each window's points, windows in (batch, z, y, x) order: plain Python."""
    size = torch.tensor(window, dtype=F64).expand(3)
    cell = torch.floor((xyz - xyz.min(0).values + (size / 2 if shift else 0)) / size).long().tolist()
    windows = {}
    for point, (b, (x, y, z)) in enumerate(zip(batch.tolist(), cell)):
        windows.setdefault((b, z, y, x), []).append(point)
    return [windows[key] for key in sorted(windows)]


def quantized(xyz, shift):
    """Each point's quant cell inside its cubic window, as SpTr computes it (a floor division)."""
    in_window = (xyz - xyz.min(0).values + (CUBE / 2 if shift else 0)) % CUBE
    return torch.div(in_window, QUANT, rounding_mode="floor").long()


def table_sum(table, rel):
    """sum_a table[rel[..., a], a] for rel (..., 3): (..., h, d)."""
    return sum(table[rel[..., a], a] for a in range(3))


def dense_attention(q, k, v, windows, tables=None, qxyz=None):
    """softmax(q k^T [+ rel terms]) (v [+ rel value]) within each window, in input order."""
    out = torch.zeros_like(v)
    for points in windows:
        idx = torch.tensor(points)
        qw, kw, vw = q[idx], k[idx], v[idx]
        logits = torch.einsum("ihd,thd->hit", qw, kw)
        values = vw.expand(len(points), *vw.shape)  # values[i, t] = v_t
        if tables is not None:
            table_q, table_k, table_v = tables
            rel = qxyz[idx][:, None] - qxyz[idx][None] + 3  # G - 1 = 3
            logits = logits + torch.einsum("ihd,ithd->hit", qw, table_sum(table_q, rel))
            logits = logits + torch.einsum("thd,ithd->hit", kw, table_sum(table_k, rel))
            values = values + table_sum(table_v, rel)
        out[idx] = torch.einsum("hit,ithd->ihd", logits.softmax(-1), values)
    return out


def qkv_and_tables(n, heads=2, head_dim=16, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, heads, head_dim, generator=gen, dtype=dtype) for _ in range(3))
    tables = tuple(torch.randn(7, 3, heads, head_dim, generator=gen, dtype=dtype) * 0.5 for _ in range(3))
    return q, k, v, tables


def plain_attention(q, k, v, xyz, batch, shift):
    return sptr.sparse_self_attention(q, k, v, xyz, *sptr.get_indices_params(xyz, batch, CUBE, shift), CUBE, shift)


def contextual_attention(q, k, v, xyz, batch, tables, shift):
    indices = sptr.get_indices_params(xyz, batch, CUBE, shift)
    return sptr.sparse_self_attention(q, k, v, xyz, *indices, CUBE, shift, pe_type="contextual", rel_query=True,
                                      rel_key=True, rel_value=True, quant_size=QUANT, quant_grid_length=4,
                                      relative_pos_query_table=tables[0], relative_pos_key_table=tables[1],
                                      relative_pos_value_table=tables[2])


def window_blocks(pairs, window_offsets):
    """Per window, its pairs' values as an (n, n, ...) block [query, key]."""
    counts = window_offsets.diff().tolist()
    sq = 0
    for n in counts:
        yield pairs[sq:sq + n * n].reshape(n, n, *pairs.shape[1:])
        sq += n * n


# ---- window partition and pair layout

@pytest.mark.parametrize("window, shift", [(WINDOW, False), (WINDOW, True), (0.35, True)])
def test_partition_matches_the_reference_windows(window, shift):
    xyz, batch = random_points()
    window_index, sort_idx, window_offsets = sptr.window_partition(xyz, batch, window, shift)
    windows = reference_windows(xyz, batch, window, shift)
    assert window_offsets.dtype == torch.int32 and window_offsets[0] == 0 and window_offsets[-1] == len(xyz)
    assert len(window_offsets) == len(windows) + 1
    for w, points in enumerate(windows):
        start, end = window_offsets[w], window_offsets[w + 1]
        assert sort_idx[start:end].tolist() == points  # windows contiguous, input order kept within
        assert (window_index[points] == w).all()


def test_shifted_windows_differ_from_plain_ones():
    xyz, batch = random_points()
    plain = sptr.window_partition(xyz, batch, WINDOW, False)[0]
    shifted = sptr.window_partition(xyz, batch, WINDOW, True)[0]
    assert not torch.equal(plain, shifted)


def test_pair_layout_is_sptr_s():
    xyz, batch = random_points()
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
        xyz, batch, WINDOW, False)
    _, partition_sort_idx, window_offsets = sptr.window_partition(xyz, batch, WINDOW, False)
    assert torch.equal(sort_idx, partition_sort_idx)
    counts = window_offsets.diff()
    assert n_max == counts.max() and n_max > 3
    for t in (index_0, index_0_offsets, index_1, index_1_offsets):
        assert t.dtype == torch.int32
    assert len(index_0) == len(index_1) == index_0_offsets[-1] == (counts.long() ** 2).sum()
    assert len(index_0_offsets) == len(xyz) + 1 and len(index_1_offsets) == len(xyz)
    sq = 0
    for s, n in zip(window_offsets[:-1].tolist(), counts.tolist()):
        i, t = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        pairs = sq + i * n + t  # query-major
        assert torch.equal(index_0[pairs], (s + i).int()) and torch.equal(index_1[pairs], (s + t).int())
        assert index_0_offsets[s:s + n].tolist() == [sq + r * n for r in range(n)]
        assert index_1_offsets[s:s + n].tolist() == [sq + c for c in range(n)]
        key_column = index_1_offsets[s:s + n, None] + torch.arange(n) * n  # key j's pairs, one per query
        assert (index_1[key_column] == torch.arange(s, s + n)[:, None]).all()
        assert (index_0[key_column] == torch.arange(s, s + n)[None, :]).all()
        sq += n * n


def test_an_empty_batch_changes_nothing_and_no_points_give_empty_indices():
    xyz, batch = random_points(batches=(0, 2))  # batch 1 has no points
    gapped = sptr.get_indices_params(xyz, batch, WINDOW, True)
    packed = sptr.get_indices_params(xyz, torch.where(batch == 2, 1, batch), WINDOW, True)
    for a, b in zip(gapped, packed):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
        xyz[:0], batch[:0], WINDOW, False)
    assert n_max == 0 and index_0_offsets.tolist() == [0]
    assert len(index_0) == len(index_1) == len(index_1_offsets) == len(sort_idx) == 0
    q = torch.zeros(0, 2, 16)
    out = sptr.sparse_self_attention(q, q, q, xyz[:0], index_0, index_0_offsets, n_max, index_1,
                                     index_1_offsets, sort_idx, WINDOW, False)
    assert out.shape == (0, 2, 16)


def test_windows_never_mix_batches():
    xyz, batch = random_points()
    _, sort_idx, window_offsets = sptr.window_partition(xyz, batch, WINDOW, False)
    for s, e in zip(window_offsets[:-1].tolist(), window_offsets[1:].tolist()):
        assert len(set(batch[sort_idx[s:e]].tolist())) == 1


# ---- each op against dense per-window float64

@pytest.mark.parametrize("shift", [False, True])
def test_relative_position_index_is_the_quantized_offset(shift):
    xyz, batch = random_points()
    index_0, _, _, index_1, _, sort_idx = sptr.get_indices_params(xyz, batch, CUBE, shift)
    rel_idx = sptr.relative_position_index(xyz[sort_idx], index_0, index_1, CUBE, QUANT, 4, shift)
    qxyz = quantized(xyz, shift)[sort_idx]
    assert rel_idx.dtype == torch.int32 and rel_idx.min() >= 0 and rel_idx.max() <= 6
    assert torch.equal(rel_idx.long(), qxyz[index_0.long()] - qxyz[index_1.long()] + 3)


def test_quant_cells_are_sptr_s_floor_division_not_the_floor_of_a_rounded_quotient():
    """In float32 2.0 / 0.1 rounds to 20.0, but 0.1 is stored a hair above it, so SpTr's
    torch.div(..., rounding_mode="floor") gives 19 (likewise 0.7 -> 6 and 3.6 -> 35)."""
    xyz = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.7, 3.6]])
    assert torch.floor(xyz[1] / 0.1).tolist() == [20, 7, 36]
    assert sptr.quantized_coordinates(xyz, 4.0, 0.1, 40)[1].tolist() == [19, 6, 35]


def test_coordinates_in_window_keep_the_differences_within_each_window_in_0_to_g_minus_1():
    coords = torch.tensor([[2., 7., 1.], [4., 6., 3.], [3., 8., 2.], [6., 0., 0.], [0., 0., 0.]])
    window_start = torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32)
    expected = torch.tensor([[0, 1, 0], [2, 0, 2], [1, 2, 1],
                             [4, 0, 0], [0, 0, 0]])  # the second window spans 7 cells: clamped to G = 5
    assert torch.equal(sptr.coordinates_in_window(coords, window_start, 5), expected)


def test_each_op_matches_dense_window_math():
    xyz, batch = random_points()
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
        xyz, batch, CUBE, False)
    window_offsets = sptr.window_partition(xyz, batch, CUBE, False)[2]
    q, k, v, (table_q, table_k, table_v) = qkv_and_tables(len(xyz))
    q, k, v = q[sort_idx], k[sort_idx], v[sort_idx]
    qxyz = quantized(xyz, False)[sort_idx]
    rel_idx = sptr.relative_position_index(xyz[sort_idx], index_0, index_1, CUBE, QUANT, 4)
    logits = sptr.attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    rel_logits = sptr.dot_prod_with_idx_all(q, index_0, index_0_offsets, k, index_1, index_1_offsets, table_q,
                                            table_k, rel_idx, n_max)
    rel_terms = sptr.dot_prod_with_idx(q, index_0, index_0_offsets, k, index_1, index_1_offsets, table_q, table_k,
                                       rel_idx, n_max)
    probs = sptr.scatter_softmax_csr(rel_logits, index_0_offsets.long(), dim=0)
    out = sptr.attention_step2(probs, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    rel_out = sptr.attention_step2_with_rel_pos_value(probs, v, index_0, index_0_offsets, n_max, index_1,
                                                      index_1_offsets, table_v, rel_idx)
    blocks = zip(window_blocks(logits, window_offsets), window_blocks(rel_logits, window_offsets),
                 window_blocks(rel_terms, window_offsets), window_blocks(probs, window_offsets),
                 window_offsets[:-1].tolist(), window_offsets[1:].tolist())
    for logit, rel_logit, rel_term, prob, s, e in blocks:
        qw, kw, vw = q[s:e], k[s:e], v[s:e]
        rel = qxyz[s:e, None] - qxyz[None, s:e] + 3
        expected = torch.einsum("ihd,thd->ith", qw, kw)
        torch.testing.assert_close(logit, expected, rtol=1e-12, atol=1e-12)
        terms = (torch.einsum("ihd,ithd->ith", qw, table_sum(table_q, rel))
                 + torch.einsum("thd,ithd->ith", kw, table_sum(table_k, rel)))  # SpTr's dot_prod_with_idx
        torch.testing.assert_close(rel_term, terms, rtol=1e-12, atol=1e-12)
        expected = expected + terms
        torch.testing.assert_close(rel_logit, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(prob, expected.softmax(1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[s:e], torch.einsum("ith,thd->ihd", prob, vw), rtol=1e-12, atol=1e-12)
        expected = torch.einsum("ith,ithd->ihd", prob, vw + table_sum(table_v, rel))
        torch.testing.assert_close(rel_out[s:e], expected, rtol=1e-12, atol=1e-12)


def test_softmax_survives_large_logits():
    indptr = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # the middle row is empty
    src = torch.tensor([[1000.0, 1.0], [999.0, 2.0], [-1000.0, 3.0], [-5000.0, 4.0], [-5001.0, 5.0]])
    expected = torch.cat([src[:3].softmax(0), src[3:].softmax(0)])
    torch.testing.assert_close(sptr.scatter_softmax_csr(src, indptr), expected)


@pytest.mark.parametrize("shift", [False, True])
def test_sparse_self_attention_matches_dense_windows(shift):
    xyz, batch = random_points()
    q, k, v, tables = qkv_and_tables(len(xyz))
    windows = reference_windows(xyz, batch, CUBE, shift)
    out = contextual_attention(q, k, v, xyz, batch, tables, shift)
    torch.testing.assert_close(out, dense_attention(q, k, v, windows, tables, quantized(xyz, shift)),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain_attention(q, k, v, xyz, batch, shift), dense_attention(q, k, v, windows),
                               rtol=1e-12, atol=1e-12)


# ---- gradients

def test_gradients_match_the_dense_reference():
    xyz, batch = random_points()
    q, k, v, tables = qkv_and_tables(len(xyz))
    leaves = [t.requires_grad_() for t in (q, k, v, *tables)]
    weight = torch.randn_like(v)
    ours = torch.autograd.grad((contextual_attention(q, k, v, xyz, batch, tables, True) * weight).sum(), leaves)
    windows = reference_windows(xyz, batch, CUBE, True)
    dense = dense_attention(q, k, v, windows, tables, quantized(xyz, True))
    for got, expected in zip(ours, torch.autograd.grad((dense * weight).sum(), leaves)):
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_gradcheck_in_float64():
    xyz, batch = random_points(n=14, seed=3)
    q, k, v, tables = qkv_and_tables(len(xyz), heads=2, head_dim=2, seed=4)
    leaves = [t.requires_grad_() for t in (q, k, v, *tables)]
    assert torch.autograd.gradcheck(lambda q, k, v: plain_attention(q, k, v, xyz, batch, False), leaves[:3],
                                    fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, *tables: contextual_attention(q, k, v, xyz, batch, tables, False), leaves, fast_mode=True)


# ---- fx: one call_function node per op and helper

class PlainAttention(torch.nn.Module):
    def forward(self, q, k, v, xyz, batch):
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = sptr.get_indices_params(
            xyz, batch, CUBE, False)
        attn = sptr.attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
        attn = sptr.scatter_softmax_csr(attn, index_0_offsets)
        return sptr.attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)


class FromImportedStep1(torch.nn.Module):
    def forward(self, q, k, index_0, index_0_offsets, index_1, index_1_offsets):
        return imported_attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, 4)


def sptr_calls(graph):
    return [node.target for node in graph.nodes
            if node.op == "call_function" and node.target in sptr.SPTR_OPS + sptr.SPTR_HELPERS]


def test_a_trace_records_each_op_as_one_call_function():
    traced = fx.symbolic_trace(PlainAttention())
    assert sptr_calls(traced.graph) == [sptr.get_indices_params, sptr.attention_step1, sptr.scatter_softmax_csr,
                                        sptr.attention_step2]
    others = {node.target for node in traced.graph.nodes if node.op == "call_function"} - set(sptr_calls(traced.graph))
    assert others == {operator.getitem}  # nothing of the ops' insides leaked into the graph
    xyz, batch = random_points()
    q, k, v, _ = qkv_and_tables(len(xyz))
    torch.testing.assert_close(traced(q, k, v, xyz, batch), PlainAttention()(q, k, v, xyz, batch))


def test_from_imported_ops_trace_with_autowrap_functions():
    assert sptr_calls(fx.symbolic_trace(FromImportedStep1()).graph) == []  # traced into: its insides
    graph = fx.Tracer(autowrap_functions=sptr.SPTR_OPS + sptr.SPTR_HELPERS).trace(FromImportedStep1())
    assert sptr_calls(graph) == [sptr.attention_step1]


@pytest.mark.parametrize("pe_type, ops", [
    ("none", [sptr.get_indices_params, sptr.attention_step1, sptr.scatter_softmax_csr, sptr.attention_step2]),
    ("contextual", [sptr.get_indices_params, sptr.relative_position_index, sptr.dot_prod_with_idx_all,
                    sptr.scatter_softmax_csr, sptr.attention_step2_with_rel_pos_value]),
])
def test_the_module_traces_to_its_chain_of_ops(pe_type, ops):
    module = sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, True, pe_type, quant_size=QUANT).eval()
    traced = fx.symbolic_trace(module)
    assert sptr_calls(traced.graph) == ops
    xyz, batch = random_points()
    feats = torch.randn(len(xyz), 32)
    torch.testing.assert_close(traced(feats, xyz, batch), module(feats, xyz, batch))


# ---- VarLengthMultiheadSA

def module_pair(shift=True):
    """The same attention with pe_type none and contextual (the same q, k, v, proj weights), float64."""
    torch.manual_seed(0)
    none = sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, shift).double().eval()
    contextual = sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, shift, "contextual", quant_size=QUANT)
    contextual = contextual.double().eval()
    contextual.load_state_dict(none.state_dict(), strict=False)
    return none, contextual


def test_the_module_is_its_projections_around_dense_window_attention():
    none, contextual = module_pair()
    xyz, batch = random_points()
    feats = torch.randn(len(xyz), 32, dtype=F64)
    windows = reference_windows(xyz, batch, CUBE, True)

    def heads(x):
        return x.reshape(len(xyz), 2, 16)

    q, k, v = heads(contextual.q(feats)) * 16 ** -0.5, heads(contextual.k(feats)), heads(contextual.v(feats))
    tables = (contextual.relative_pos_query_table, contextual.relative_pos_key_table,
              contextual.relative_pos_value_table)
    assert contextual.quant_grid_length == 4 and tables[0].shape == (7, 3, 2, 16)
    expected = contextual.proj(dense_attention(q, k, v, windows, tables, quantized(xyz, True)).reshape(-1, 32))
    torch.testing.assert_close(contextual(feats, xyz, batch), expected, rtol=1e-10, atol=1e-10)
    expected = none.proj(dense_attention(q, k, v, windows).reshape(-1, 32))
    torch.testing.assert_close(none(feats, xyz, batch), expected, rtol=1e-10, atol=1e-10)


def test_contextual_uses_its_tables():
    none, contextual = module_pair()
    xyz, batch = random_points()
    feats = torch.randn(len(xyz), 32, dtype=F64)
    plain = none(feats, xyz, batch)
    assert (contextual(feats, xyz, batch) - plain).abs().max() > 1e-3  # SpTr's would be equal
    with torch.no_grad():
        for table in (contextual.relative_pos_query_table, contextual.relative_pos_key_table,
                      contextual.relative_pos_value_table):
            table.zero_()
    torch.testing.assert_close(contextual(feats, xyz, batch), plain, rtol=1e-12, atol=1e-12)


def sparse_tr(feats, xyz, batch, **features):
    """SpTr's input: the batch index in column 0 of the indices, then xyz."""
    return sptr.SparseTrTensor(feats, torch.cat([batch[:, None].to(xyz.dtype), xyz], 1), spatial_shape=None,
                               batch_size=None, **features)


def test_a_sparse_tr_tensor_in_gives_one_out_with_the_tensor_call_s_features():
    _, contextual = module_pair()
    xyz, batch = random_points()
    feats = torch.randn(len(xyz), 32, dtype=F64)
    given = sparse_tr(feats, xyz, batch)
    given.spatial_shape, given.batch_size = [24, 24, 24], 2
    out = contextual(given)
    assert isinstance(out, sptr.SparseTrTensor) and out.indice_dict == {}
    assert out.query_indices is given.query_indices and (out.spatial_shape, out.batch_size) == ([24, 24, 24], 2)
    assert given.spatial_size == 24 ** 3
    torch.testing.assert_close(out.query_feats, contextual(feats, xyz, batch), rtol=0, atol=0)


def test_voxel_indices_as_spconv_gives_them_take_integer_coordinates():
    """spconv's indices are int32 voxel coordinates, as SphereFormer passes them."""
    none, _ = module_pair()
    voxels = torch.randint(0, 12, (200, 3), generator=torch.Generator().manual_seed(1))
    batch = (torch.arange(200) >= 100).int()
    feats = torch.randn(200, 32, dtype=F64)
    tensor = sptr.SparseTrTensor(feats, torch.cat([batch[:, None], voxels.int()], 1), None, None)
    sized = sptr.VarLengthMultiheadSA(32, 2, "key", 4, True).double().eval()
    sized.load_state_dict(none.state_dict())
    expected = sized(feats, voxels.double(), batch.long())
    torch.testing.assert_close(sized(tensor).query_feats, expected, rtol=0, atol=0)


def test_key_and_value_features_of_a_sparse_tr_tensor_are_attended():
    """SpTr takes k from key_feats and v from value_feats where given, at the query's points."""
    none, _ = module_pair(shift=False)
    xyz, batch = random_points()
    feats, other = torch.randn(2, len(xyz), 32, dtype=F64).unbind(0)
    windows = reference_windows(xyz, batch, CUBE, False)

    def heads(x):
        return x.reshape(len(xyz), 2, 16)

    expected = none.proj(dense_attention(heads(none.q(feats)) * 16 ** -0.5, heads(none.k(other)),
                                         heads(none.v(other)), windows).reshape(-1, 32))
    out = none(sparse_tr(feats, xyz, batch, key_feats=other, value_feats=other)).query_feats
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_layers_given_one_sparse_tr_tensor_share_its_windows_under_their_key(monkeypatch):
    none, contextual = module_pair()
    xyz, batch = random_points()
    tensor = sparse_tr(torch.randn(len(xyz), 32, dtype=F64), xyz, batch)
    calls = []
    layout = sptr.get_indices_params
    monkeypatch.setattr(sptr, "get_indices_params", lambda *args: calls.append(args) or layout(*args))
    first, second = none(tensor), contextual(tensor)
    assert len(calls) == 1 and "key" in tensor.indice_dict
    torch.testing.assert_close(second.query_feats, contextual(tensor.query_feats, xyz, batch), rtol=0, atol=0)
    assert first.indice_dict == {}  # an output holds no layout, as SpTr's
    other = sptr.VarLengthMultiheadSA(32, 2, "key", 0.5).double()
    with pytest.raises(ValueError, match="indice_key 'key'.*share their windows"):
        other(tensor)


def test_the_constructor_takes_sptr_s_positional_arguments_and_names_its_keywords():
    """SpTr's tenth positional argument is `algo`; quant_size and the rel flags come by keyword."""
    module = sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, True, "contextual", 0.0, None, True, "native",
                                       quant_size=QUANT)
    assert module.algo == "native" and module.quant_size == (QUANT,) * 3
    with pytest.raises(TypeError):
        sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, False, "contextual", 0.0, None, True, "native", QUANT)
    with pytest.raises(TypeError, match="attntion_type"):  # a keyword compat does not know is not ignored
        sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, attntion_type="qkv")
    assert sptr.to_3d_numpy(0.3).tolist() == [0.3] * 3 and sptr.to_3d_numpy([1, 2, 3]).tolist() == [1.0, 2.0, 3.0]


def test_half_q_k_v_with_float32_tables_compute_in_the_half_dtype():
    """Under AMP the projections give half q, k, v while the tables stay float32: SpTr's kernels
    return the inputs' dtype, and so does compat."""
    xyz, batch = random_points()
    q, k, v = (torch.randn(len(xyz), 2, 16).half() for _ in range(3))
    tables = [torch.randn(7, 3, 2, 16) * 0.1 for _ in range(3)]
    indices = sptr.get_indices_params(xyz, batch, CUBE, False)
    out = sptr.sparse_self_attention(q, k, v, xyz, *indices, CUBE, False, pe_type="contextual", rel_query=True,
                                     rel_key=True, rel_value=True, quant_size=QUANT, quant_grid_length=4,
                                     relative_pos_query_table=tables[0], relative_pos_key_table=tables[1],
                                     relative_pos_value_table=tables[2])
    reference = sptr.sparse_self_attention(q.float(), k.float(), v.float(), xyz, *indices, CUBE, False,
                                           pe_type="contextual", rel_query=True, rel_key=True, rel_value=True,
                                           quant_size=QUANT, quant_grid_length=4, relative_pos_query_table=tables[0],
                                           relative_pos_key_table=tables[1], relative_pos_value_table=tables[2])
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def test_dtype_computes_in_it_and_returns_the_inputs_dtype():
    """The lh9171338 fork's `dtype=`: q, k, v cast to it, the output cast back to query's dtype."""
    xyz, batch = random_points()
    q, k, v, tables = qkv_and_tables(len(xyz), dtype=torch.float32)
    indices = sptr.get_indices_params(xyz, batch, CUBE, False)
    out = sptr.sparse_self_attention(q, k, v, xyz, *indices, CUBE, False, dtype=torch.float16)
    half = sptr.sparse_self_attention(q.half(), k.half(), v.half(), xyz, *indices, CUBE, False)
    assert out.dtype == torch.float32 and torch.equal(out, half.float())
    with pytest.raises(ValueError, match="dtype must be one of"):
        sptr.sparse_self_attention(q, k, v, xyz, *indices, CUBE, False, dtype=torch.float64)


def test_a_split_function_with_a_required_fifth_parameter_gets_the_grid_length():
    """The lh9171338 fork calls split_func(xyz, index_0, index_1, rel_idx, quant_grid_length);
    SpTr and SphereFormer call it with four (SphereFormer's exponential_split has `a=` fifth)."""
    xyz, batch = random_points()
    q, k, v, tables = qkv_and_tables(len(xyz))
    indices = sptr.get_indices_params(xyz, batch, CUBE, False)
    seen = []

    def fork_split(xyz, index_0, index_1, rel_idx, quant_grid_length):
        seen.append(("fork", quant_grid_length))
        return rel_idx

    def sphereformer_split(xyz, index_0, index_1, rel_idx, a=0.0125):
        seen.append(("sphereformer", a))
        return rel_idx

    outs = [sptr.sparse_self_attention(q, k, v, xyz, *indices, CUBE, False, pe_type="contextual", rel_query=True,
                                       rel_key=True, rel_value=True, quant_size=QUANT, quant_grid_length=4,
                                       relative_pos_query_table=tables[0], relative_pos_key_table=tables[1],
                                       relative_pos_value_table=tables[2], split_func=split)
            for split in (fork_split, sphereformer_split)]
    assert seen == [("fork", 4), ("sphereformer", 0.0125)]
    torch.testing.assert_close(outs[0], contextual_attention(q, k, v, xyz, batch, tables, False))
    assert torch.equal(outs[0], outs[1])


def test_the_module_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="pe_type"):
        sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, pe_type="sine")
    with pytest.raises(ValueError, match="quant_size"):
        sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, pe_type="contextual")
    with pytest.raises(ValueError, match="rel_value"):
        sptr.VarLengthMultiheadSA(32, 2, "key", CUBE, pe_type="contextual", quant_size=QUANT, rel_value=False)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_half_precision_computes_in_its_dtype_and_trains(dtype, tolerance):
    _, contextual = module_pair()
    xyz, batch = random_points()
    feats = torch.randn(len(xyz), 32, dtype=F64)
    expected = contextual(feats, xyz, batch)
    half = contextual.to(dtype).train()
    out = half(feats.to(dtype), xyz, batch)  # the same points: half-precision xyz would move some across windows
    assert out.dtype == dtype
    assert ((out.double() - expected).norm() / expected.norm()) < tolerance
    out.float().square().sum().backward()
    grad = half.relative_pos_value_table.grad
    assert grad.dtype == dtype and grad.isfinite().all() and grad.abs().max() > 0


# ---- the example model and its scene

def test_synthetic_scene_is_voxelized_exactly_and_density_is_a_parameter():
    scene = import_file(Path(EXAMPLE)).synthetic_lidar_scene
    scenes = {steps: scene(20001, steps, seed=1) for steps in (384, 4096)}
    means = []
    for xyz, batch in scenes.values():
        assert xyz.shape == (20001, 3) and xyz.dtype == torch.float32 and batch.bincount().tolist() == [10001, 10000]
        voxels = torch.cat([batch[:, None], torch.floor(xyz / 0.05).long()], 1)
        assert len(torch.unique(voxels, dim=0)) == 20001
        means.append(sptr.window_partition(xyz, batch, 0.3)[2].diff().float().mean())
    assert means[0] < 4 < 8 < means[1]  # voxels per occupied 0.3 m window: sparse vs dense
    assert torch.equal(scene(20001, 384, seed=1)[0], scenes[384][0])
    assert not torch.equal(scene(20001, 384, seed=2)[0], scenes[384][0])


def test_the_example_runs_traces_whole_and_inspects(capsys):
    example = load_model_file(EXAMPLE)
    feats, xyz, batch = example.inputs
    assert not example.model.training and example.logits
    out = example.model(*example.inputs)
    assert out.shape == (len(xyz), 19) and out.isfinite().all()
    trace = find_regions(example.model)
    assert [region.fqn for region in trace.regions] == [""] and not trace.untraced
    assert sptr_calls(trace.regions[0].graph.graph).count(sptr.dot_prod_with_idx_all) == 2
    assert main(["inspect", EXAMPLE, "--device", "cpu"]) == 0
    assert "blocks.1.attn.proj" in capsys.readouterr().out


def test_the_examples_relative_position_moves_its_output_past_the_report_gate():
    """A conversion that lost the tables would then fail sparse-attention-bf16's 25 dB gate."""
    from lowconv.report import tensor_metrics
    example = load_model_file(EXAMPLE)
    without = load_model_file(EXAMPLE).model
    with torch.no_grad():
        for name, table in without.named_parameters():
            if name.endswith("_table"):
                table.zero_()
        assert tensor_metrics(example.model(*example.inputs), without(*example.inputs)).sqnr_db < 20


def test_install_as_stands_for_an_sptr_package():
    """SphereFormer imports SpTr as `third_party.SparseTransformer.sptr`: after install_as, that
    import gives compat, and a package already imported under the name is refused."""
    name = "vendored_for_test.SparseTransformer.sptr"
    sptr.install_as(name)
    try:
        imported = importlib.import_module(name)
        assert imported is sptr
        namespace = {}
        exec(f"from {name} import to_3d_numpy, SparseTrTensor, sparse_self_attention, get_indices_params", namespace)
        assert namespace["sparse_self_attention"] is sptr.sparse_self_attention
        sptr.install_as(name)  # again: already this module
    finally:
        del sys.modules[name]
    sys.modules[name] = types.ModuleType(name)
    try:
        with pytest.raises(ValueError, match=rf"{name} is imported already .*call it before the model's code imports"):
            sptr.install_as(name)
    finally:
        del sys.modules[name]
