"""What of the cuSPARSELt path can be checked without a GPU: shape and dtype rules, the dense
operand's layouts, the backend choice's fixed cases, the options that select it, and the custom
ops as torch.compile traces them (fake implementations, backward formulas)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lowconv.errors import LowconvError
from lowconv.kernels import cusparselt
from lowconv.kernels.cusparselt import SparseGemm, dense_operand, shape_problem
from lowconv.kernels.sparse24 import (GemmCase, choose_backend, compress_bitmask, compressed_linear,
                                      fixed_mask_linear, mask_24_transposable, prune_24)
from tests.compiled import lowconv_ops
from lowconv.ops.semi_sparse import CompressedSemiSparseLinear, SemiSparse, SemiSparseOptions
from tests.sites import linear_site

from_site, site_problem = SemiSparse.from_site, SemiSparse.site_problem


def test_unsupported_shapes_and_dtypes_say_why():
    assert shape_problem(4096, 1024, torch.float16) is None
    assert shape_problem(32, 48, torch.bfloat16) is None
    assert shape_problem(24, 64, torch.float16) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (24, 64))")
    assert shape_problem(32, 40, torch.float16) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (32, 40))")
    assert shape_problem(32, 64, torch.float32) == (
        "cuSPARSELt's 2:4 GEMM takes float16 or bfloat16 (this weight is float32)")


def test_sparse_gemm_needs_a_cuda_device():
    with pytest.raises(LowconvError, match="cuSPARSELt runs on CUDA devices, not cpu"):
        SparseGemm(32, 64, torch.float16, torch.device("cpu"))


@pytest.mark.parametrize("rows", [16, 24])
def test_dense_operand_reads_row_and_column_major_x_as_it_lies(rows):
    x = torch.randn(rows, 32, dtype=torch.float16)
    same, row_major = dense_operand(x)
    assert row_major and same.data_ptr() == x.data_ptr()
    column_major = x.t().contiguous().t()
    same, row_major = dense_operand(column_major)
    assert not row_major and same.data_ptr() == column_major.data_ptr()


def test_dense_operand_pads_rows_and_copies_what_it_cannot_read():
    x = torch.randn(13, 32, dtype=torch.bfloat16)
    padded, row_major = dense_operand(x)
    assert row_major and padded.shape == (16, 32) and padded.is_contiguous()
    assert torch.equal(padded[:13], x) and not padded[13:].any()
    wide = torch.randn(16, 64, dtype=torch.float16)
    for strided in (wide[:, 32:], wide[:, 1:33]):  # row stride 64 != K; then an unaligned start as well
        copy, row_major = dense_operand(strided)
        assert row_major and copy.is_contiguous() and copy.data_ptr() % 16 == 0 and torch.equal(copy, strided)


def case(**changes):
    return GemmCase(**{**dict(rows=64, out_features=32, in_features=64, dtype=torch.float16, has_bias=True,
                              device=torch.device("cpu")), **changes})


def test_backend_choice_without_measuring():
    assert choose_backend("masked-dense", case()).backend == "masked-dense"
    with pytest.raises(LowconvError, match="backend = cusparselt: cuSPARSELt runs on CUDA devices"):
        choose_backend("cusparselt", case())
    auto = choose_backend("auto", case())
    assert auto.backend == "masked-dense" and auto.sparse_ms is None and "CUDA devices" in auto.reason


def test_cusparselt_backend_is_for_fixed_weight_masks():
    with pytest.raises(ValueError, match="built for a fixed weight mask only"):
        SemiSparseOptions(backend="cusparselt", mask="runtime")
    with pytest.raises(ValueError, match="built for a fixed weight mask only"):
        SemiSparseOptions(backend="cusparselt", target="activation")
    assert SemiSparseOptions(backend="auto", mask="runtime").backend == "auto"  # auto runs masked-dense there


def test_check_keeps_sites_cusparselt_cannot_take():
    options = SemiSparseOptions(backend="cusparselt")
    assert site_problem(linear_site(64, 32), options) is None
    assert site_problem(linear_site(64, 24), options) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (24, 64))")
    assert site_problem(linear_site(64, 32, dtype="float32"), options) == (
        "cuSPARSELt's 2:4 GEMM takes float16 or bfloat16 (this weight is float32)")
    transposed = SemiSparseOptions(backend="cusparselt", training=True, transposable=True)
    assert site_problem(linear_site(40, 32), transposed) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (32, 40))")
    assert site_problem(linear_site(40, 32), SemiSparseOptions()) is None  # auto: masked-dense where it cannot


def test_compressed_module_on_the_cpu_keeps_no_choice_and_one_dense_copy():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    module = from_site(linear_site(64, 32, dtype="bfloat16"), SemiSparseOptions(), {"weight": w, "bias": torch.zeros(32)})
    assert isinstance(module, CompressedSemiSparseLinear) and module.rows == 8
    assert module.dense_weight.numel() == 0  # made on the first masked-dense forward
    y = module(torch.randn(8, 64, dtype=torch.bfloat16))
    assert y.shape == (8, 32) and module.choice is None and module.dense_weight.shape == (32, 64)
    assert torch.equal(module.linear_weight(), module.dense_weight)
    assert set(module.state_dict()) == {"compressed", "bitmask", "shape", "bias"}


def traced_step(op_call, leaves, others):
    """make_fx on fake tensors of y = op_call(*leaves, *others) and the gradients of y.sum() w.r.t.
    the leaves: the ops' fake implementations and backward formulas run, no kernel does."""
    def step(*tensors):
        y = op_call(*tensors)
        return (y, *torch.autograd.grad(y.sum(), tensors[:len(leaves)]))
    graph = make_fx(step, tracing_mode="fake")(*(t.requires_grad_() for t in leaves), *others)
    return graph, [node.meta["val"] for node in graph.graph.output_node().args[0]]


