"""A real SpTr install (package `sptr`) traced, its chains found and rewritten.

The `sptr` here is a fake written to tmp_path with the real one's layout (compat/sptr_install.py
says where it was read): ops are autograd Functions exposed as `Class.apply` over an extension
module, `sptr_cuda`, that rejects anything but tensors and numbers as a C++ binding does, so a
Proxy cannot get through; it computes with lowconv.compat.sptr. scatter_softmax_csr goes through
a fake torch_scatter of the same kind, and rel_idx is computed inline, as in SpTr's modules.py
(a split function and its clamp included).
"""
import importlib
import operator
import sys
import textwrap

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

import lowconv
from lowconv.compat import sptr as compat
from lowconv.compat import sptr_install
from lowconv.compat.sptr_install import RealOp, as_compat
from lowconv.passes.trace import trace_model
from lowconv.passes.tracer import SiteTracer
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.recipe import parse_recipe

FAKE_SPTR = {
    "sptr_cuda.py": '''
        """Fake SpTr CUDA extension: rejects what a C++ binding would, computes with lowconv's compat ops."""
        import numbers

        import torch

        from lowconv.compat import sptr as compat


        def check(name, *args):
            for arg in args:
                if not isinstance(arg, (torch.Tensor, numbers.Number)):
                    raise TypeError(f"sptr_cuda.{name}(): incompatible argument of type {type(arg).__name__}")


        def binding(name, compute):
            def call(*args):
                check(name, *args)
                return compute(*args)
            return call


        attention_step1_forward = binding("attention_step1_forward", compat.attention_step1)
        attention_step2_forward = binding("attention_step2_forward", compat.attention_step2)
        dot_prod_with_idx_all_forward = binding("dot_prod_with_idx_all_forward", compat.dot_prod_with_idx_all)
        attention_step2_with_rel_pos_value_forward = binding("attention_step2_with_rel_pos_value_forward",
                                                             compat.attention_step2_with_rel_pos_value)
        precompute_all = binding("precompute_all", compat.precompute_all)
    ''',
    "torch_scatter.py": '''
        """Fake torch_scatter (a C++ extension too): its CSR ops, rejecting a Proxy."""
        import torch

        from sptr_cuda import check


        def segment_csr(src, indptr, out=None, reduce="sum"):
            check("segment_csr", src, indptr)
            return torch.segment_reduce(src, reduce, offsets=indptr)


        def gather_csr(src, indptr, out=None):
            check("gather_csr", src, indptr)
            return src.repeat_interleave(indptr.diff(), 0)
    ''',
    "{package}/__init__.py": '''
        from .functional import *  # noqa: F403
        from .utils import *  # noqa: F403


        class SparseTrTensor:
            def __init__(self, query_feats, query_indices, spatial_shape, batch_size, key_feats=None,
                         value_feats=None, key_indices=None):
                self.query_feats, self.key_feats, self.value_feats = query_feats, key_feats, value_feats
                self.query_indices, self.key_indices = query_indices, key_indices
                self.spatial_shape, self.batch_size = spatial_shape, batch_size
                self.indice_dict = {}

            def find_indice_params(self, key):
                return self.indice_dict.get(key)


        from .modules import VarLengthMultiheadSA, sparse_self_attention  # noqa: E402
    ''',
    "{package}/functional.py": '''
        import sptr_cuda
        from torch.autograd import Function


        class AttentionStep1(Function):
            @staticmethod
            def forward(ctx, q, k, index0, index0_offsets, index1, index1_offsets, n_max):
                return sptr_cuda.attention_step1_forward(q, k, index0, index0_offsets, index1, index1_offsets, n_max)


        attention_step1 = AttentionStep1.apply


        class AttentionStep2(Function):
            @staticmethod
            def forward(ctx, attn, v, index0, index0_offsets, index1, index1_offsets, n_max):
                return sptr_cuda.attention_step2_forward(attn, v, index0, index0_offsets, index1, index1_offsets, n_max)


        attention_step2 = AttentionStep2.apply


        class PrecomputeAll(Function):
            @staticmethod
            def forward(ctx, N, n, n_max, counts):
                return sptr_cuda.precompute_all(N, n, n_max, counts)


        precompute_all = PrecomputeAll.apply


        class DotProdWithIdxAll(Function):
            @staticmethod
            def forward(ctx, q, index_q, index_q_offsets, k, index_k, index_k_offsets, table_q, table_k, rel_idx,
                        n_max):
                return sptr_cuda.dot_prod_with_idx_all_forward(q, index_q, index_q_offsets, k, index_k,
                                                               index_k_offsets, table_q, table_k, rel_idx, n_max)


        dot_prod_with_idx_all = DotProdWithIdxAll.apply


        class AttentionStep2WithRelPosValue(Function):
            @staticmethod
            def forward(ctx, attn, v, index0, index0_offsets, n_max, index1, index1_offsets, table, rel_idx):
                return sptr_cuda.attention_step2_with_rel_pos_value_forward(
                    attn, v, index0, index0_offsets, n_max, index1, index1_offsets, table, rel_idx)


        attention_step2_with_rel_pos_value = AttentionStep2WithRelPosValue.apply
    ''',
    "{package}/utils.py": '''
        import numbers

        import numpy as np
        from torch_scatter import gather_csr, segment_csr

        from lowconv.compat.sptr import window_partition  # stands in for torch_geometric's voxel_grid

        from . import precompute_all


        def to_3d_numpy(size):
            if isinstance(size, numbers.Number):
                return np.array([size, size, size]).astype(np.float32)
            return np.array(size)


        def get_indices_params(xyz, batch, window_size, shift_win: bool):
            _, sort_idx, window_offsets = window_partition(xyz, batch, window_size, shift_win)
            counts = window_offsets.diff()
            n_max = counts.max().item()
            index_0_offsets, index_1_offsets, index_0, index_1 = precompute_all(
                sort_idx.shape[0], counts.shape[0], n_max, counts)
            return index_0.long(), index_0_offsets, n_max, index_1.long(), index_1_offsets, sort_idx


        def scatter_softmax_csr(src, indptr, dim=-1):
            max_per_src_element = gather_csr(segment_csr(src, indptr, reduce="max"), indptr)
            exp = (src - max_per_src_element).exp_()
            return exp.div(gather_csr(segment_csr(exp, indptr, reduce="sum"), indptr))
    ''',
    "{package}/modules.py": '''
        import torch
        from torch import nn

        from . import SparseTrTensor
        from .functional import (attention_step1, attention_step2, attention_step2_with_rel_pos_value,
                                 dot_prod_with_idx_all)
        from .utils import get_indices_params, scatter_softmax_csr, to_3d_numpy


        def sparse_self_attention(query, key, value, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                                  sort_idx, window_size, shift_win, pe_type="none", rel_query=False, rel_key=False,
                                  rel_value=False, quant_size=None, quant_grid_length=None,
                                  relative_pos_query_table=None, relative_pos_key_table=None,
                                  relative_pos_value_table=None, split_func=None):
            query, key, value, xyz_ctg = query[sort_idx], key[sort_idx], value[sort_idx], xyz[sort_idx]
            if pe_type == "contextual" and rel_query and rel_key:
                window_size = torch.from_numpy(window_size).float().to(xyz.device)  # SpTr: .cuda()
                shift_size = 1 / 2 * window_size if shift_win else 0.0
                xyz_quant = (xyz_ctg - xyz_ctg.min(0)[0] + shift_size) % window_size
                xyz_quant = torch.div(xyz_quant, torch.from_numpy(quant_size).float().to(xyz.device),
                                      rounding_mode="floor")
                relative_position = xyz_quant[index_0.long()] - xyz_quant[index_1.long()]
                relative_position_index = relative_position + quant_grid_length - 1
                if split_func:
                    relative_position_index = split_func(xyz_ctg, index_0, index_1, relative_position_index.clone())
                    relative_position_index = torch.clamp(relative_position_index, 0, 2 * quant_grid_length - 1)
                relative_position_index = relative_position_index.int()
                attn_flat = dot_prod_with_idx_all(query, index_0, index_0_offsets, key, index_1, index_1_offsets,
                                                  relative_pos_query_table, relative_pos_key_table,
                                                  relative_position_index, n_max)
            else:
                attn_flat = attention_step1(query, key, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
            softmax_attn_flat = scatter_softmax_csr(src=attn_flat, indptr=index_0_offsets.long(), dim=0)
            if pe_type == "contextual" and rel_value:
                x = attention_step2_with_rel_pos_value(softmax_attn_flat, value, index_0, index_0_offsets, n_max,
                                                       index_1, index_1_offsets, relative_pos_value_table,
                                                       relative_position_index)
            else:
                x = attention_step2(softmax_attn_flat, value, index_0, index_0_offsets, index_1, index_1_offsets,
                                    n_max)
            out = torch.empty_like(x)
            out[sort_idx] = x
            return out


        class VarLengthMultiheadSA(nn.Module):
            def __init__(self, embed_dim, num_heads, indice_key, window_size, shift_win=False, pe_type="none",
                         dropout=0.0, qk_scale=None, qkv_bias=True, algo="native", **kwargs):
                super().__init__()
                self.embed_dim, self.num_heads, self.indice_key = embed_dim, num_heads, indice_key
                self.shift_win, self.pe_type = shift_win, pe_type
                self.scale = qk_scale or (embed_dim // num_heads) ** -0.5
                self.window_size = to_3d_numpy(window_size)
                self.q = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
                self.k = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
                self.v = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
                self.proj = nn.Linear(embed_dim, embed_dim)
                self.proj_drop = nn.Dropout(dropout, inplace=True)

            def forward(self, sptr_tensor: SparseTrTensor):
                query, key, value = sptr_tensor.query_feats, sptr_tensor.key_feats, sptr_tensor.value_feats
                if key is None:
                    key = query.clone()
                if value is None:
                    value = query.clone()
                xyz = sptr_tensor.query_indices[:, 1:]
                batch = sptr_tensor.query_indices[:, 0]
                N, C = query.shape
                query = self.q(query).reshape(N, self.num_heads, C // self.num_heads)
                key = self.k(key).reshape(N, self.num_heads, C // self.num_heads)
                value = self.v(value).reshape(N, self.num_heads, C // self.num_heads)
                query = query * self.scale
                index_params = sptr_tensor.find_indice_params(self.indice_key)
                if index_params is None:
                    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = get_indices_params(
                        xyz, batch, self.window_size, self.shift_win)
                    sptr_tensor.indice_dict[self.indice_key] = (index_0, index_0_offsets, n_max, index_1,
                                                                index_1_offsets, sort_idx, self.window_size,
                                                                self.shift_win)
                else:
                    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx, _, _ = index_params
                x = sparse_self_attention(query=query.float(), key=key.float(), value=value.float(), xyz=xyz.float(),
                                          index_0=index_0.int(), index_0_offsets=index_0_offsets.int(), n_max=n_max,
                                          index_1=index_1.int(), index_1_offsets=index_1_offsets.int(),
                                          sort_idx=sort_idx, window_size=self.window_size, shift_win=self.shift_win)
                x = self.proj_drop(self.proj(x.view(N, C)))
                return SparseTrTensor(x, sptr_tensor.query_indices, sptr_tensor.spatial_shape, sptr_tensor.batch_size)
    ''',
    # Model code, as a model file would call SpTr.
    "sptr_models.py": '''
        import torch
        from torch import nn

        import {package} as sptr
        import {package}.functional as F
        import {package}.utils as U
        from {package} import (attention_step1, attention_step2, get_indices_params, scatter_softmax_csr,
                               sparse_self_attention)


        class Scores(nn.Module):
            def forward(self, q, k, index_0, index_0_offsets, index_1, index_1_offsets):
                return sptr.functional.attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, 8)


        class Chain(nn.Module):
            """SpTr's plain chain, its ops called through the package (`sptr.functional.attention_step1`),
            through a module alias (`F.attention_step1`) or by name (`from sptr import attention_step1`)."""

            def __init__(self, style):
                super().__init__()
                self.style = style
                self.qkv = nn.Linear(32, 96)

            def forward(self, feats, xyz, batch):
                q, k, v = self.qkv(feats).reshape(-1, 3, 2, 16).unbind(1)
                index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = get_indices_params(
                    xyz, batch, 0.3, False)
                q, k, v = q[sort_idx] * 0.25, k[sort_idx], v[sort_idx]
                layout = (index_0, index_0_offsets, index_1, index_1_offsets, n_max)
                if self.style == "package":
                    attn = sptr.functional.attention_step1(q, k, *layout)
                    attn = sptr.scatter_softmax_csr(attn, index_0_offsets.long(), dim=0)
                    x = sptr.functional.attention_step2(attn, v, *layout)
                elif self.style == "alias":
                    attn = F.attention_step1(q, k, *layout)
                    attn = U.scatter_softmax_csr(attn, index_0_offsets.long(), dim=0)
                    x = F.attention_step2(attn, v, *layout)
                else:
                    attn = attention_step1(q, k, *layout)
                    attn = scatter_softmax_csr(attn, index_0_offsets.long(), dim=0)
                    x = attention_step2(attn, v, *layout)
                return torch.empty_like(x).index_copy(0, sort_idx, x).flatten(1)


        class Block(nn.Module):
            """SpTr's VarLengthMultiheadSA on a SparseTrTensor, as SphereFormer's blocks call it."""

            def __init__(self):
                super().__init__()
                self.attn = sptr.VarLengthMultiheadSA(32, 2, "windows", 0.3)

            def forward(self, feats, xyz, batch):
                tensor = sptr.SparseTrTensor(feats, torch.cat([batch[:, None], xyz], 1), spatial_shape=None,
                                             batch_size=None)
                return self.attn(tensor).query_feats


        def radial_split(xyz, index_0, index_1, relative_position_index):
            """Of the kind of SphereFormer's exponential_split: the radial column rewritten in place."""
            rel_pos = xyz[:, 2][index_0.long()] - xyz[:, 2][index_1.long()]
            relative_position_index[:, 2] = torch.sign(rel_pos) * 2 + 5  # rows 3, 5, 7 of 11
            return relative_position_index


        class Contextual(nn.Module):
            """sparse_self_attention with contextual relative position (rel_idx inline), as SphereFormer calls it."""

            def __init__(self, shift_win=False, split_func=None):
                super().__init__()
                self.shift_win, self.split_func = shift_win, split_func
                self.qkv = nn.Linear(32, 96)
                self.tables = nn.Parameter(torch.randn(3, 11, 3, 2, 16) * 0.5)  # 2G-1 rows, G = 6
                self.window_size, self.quant_size = sptr.to_3d_numpy(0.3), sptr.to_3d_numpy(0.3 / 6)

            def forward(self, feats, xyz, batch):
                q, k, v = self.qkv(feats).reshape(-1, 3, 2, 16).unbind(1)
                index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = get_indices_params(
                    xyz, batch, self.window_size, self.shift_win)
                x = sparse_self_attention(
                    q * 0.25, k, v, xyz, index_0.int(), index_0_offsets.int(), n_max, index_1.int(),
                    index_1_offsets.int(), sort_idx, self.window_size, self.shift_win, pe_type="contextual",
                    rel_query=True, rel_key=True, rel_value=True, quant_size=self.quant_size, quant_grid_length=6,
                    relative_pos_query_table=self.tables[0], relative_pos_key_table=self.tables[1],
                    relative_pos_value_table=self.tables[2], split_func=self.split_func)
                return x.flatten(1)


        # rel_idx written other ways, from the differences d = P[index_0] - P[index_1] (G = 6, tables of 11 rows).
        REL_IDX = {
            "folded": lambda d: (5 + d).long(),
            "clamped": lambda d: torch.clamp(d + 6 - 1, 0, 11).int(),  # as SpTr clamps after a split function
            "narrowly clamped": lambda d: (d + 5).clamp(0, 8).int(),
            "negated": lambda d: (5 - d).int(),
        }


        class Written(nn.Module):
            """SpTr's chain written out in a model, its ops called positionally or by their own keyword names
            (index0, index_q, table): plain (rel_idx "none") or contextual, rel_idx inline as REL_IDX says or
            "unrounded" (coordinates not floored)."""

            def __init__(self, rel_idx="none", keywords=False):
                super().__init__()
                self.rel_idx, self.keywords = rel_idx, keywords
                self.qkv = nn.Linear(32, 96)
                self.tables = nn.Parameter(torch.randn(3, 11, 3, 2, 16) * 0.5)

            def forward(self, feats, xyz, batch):
                q, k, v = self.qkv(feats).reshape(-1, 3, 2, 16).unbind(1)
                index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = get_indices_params(
                    xyz, batch, 0.3, False)
                q, k, v, xyz = q[sort_idx] * 0.25, k[sort_idx], v[sort_idx], xyz[sort_idx]
                index_0, index_0_offsets, index_1, index_1_offsets = (
                    t.int() for t in (index_0, index_0_offsets, index_1, index_1_offsets))
                if self.rel_idx == "none":
                    x = self.plain(q, k, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets)
                else:
                    x = self.contextual(q, k, v, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets)
                return torch.empty_like(x).index_copy(0, sort_idx, x).flatten(1)

            def plain(self, q, k, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets):
                if self.keywords:
                    layout = dict(index0=index_0, index0_offsets=index_0_offsets, index1=index_1,
                                  index1_offsets=index_1_offsets, n_max=n_max)
                    attn = attention_step1(q, k, **layout)
                    attn = scatter_softmax_csr(src=attn, indptr=index_0_offsets.long(), dim=0)
                    return attention_step2(attn, v, **layout)
                attn = attention_step1(q, k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
                attn = scatter_softmax_csr(attn, index_0_offsets.long(), dim=0)
                return attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)

            def contextual(self, q, k, v, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets):
                in_window = (xyz - xyz.min(0)[0]) % 0.3
                quant = in_window / 0.05 if self.rel_idx == "unrounded" else in_window // 0.05
                d = quant[index_0.long()] - quant[index_1.long()]
                rel_idx = (d + 5).int() if self.rel_idx == "unrounded" else REL_IDX[self.rel_idx](d)
                if self.keywords:
                    attn = F.dot_prod_with_idx_all(
                        q, index_q=index_0, index_q_offsets=index_0_offsets, k=k, index_k=index_1,
                        index_k_offsets=index_1_offsets, table_q=self.tables[0], table_k=self.tables[1],
                        rel_idx=rel_idx, n_max=n_max)
                    attn = scatter_softmax_csr(src=attn, indptr=index_0_offsets.long(), dim=0)
                    return F.attention_step2_with_rel_pos_value(
                        attn, v, index0=index_0, index0_offsets=index_0_offsets, n_max=n_max, index1=index_1,
                        index1_offsets=index_1_offsets, table=self.tables[2], rel_idx=rel_idx)
                attn = F.dot_prod_with_idx_all(q, index_0, index_0_offsets, k, index_1, index_1_offsets,
                                               self.tables[0], self.tables[1], rel_idx, n_max)
                attn = scatter_softmax_csr(attn, index_0_offsets.long(), dim=0)
                return F.attention_step2_with_rel_pos_value(attn, v, index_0, index_0_offsets, n_max, index_1,
                                                            index_1_offsets, self.tables[2], rel_idx)
    ''',
}
FLOAT32 = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')


