"""What of the cuSPARSELt path can be checked without a GPU: shape and dtype rules, the dense
operand's layouts, the backend choice's fixed cases, and the options that select it."""
import pytest
import torch

from lowconv.errors import LowconvError
from lowconv.kernels.cusparselt import SparseGemm, dense_operand, unsupported_shape_reason
from lowconv.kernels.sparse24 import GemmCase, choose_backend
from lowconv.ops.semi_sparse import CompressedSemiSparseLinear, SemiSparseOptions, check, from_site
from tests.sites import linear_site


def test_unsupported_shapes_and_dtypes_say_why():
    assert unsupported_shape_reason(4096, 1024, torch.float16) is None
    assert unsupported_shape_reason(32, 48, torch.bfloat16) is None
    assert unsupported_shape_reason(24, 64, torch.float16) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (24, 64))")
    assert unsupported_shape_reason(32, 40, torch.float16) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (32, 40))")
    assert unsupported_shape_reason(32, 64, torch.float32) == (
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
    assert check(linear_site(64, 32), options) is None
    assert check(linear_site(64, 24), options) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (24, 64))")
    assert check(linear_site(64, 32, dtype="float32"), options) == (
        "cuSPARSELt's 2:4 GEMM takes float16 or bfloat16 (this weight is float32)")
    transposed = SemiSparseOptions(backend="cusparselt", training=True, transposable=True)
    assert check(linear_site(40, 32), transposed) == (
        "cuSPARSELt needs out_features and in_features multiples of 16 (weight is (32, 40))")
    assert check(linear_site(40, 32), SemiSparseOptions()) is None  # auto: masked-dense where it cannot


def test_compressed_module_on_the_cpu_keeps_no_choice_and_one_dense_copy():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    module = from_site(linear_site(64, 32, dtype="bfloat16"), SemiSparseOptions(), {"weight": w, "bias": torch.zeros(32)})
    assert isinstance(module, CompressedSemiSparseLinear) and module.rows == 8
    assert module.dense_weight.numel() == 0  # made on the first masked-dense forward
    y = module(torch.randn(8, 64, dtype=torch.bfloat16))
    assert y.shape == (8, 32) and module.choice is None and module.dense_weight.shape == (32, 64)
    assert torch.equal(module.linear_weight(), module.dense_weight)
    assert set(module.state_dict()) == {"compressed", "bitmask", "shape", "bias"}
