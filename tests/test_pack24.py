"""The kept-values gather of fixed-mask 2:4 compression (lowconv/kernels/pack24.py): the kernel
(Triton's interpreter on the CPU, compiled on a GPU) against its torch reference and against the
values the mask keeps, row-major."""
import pytest
import torch

from lowconv.errors import LowconvError
from lowconv.kernels import pack24
from lowconv.kernels.pack24 import (kept_codes, pack_kept, pack_kept_into, pack_kept_reference, zero_unkept,
                                    zero_unkept_in_place)
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)  # zero_unkept's tile: 8 rows x 128 groups
def test_zero_unkept_zeroes_what_the_mask_drops_in_place(dtype, shape, offsets):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = mask_24(torch.randn(shape, generator=torch.Generator().manual_seed(4)))
    on_device = x.to(DEVICE)
    assert zero_unkept(on_device, kept_codes(mask).to(DEVICE)) is on_device
    assert torch.equal(on_device.cpu(), x * mask)
    with pytest.raises(LowconvError, match="do not fit"):
        zero_unkept(on_device.t(), kept_codes(mask).to(DEVICE))


def test_the_kernels_are_library_ops():
    """lowconv::pack_kept and lowconv::zero_unkept: schema (what they write), fake implementation
    and torch.compile's dispatch, checked by torch.library.opcheck, W^T's strided view too."""
    w = torch.randn(9, 24, generator=torch.Generator().manual_seed(5)).to(torch.float16).to(DEVICE)
    codes = kept_codes(mask_24(w.cpu().float())).to(DEVICE)
    for src in (w, w.t().contiguous().t()):
        out = torch.empty(9, 12, dtype=torch.float16, device=DEVICE)
        torch.library.opcheck(pack_kept_into, (src, codes, out))
    torch.library.opcheck(zero_unkept_in_place, (w.clone(), codes))
