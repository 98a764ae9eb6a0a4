"""The fp16-accumulating split-K Triton kernel (in Triton's interpreter on the CPU, compiled on
CUDA) against float64 and against the reference that emulates it: forward and both gradients."""
import pytest
import torch

from lowconv.kernels.fp16acc import fp16acc_matmul, fp16acc_matmul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter's loop over a loaded bound warns about numpy scalar conversion; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def rel_error(y, exact):
    assert not y.isnan().any()
    return ((y.double() - exact).norm() / exact.norm()).item()


def operands(m, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    return (t.half().to(DEVICE) for t in (x, w, b))


@pytest.mark.parametrize("combine", ["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n,splits", [(1, 640, 64, 2), (5, 100, 40, 3), (33, 512, 70, 1), (70, 1040, 129, 4)])
def test_forward_error_is_the_references(m, k, n, splits, combine):
    """Same chunks as the reference: its error vs float64 within 2x of the reference's (the
    interpreter rounds once per k-tile, the GPU once per 16-wide MMA step)."""
    x, w, b = operands(m, k, n)
    exact = x.double() @ w.double().t() + b.double()
    y = fp16acc_matmul(x, w, b, splits, combine, backend="triton")
    reference = fp16acc_matmul_reference(x, w, b, splits, combine)
    assert y.dtype == torch.float16 and y.shape == (m, n)
    assert rel_error(y, exact) < 2 * rel_error(reference, exact) + 1e-4


def test_splits_bound_the_error_of_long_sums():
    """One fp16 accumulator over K = 8192 loses accuracy; 16 chunks win most of it back."""
    x, w, _ = operands(8, 8192, 32, seed=1)
    exact = x.double() @ w.double().t()
    one, sixteen = (rel_error(fp16acc_matmul(x, w, None, s, backend="triton"), exact) for s in (1, 16))
    assert sixteen < one / 2, (one, sixteen)


def test_gradients_through_the_kernel():
    x, w, b = operands(6, 96, 48, seed=2)
    grad = torch.randn(6, 48, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    fp16acc_matmul(*leaves, 2, backend="triton").backward(grad)
    x64, w64, g64 = x.double(), w.double(), grad.double()
    for got, exact in zip((t.grad for t in leaves), (g64 @ w64, g64.t() @ x64, g64.sum(0))):
        assert got.dtype == torch.float16
        assert rel_error(got, exact) < 2e-3


def test_batched_input_keeps_its_leading_dims():
    x, w, b = operands(12, 64, 32, seed=4)
    y = fp16acc_matmul(x.reshape(3, 4, 64), w, b, 1, backend="triton")
    assert y.shape == (3, 4, 32)
    assert torch.equal(y.reshape(12, 32), fp16acc_matmul(x, w, b, 1, backend="triton"))