FAKE_TOP_LEVEL = {"sptr", "third_party", "sptr_cuda", "torch_scatter", "sptr_models"}


@pytest.fixture(autouse=True)
def restored_modules():
    """The fake modules a test imports are gone after it."""
    yield
    for name in [name for name in sys.modules if name.partition(".")[0] in FAKE_TOP_LEVEL]:
        del sys.modules[name]


def write_fake_sptr(root, package="sptr"):
    for path, source in FAKE_SPTR.items():
        file = root.joinpath(*path.format(package=package.replace(".", "/")).split("/"))
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(source).replace("{package}", package))


def import_models(tmp_path, monkeypatch, package="sptr"):
    """The fake SpTr installed as `package` (vendored: "third_party.SparseTransformer.sptr") and the
    model code importing it."""
    write_fake_sptr(tmp_path, package)
    monkeypatch.syspath_prepend(tmp_path)
    importlib.invalidate_caches()
    return importlib.import_module("sptr_models")


@pytest.fixture
def models(tmp_path, monkeypatch):
    return import_models(tmp_path, monkeypatch)


def scene(n=300):
    torch.manual_seed(0)
    xyz = torch.rand(n, 3) * torch.tensor([1.5, 1.5, 0.6])
    return torch.randn(n, 32), xyz, (torch.arange(n) >= n // 2).long()


def compat_targets(graph: fx.Graph) -> list:
    """The call_function targets, real SpTr ops read as their compat functions."""
    return [as_compat(n.target) for n in graph.nodes if n.op == "call_function"]


def sptr_ops(graph: fx.Graph) -> list:
    """The SpTr ops (not index helpers) left in a graph, real or compat."""
    return [op for op in compat_targets(graph) if op in compat.SPTR_OPS + (compat.relative_position_index,)]


def test_the_fake_extension_rejects_a_proxy_so_only_lowconv_traces_it(models):
    with pytest.raises(TypeError, match=r"sptr_cuda\.attention_step1_forward\(\): incompatible argument of type Proxy"):
        fx.symbolic_trace(models.Scores())
    graph = SiteTracer().trace(models.Scores())
    [op] = [n.target for n in graph.nodes if n.op == "call_function"]
    assert isinstance(op, RealOp) and op.compat is compat.attention_step1


@pytest.mark.parametrize("style", ["package", "alias", "name"])
def test_each_call_style_traces_to_single_op_nodes_and_one_site(models, style):
    trace = trace_model(models.Chain(style).eval(), scene())
    [region] = trace.regions
    targets = compat_targets(region.graph.graph)
    for op in (compat.get_indices_params, compat.attention_step1, compat.scatter_softmax_csr, compat.attention_step2):
        assert targets.count(op) == 1
    [site] = find_window_attention_sites(region)
    assert site.unsupported is None
    assert (site.info.form, site.info.heads, site.info.head_dim, site.info.rel_pos) == ("window", 2, 16, "none")


MODELS = {
    "package": lambda models: models.Chain("package"),
    "alias": lambda models: models.Chain("alias"),
    "name": lambda models: models.Chain("name"),
    "block": lambda models: models.Block(),
    "contextual": lambda models: models.Contextual(),
    "contextual, shifted windows": lambda models: models.Contextual(shift_win=True),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_conversion_leaves_no_sptr_op_and_matches(models, model, tmp_path):
    model, inputs = MODELS[model](models).eval(), scene()
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert [d.op for d in converted.lowconv_plan.converted()] == ["sparse_attention"]
    assert not sptr_ops(converted.graph)
    assert 40 < lowconv.compare(model, converted, inputs).sites[0].alone.sqnr_db < 70  # bf16 operands
    lowconv.save(converted, tmp_path / "converted")
    with torch.no_grad():
        assert torch.equal(lowconv.load(model, tmp_path / "converted")(*inputs), converted(*inputs))
        torch.testing.assert_close(lowconv.convert(model, FLOAT32, inputs)(*inputs), model(*inputs),
                                   rtol=1e-4, atol=1e-5)


def test_a_real_get_indices_params_stays(models):
    """Its windows and sort order need not be compat's (ops/window_rows.py): the converted chain
    reads its pair layout, not compat's get_window_rows."""
    model, inputs = models.Block().eval(), scene()
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    [indices] = [n.target for n in converted.graph.nodes if as_compat(n.target) is compat.get_indices_params]
    assert isinstance(indices, RealOp) and compat.get_window_rows not in compat_targets(converted.graph)


def pair_sized(gm: fx.GraphModule, inputs) -> list[str]:
    """The nodes that compute something with a row per (query, key) pair; the pair layout's own
    outputs (get_indices_params' tuple items) aside."""
    n_pairs = len(compat.get_indices_params(inputs[1], inputs[2], 0.3, False)[0])
    ShapeProp(gm).propagate(*inputs)
    return [node.name for node in gm.graph.nodes
            if getattr(node.meta.get("tensor_meta"), "shape", (0,))[:1] == (n_pairs,)
            and not (node.target is operator.getitem and as_compat(node.args[0].target) is compat.get_indices_params)]


def test_inline_rel_idx_goes_with_the_chain(models):
    model, inputs = models.Contextual().eval(), scene()
    assert pair_sized(trace_model(model, inputs).regions[0].graph, inputs)  # rel_idx, the ops, the index casts
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None and site.info.rel_pos == "contextual"
    coords, grid_length = site.args[-1], site.args[8]
    assert (coords.target, coords.kwargs, grid_length) == (torch.div, {"rounding_mode": "floor"}, 6)
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert not pair_sized(converted, inputs)


@pytest.mark.parametrize("rel_idx", ["folded", "clamped"])
def test_inline_rel_idx_written_otherwise_converts(models, rel_idx):
    model, inputs = models.Written(rel_idx).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None and site.args[8] == 6
    with torch.no_grad():
        torch.testing.assert_close(lowconv.convert(model, FLOAT32, inputs)(*inputs), model(*inputs),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rel_idx, why", [
    ("narrowly clamped", "a clamp (a `.clamp()` call) to other bounds than [0, 10] or wider can change its values"),
    ("negated", "less its casts, clamps and added numbers it is made by a call of `sub`, not P[index_0] - P[index_1]"),
    ("unrounded", "its coordinates are made by a call of `truediv`, which need not give whole numbers"),
])
def test_inline_rel_idx_of_another_form_is_kept_with_why(models, rel_idx, why):
    model, inputs = models.Written(rel_idx).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported.startswith("rel_idx is not relative_position_index(...) of the points, nor SpTr's inline")
    assert why in site.unsupported


def test_rel_idx_rewritten_by_a_split_function_converts(models):
    """radial_split writes sign(d) * 2 + 5 of the radial differences d: buckets 3, 5, 7, two
    thresholds at 0.0 and two at the least positive float."""
    model, inputs = models.Contextual(split_func=models.radial_split).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None and site.info.rel_pos == "contextual, axis 2 split into buckets 3 to 7"
    tiny = float(torch.finfo(torch.float32).smallest_normal) * 2.0 ** -23
    assert site.args[-1] == (2, 3, (0.0, 0.0, tiny, tiny))
    converted = lowconv.convert(model, FLOAT32, inputs)
    [decision] = [d for d in converted.lowconv_plan.decisions if d.fqn == site.fqn]
    assert decision.op == "sparse_attention"
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def function_apply_takes_keywords() -> bool:
    """Whether this torch's autograd.Function.apply accepts keyword arguments (2.11 does not, so
    there a real SpTr op called by keyword fails in the model itself, before lowconv sees it)."""
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    try:
        Identity.apply(x=torch.zeros(1))
    except TypeError:
        return False
    return True


needs_apply_keywords = pytest.mark.skipif(not function_apply_takes_keywords(),
                                          reason="this torch's Function.apply takes no keyword arguments")


@needs_apply_keywords
@pytest.mark.parametrize("rel_idx", ["none", "folded"])
def test_ops_called_by_their_own_keyword_names_are_read(models, rel_idx):
    model, inputs = models.Written(rel_idx, keywords=True).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported is None
    with torch.no_grad():
        torch.testing.assert_close(lowconv.convert(model, FLOAT32, inputs)(*inputs), model(*inputs),
                                   rtol=1e-4, atol=1e-5)


@needs_apply_keywords
def test_keywords_of_an_op_whose_signature_cannot_be_read_keep_the_chain_with_why(models, monkeypatch):
    monkeypatch.setattr(sptr_install, "parameter_names", lambda real: None)
    model, inputs = models.Written("folded", keywords=True).eval(), scene()
    [site] = find_window_attention_sites(trace_model(model, inputs).regions[0])
    assert site.unsupported == (
        "`dot_prod_with_idx_all` is called with keywords that lowconv cannot place among its parameters "
        "(index_q, index_q_offsets, index_k, index_k_offsets); `attention_step2_with_rel_pos_value` is called "
        "with keywords that lowconv cannot place among its parameters (index0, index0_offsets, index1, "
        "index1_offsets, table)")
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    with torch.no_grad():
        assert torch.equal(converted(*inputs), model(*inputs))


def test_a_vendored_copy_is_found_too(tmp_path, monkeypatch):
    models = import_models(tmp_path, monkeypatch, "third_party.SparseTransformer.sptr")
    assert "sptr" not in sys.modules
    [site] = find_window_attention_sites(trace_model(models.Chain("name").eval(), scene()).regions[0])
    assert site.unsupported is None


def test_an_importable_sptr_is_never_imported(tmp_path, monkeypatch):
    write_fake_sptr(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)
    trace_model(compat.VarLengthMultiheadSA(32, 2, "w", 0.3).eval(), scene())
    assert not {"sptr", "sptr_cuda"} & set(sys.modules)