def test_the_compressed_layers_op_traces_with_its_gradients():
    """lowconv::sparse24_linear: y (..., N) as cuSPARSELt writes it (y^T row-major, M padded to 8),
    and dX = dY W from the bitmask format."""
    values, bitmask, _ = compress_bitmask(prune_24(torch.randn(32, 64)))
    sparse_weight = torch.empty(1234, dtype=torch.uint8)  # cuSPARSELt's layout: only the GPU makes it
    graph, (y, grad_x, grad_bias) = traced_step(
        lambda x, bias, sparse_weight, values, bitmask: compressed_linear(x, sparse_weight, bias, values, bitmask, 7,
                                                                          True),
        (torch.randn(2, 5, 64), torch.randn(32)), (sparse_weight, values, bitmask))
    assert y.shape == (2, 5, 32) and y.stride() == (5, 1, 16)
    assert grad_x.shape == (2, 5, 64) and grad_bias.shape == (32,)
    assert lowconv_ops([graph]) == {"lowconv::sparse24_linear"}


class StandInGemms:
    """What the fixed-mask op's backward formula reads of a layer's TrainingGemms: whether W^T has
    a 2:4 GEMM (a transposable mask)."""

    def __init__(self, transposable: bool):
        self.backward = object() if transposable else None


@pytest.mark.parametrize("transposable", [False, True])
def test_the_fixed_mask_ops_trace_with_their_gradients(transposable):
    """lowconv::sparse24_fixed_mask_linear and its backward's ops: dX through W^T's 2:4 GEMM op, W^T
    packed by transpose_kept, where the mask is transposable (else a dense product in the graph);
    dW packed in torch ops, in the graph."""
    gemms = StandInGemms(transposable)
    key = cusparselt.register(gemms)
    mask = mask_24_transposable(torch.randn(32, 64))
    graph, (y, grad_x, grad_kept, grad_bias) = traced_step(
        lambda x, kept, bias, mask: fixed_mask_linear(x, kept, mask, bias, key),
        (torch.randn(13, 64), torch.randn(32, 32), torch.randn(32)), (mask,))
    assert y.shape == (13, 32) and y.stride() == (1, 16)
    assert grad_x.shape == (13, 64) and grad_kept.shape == (32, 32) and grad_bias.shape == (32,)
    backward = {"lowconv::sparse24_fixed_mask_grad_input", "lowconv::transpose_kept"} if transposable else set()
    assert lowconv_ops([graph]) == {"lowconv::sparse24_fixed_mask_linear"} | backward


def test_an_op_given_an_unknown_gemm_says_so():
    with pytest.raises(LowconvError, match="no cuSPARSELt GEMM is registered under key -1"):
        cusparselt.registered(-1)
