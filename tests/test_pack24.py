"""The kept-values kernels of fixed-mask 2:4 training (lowconv/kernels/pack24.py): the gather and
W^T's packing from W's kept values (Triton's interpreter on the CPU, compiled on a GPU) against
their torch references and against the values the mask keeps, row-major."""
import pytest
import torch

from lowconv.errors import LowconvError
from lowconv.kernels import pack24
from lowconv.kernels.pack24 import (kept_codes, pack_kept, pack_kept_into, pack_kept_reference, transpose_kept,
                                    transpose_kept_into, transpose_kept_reference, unpack_kept)
from lowconv.kernels.sparse24 import mask_24, mask_24_transposable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kept_row_major(w, mask):
    return w[mask].reshape(w.shape[0], w.shape[1] // 2)


# Ragged in both tile dims, and more than one program along each (pack's tile: 64 rows x 32 groups).
SHAPES = [(4, 8), (33, 40), (130, 264), (9, 1040)]


@pytest.fixture(params=[False, True], ids=["int32 offsets", "int64 offsets"])
def offsets(request, monkeypatch):
    """Each kernel test also with the int64 offsets of tensors of 2^31 elements or more."""
    if request.param:
        monkeypatch.setattr(pack24, "WIDE_OFFSETS", 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gathers_the_kept_values_in_row_major_order(dtype, shape, offsets):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    mask = mask_24(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    codes = kept_codes(mask)
    expected = kept_row_major(w, mask)
    assert torch.equal(pack_kept_reference(w, codes), expected)
    out = torch.full((shape[0], shape[1] // 2), float("nan"), dtype=dtype, device=DEVICE)
    assert torch.equal(pack_kept(w.to(DEVICE), codes.to(DEVICE), out).cpu(), expected)


def test_a_transposed_view_packs_as_its_contiguous_copy(offsets):
    w = torch.randn(136, 264, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    mask = mask_24_transposable(w)
    codes_t = kept_codes(mask.t())
    out = torch.empty(264, 68, dtype=torch.float16, device=DEVICE)
    got = pack_kept(w.to(DEVICE).t(), codes_t.to(DEVICE), out).cpu()
    assert torch.equal(got, kept_row_major(w.t().contiguous(), mask.t()))


def test_every_bit_of_a_kept_value_survives():
    w = torch.tensor([[-0.0, 1.0, float("nan"), float("-inf")]], dtype=torch.float16).repeat(2, 2)
    mask = torch.tensor([[True, False, True, False, False, True, False, True]] * 2)
    out = torch.empty(2, 4, dtype=torch.float16, device=DEVICE)
    got = pack_kept(w.to(DEVICE), kept_codes(mask).to(DEVICE), out).cpu()
    assert torch.equal(got.view(torch.int16), kept_row_major(w, mask).view(torch.int16))


def test_codes_name_the_two_kept_positions_of_each_group():
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert kept_codes(mask).tolist() == [[0 | 1 << 2, 1 | 3 << 2, 0 | 3 << 2]]


def test_a_mask_that_is_not_2_of_4_is_refused_with_where():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    with pytest.raises(LowconvError, match=r"^W's mask \(1, 8\) keeps 3 values in the group of row 0, columns 4\.\.7"):
        kept_codes(mask, "W's mask")


def test_operands_that_do_not_fit_are_refused():
    w = torch.zeros(8, 16, dtype=torch.float16, device=DEVICE)
    codes = kept_codes(mask_24(torch.randn(8, 16))).to(DEVICE)
    with pytest.raises(LowconvError, match="do not fit"):
        pack_kept(w, codes, torch.empty(8, 16, dtype=torch.float16, device=DEVICE))
    with pytest.raises(LowconvError, match="do not fit"):
        pack_kept(w, codes, torch.empty(8, 8, dtype=torch.float32, device=DEVICE))


def test_the_kernel_is_a_library_op():
    """lowconv::pack_kept: schema (what it writes), fake implementation and torch.compile's
    dispatch, checked by torch.library.opcheck, W^T's strided view too."""
    w = torch.randn(9, 24, generator=torch.Generator().manual_seed(5)).to(torch.float16).to(DEVICE)
    codes = kept_codes(mask_24(w.cpu().float())).to(DEVICE)
    for src in (w, w.t().contiguous().t()):
        out = torch.empty(9, 12, dtype=torch.float16, device=DEVICE)
        torch.library.opcheck(pack_kept_into, (src, codes, out))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 8), (36, 40), (136, 264), (264, 136), (8, 1040)])
def test_transpose_kept_packs_w_transposed_from_ws_kept_values(dtype, shape, offsets):
    """A transposable mask's W^T, packed from W's kept values alone, as from the dense W^T."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    mask = mask_24_transposable(torch.randn(shape, generator=torch.Generator().manual_seed(7)))
    codes, codes_t = kept_codes(mask), kept_codes(mask.t())
    kept = kept_row_major(w, mask)
    expected = kept_row_major(w.t().contiguous(), mask.t())
    assert torch.equal(unpack_kept(kept, codes), w * mask)
    assert torch.equal(transpose_kept_reference(kept, codes, codes_t), expected)
    out = torch.full((shape[1], shape[0] // 2), float("nan"), dtype=dtype, device=DEVICE)
    got = transpose_kept(kept.to(DEVICE), codes.to(DEVICE), codes_t.to(DEVICE), out)
    assert got is out and torch.equal(got.cpu(), expected)
    torch.library.opcheck(transpose_kept_into, (kept.to(DEVICE), codes.to(DEVICE), codes_t.to(DEVICE), out))
    with pytest.raises(LowconvError, match="do not fit"):
        transpose_kept(kept.to(DEVICE), codes_t.to(DEVICE), codes.to(DEVICE), out)
