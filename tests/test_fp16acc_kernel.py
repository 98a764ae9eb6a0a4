"""The fp16-accumulating split-K GEMM: the Triton kernel (in Triton's interpreter on the CPU,
compiled on CUDA) against float64 and against the reference that emulates it, forward and both
gradients, in all of its launches (large M; small M with chunks in turn or in parallel programs);
the cuBLAS path's chunking and its scoped fp16-accumulation flag (on the CPU with a stand-in
matmul); on CUDA (-m gpu) the CPU emulation's error against the GPU's, and the Gluon wgmma kernel
(sm_90 only; no interpreter runs it) against the Triton kernel, bit for bit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowconv.kernels.fp16acc as fa
import lowconv.kernels.fp16acc_triton as ft
import lowconv.kernels.fp16acc_wgmma as fw
from lowconv.kernels.fp16acc import (auto_splits, chunks, combine_in_order, cublas_fp16acc, fp16acc_matmul,
                                     fp16acc_matmul_reference, forward_gemm)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parent.parent

# The interpreter's loop over a loaded bound warns about numpy scalar conversion; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def rel_error(y, exact):
    assert not y.isnan().any()
    return ((y.double() - exact).norm() / exact.norm()).item()


def operands(m, k, n, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    return (t.half().to(device) for t in (x, w, b))


def poison_cuda_cache(m, n):
    """On CUDA: a freed (m, n) fp16 block full of NaN, which the caching allocator hands to the
    next (m, n) fp16 torch.empty (the output), so an element the kernel forgets to write is NaN."""
    if torch.cuda.is_available():
        torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")


# (m, k, n, splits): small M with chunks in parallel (fewer 16-column tiles than the H100's 132 SMs),
# with one chunk, with chunks in turn (n > 2096); large M (> 64) with several chunks and with one;
# chunks that are not a whole number of k-tiles; odd tails everywhere.
FORWARD_CASES = [(1, 640, 64, 2), (5, 100, 40, 3), (33, 512, 70, 1), (2, 256, 2200, 3), (70, 1040, 129, 4),
                 (80, 200, 48, 1)]
LAYOUTS = {"small M, chunks in parallel": (3, 24), "small M, chunks in turn": (3, 2200), "large M": (70, 24)}


@pytest.mark.parametrize("combine", ["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n,splits", FORWARD_CASES)
def test_forward_error_is_the_references(m, k, n, splits, combine):
    """Same chunks as the reference: its error vs float64 within 2x of the reference's (the
    interpreter rounds once per k-tile, the GPU once per 16-wide MMA step)."""
    x, w, b = operands(m, k, n)
    exact = x.double() @ w.double().t() + b.double()
    poison_cuda_cache(m, n)
    y = fp16acc_matmul(x, w, b, splits, combine, backend="triton")
    reference = fp16acc_matmul_reference(x, w, b, splits, combine)
    assert y.dtype == torch.float16 and y.shape == (m, n)
    assert rel_error(y, exact) < 2 * rel_error(reference, exact) + 1e-4


@pytest.mark.parametrize("combine", ["fp32", "fp16"])
@pytest.mark.parametrize("m,n", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_exact_chunk_sums_combine_in_order(m, n, combine):
    """Positive integers of at most 8 and 32-wide chunks: every chunk's sum (<= 2048) is exact in
    fp16, so the only roundings are the combine's (totals up to 12288) and the output's, and the
    kernel must equal the reference bit for bit, on the GPU too: the chunk order and the combine
    precision, in every layout."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randint(1, 9, (m, 192), generator=gen).half().to(DEVICE)
    w = torch.randint(1, 9, (n, 192), generator=gen).half().to(DEVICE)
    bias = torch.randint(-100, 101, (n,), generator=gen).half().to(DEVICE)
    assert chunks(192, 6) == (2, 6)
    y = fp16acc_matmul(x, w, bias, 6, combine, backend="triton")
    reference = fp16acc_matmul_reference(x, w, bias, 6, combine)
    assert torch.equal(y, reference)
    if combine == "fp16":  # the fp16 running total does round: the test can fail
        assert not torch.equal(y, fp16acc_matmul_reference(x, w, bias, 6, "fp32"))


@pytest.mark.parametrize("m,parallel", [(1, True), (1, False), (70, False)],
                         ids=["small M, chunks in parallel", "small M, chunks in turn", "large M"])
def test_every_tuned_config_computes_the_product(m, parallel):
    """Each config the autotuner may pick (it times them, it does not check them), run alone:
    within 2x of the reference's error; on the GPU the same code compiled per config."""
    k, n, splits = 320, 96, 3
    x, w, _ = operands(m, k, n, seed=10)
    exact = x.double() @ w.double().t()
    bound = 2 * rel_error(fp16acc_matmul_reference(x, w, None, splits, "fp32"), exact) + 1e-4
    blocks_per_split, _ = chunks(k, splits)
    small_m = m <= ft.SMALL_M
    tuner = ft._tuned_for_small_m if small_m else ft._tuned_for_large_m
    for config in tuner.configs:
        out = torch.full((splits, m, n) if parallel else (m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        ft.run_gemm(tuner, x, w, None, out, blocks_per_split * 16, splits, 1 if parallel else splits,
                    splits if parallel else 1, True, ft.small_block_m(m) if small_m else None, config=config)
        y = fa.add_bias(combine_in_order(out, "fp32"), None) if parallel else out
        assert rel_error(y, exact) < bound, config


def test_splits_bound_the_error_of_long_sums():
    """One fp16 accumulator over K = 8192 loses accuracy; 16 chunks win most of it back."""
    x, w, _ = operands(8, 8192, 32, seed=1)
    exact = x.double() @ w.double().t()
    one, sixteen = (rel_error(fp16acc_matmul(x, w, None, s, backend="triton"), exact) for s in (1, 16))
    assert sixteen < one / 2, (one, sixteen)


@pytest.mark.parametrize("m", [6, 72], ids=["small M", "large M"])
def test_gradients_through_the_kernel(m):
    x, w, b = operands(m, 96, 48, seed=2)
    grad = torch.randn(m, 48, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    fp16acc_matmul(*leaves, 2, backend="triton").backward(grad)
    x64, w64, g64 = x.double(), w.double(), grad.double()
    for got, exact in zip((t.grad for t in leaves), (g64 @ w64, g64.t() @ x64, g64.sum(0))):
        assert got.dtype == torch.float16
        assert rel_error(got, exact) < 2e-3


def test_the_reference_backward_accumulates_in_fp16_as_the_kernels_do():
    """dW reduces over M = 16384 rows: in fp16 split chunks (the GPU's backward, and now the CPU's)
    its error is several times that of an fp32 sum rounded once (what the CPU computed before)."""
    x, w, _ = operands(16384, 128, 128, seed=5)
    grad = torch.randn(16384, 128, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    fp16acc_matmul(*leaves, None, 2, backend="reference").backward(grad)
    exact = grad.double().t() @ x.double()
    assert rel_error(leaves[1].grad, exact) > 2 * rel_error(exact.half(), exact)


def test_batched_input_keeps_its_leading_dims():
    x, w, b = operands(12, 64, 32, seed=4)
    y = fp16acc_matmul(x.reshape(3, 4, 64), w, b, 1, backend="triton")
    assert y.shape == (3, 4, 32)
    assert torch.equal(y.reshape(12, 32), fp16acc_matmul(x, w, b, 1, backend="triton"))


@pytest.mark.parametrize("backend", ["triton", "cublas", "reference"])
@pytest.mark.parametrize("m", [3, 70], ids=["small M", "large M"])
def test_each_backend_is_a_library_op(backend, m):
    """Schema, fake implementation, registered autograd and torch.compile's dispatch of each
    backend's GEMM op, checked by torch.library.opcheck (the cuBLAS op runs torch's matmul on the CPU)."""
    x, w, b = operands(m, 40, 24, seed=14)
    op = fa.GEMMS[backend]
    torch.library.opcheck(op, (x, w, b, 2, "fp32"))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.library.opcheck(op, (*leaves, 3, "fp16"))


# --- the cuBLAS path on the CPU, through a stand-in for the per-chunk matmul -------------------

@pytest.fixture
def chunk_calls(monkeypatch):
    """Each chunk product as (width of the chunk, allow_fp16_accumulation during the call); the
    product itself is torch's (on the CPU: fp16 operands, fp32 sums, one rounding to fp16)."""
    calls = []
    real = fa.chunk_product

    def spy(x_chunk, w_chunk):
        calls.append((x_chunk.shape[1], torch.backends.cuda.matmul.allow_fp16_accumulation))
        return real(x_chunk, w_chunk)
    monkeypatch.setattr(fa, "chunk_product", spy)
    return calls


@pytest.fixture
def fp16_accumulation_flag():
    """allow_fp16_accumulation as the test found it, put back after it whatever happened."""
    settings = torch.backends.cuda.matmul
    before = settings.allow_fp16_accumulation
    yield settings
    settings.allow_fp16_accumulation = before


@pytest.mark.parametrize("combine", ["fp32", "fp16"])
def test_cublas_chunks_combine_in_order(combine, chunk_calls, fp16_accumulation_flag):
    fp16_accumulation_flag.allow_fp16_accumulation = False
    x, w, b = operands(5, 100, 24, seed=5, device="cpu")
    y = cublas_fp16acc(x, w, b, 3, combine)
    blocks_per_split, splits = chunks(100, 3)
    widths = [min(blocks_per_split * 16, 100 - start) for start in range(0, 100, blocks_per_split * 16)]
    assert chunk_calls == [(width, True) for width in widths]  # [48, 48, 4], each with the flag on
    assert fp16_accumulation_flag.allow_fp16_accumulation is False  # and off again after
    starts = [sum(widths[:i]) for i in range(splits)]
    partials = torch.stack([x[:, s:s + n] @ w[:, s:s + n].t() for s, n in zip(starts, widths)])
    assert torch.equal(y, (combine_in_order(partials, combine) + b.float()).half())


@pytest.mark.parametrize("before", [False, True])
def test_cublas_flag_restored_when_the_matmul_raises(before, monkeypatch, fp16_accumulation_flag):
    seen = []

    def failing(x_chunk, w_chunk):
        seen.append(torch.backends.cuda.matmul.allow_fp16_accumulation)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(fa, "chunk_product", failing)
    fp16_accumulation_flag.allow_fp16_accumulation = before
    x, w, b = operands(2, 64, 8, device="cpu")
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        cublas_fp16acc(x, w, b, 2, "fp32")
    assert seen == [True]
    assert fp16_accumulation_flag.allow_fp16_accumulation is before


def test_cublas_backward_chunks_each_gradient_by_its_own_reduced_dim(chunk_calls, fp16_accumulation_flag):
    fp16_accumulation_flag.allow_fp16_accumulation = False
    m, k, n = 40, 96, 130
    x, w, b = operands(m, k, n, seed=6, device="cpu")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(7)).half()
    forward_gemm(*leaves, 2, "fp32", "cublas").backward(grad)
    forward, grad_x, grad_w = 2, chunks(n, auto_splits(n, m))[1], chunks(m, auto_splits(m, n))[1]
    assert len(chunk_calls) == forward + grad_x + grad_w and all(on for _, on in chunk_calls)
    assert fp16_accumulation_flag.allow_fp16_accumulation is False
    x64, w64, g64 = x.double(), w.double(), grad.double()
    for got, exact in zip((t.grad for t in leaves), (g64 @ w64, g64.t() @ x64, g64.sum(0))):
        assert got.dtype == torch.float16
        assert rel_error(got, exact) < 2e-3


@pytest.mark.parametrize("combine,grad_x_chunks", [("fp32", 64), ("fp16", 16)])
def test_backward_splits_follow_the_combine(chunk_calls, fp16_accumulation_flag, combine, grad_x_chunks):
    """dX reduces over N = 1024, where auto_splits depends on the combine."""
    m, k, n = 8, 32, 1024
    leaves = [t.clone().requires_grad_() for t in operands(m, k, n, seed=8, device="cpu")]
    forward_gemm(*leaves, 1, combine, "cublas").backward(torch.ones(m, n, dtype=torch.float16))
    widths = [width for width, _ in chunk_calls]
    assert widths == [k] + [n // grad_x_chunks] * grad_x_chunks + [m]  # forward, dX's chunks, dW


def test_cublas_backend_needs_cuda_tensors():
    x, w, b = operands(2, 32, 8, device="cpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        fp16acc_matmul(x, w, b, 2, backend="cublas")


# --- compiled for the H100 on the CPU: every tuned config, and the combine kernel --------------

def compile_configs():
    """{case: shared bytes or the compiler's error} for _fp16acc_kernel in every tuned config (the
    parallel ones with both BLOCK_Ms) and _combine_kernel; run in a child without the interpreter."""
    from tests.test_kernels_compile import signature
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(kernel, constexprs, num_warps, num_stages=3, maxnreg=None):
        types = {"*": "*fp16", **{name: "i32" for name in kernel.arg_names
                                  if name[0].isupper() or name.startswith("stride")}}
        source = ASTSource(kernel, signature(kernel, constexprs, types),
                           constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
        try:
            return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared
        except Exception as error:
            return f"{type(error).__name__}: {error}"[-2000:]

    gemms = [(config, {}) for config in ft.LARGE_M_CONFIGS + [ft.LARGE_M_SMALL_WORK_CONFIG]]
    gemms += [(config, {"BLOCK_M": block_m}) for config in ft.SMALL_M_CONFIGS + [ft.SMALL_M_SMALL_WORK_CONFIG]
              for block_m in (16, 64)]
    results = {}
    for config, extra in gemms:
        constexprs = dict(HAS_BIAS=True, COMBINE_FP32=True, **config.kwargs, **extra)
        results[f"gemm {constexprs}, warps {config.num_warps}, stages {config.num_stages}"] = compile_one(
            ft._fp16acc_kernel, constexprs, config.num_warps, config.num_stages, config.maxnreg)
    for combine_fp32 in (False, True):
        constexprs = dict(HAS_BIAS=True, COMBINE_FP32=combine_fp32, BLOCK=ft.COMBINE_BLOCK)
        results[f"combine {constexprs}"] = compile_one(ft._combine_kernel, constexprs, 4)
    return results


def test_tuned_configs_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c", "import json, tests.test_fp16acc_kernel as t; "
                            "print(json.dumps(t.compile_configs()))"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.splitlines()[-1])
    failed = {case: result for case, result in results.items() if isinstance(result, str)}
    assert not failed, "\n\n".join(f"{case}: {error}" for case, error in failed.items())
    assert max(results.values()) <= 232448  # the H100's shared memory per block


# --- the Gluon wgmma kernel's host side ---------------------------------------------------------

def test_wgmma_k_tiles_divide_the_chunks():
    assert [fw.wgmma_tile_k(chunk_k) for chunk_k in (16, 32, 48, 64, 80, 128, 224, 4096)] == [
        16, 32, 16, 64, 16, 64, 32, 64]


def test_wgmma_operands_are_read_k_major_or_transposed():
    """TMA reads the unit-stride dim: x (M, K) as (128, tile_k) blocks; a transposed view (the
    backward's operands) as (tile_k, 128) blocks of the tensor under it."""
    x = torch.zeros(256, 64, dtype=torch.float16)
    descriptor, k_major = fw.operand_descriptor(x, 128, 32)
    assert k_major and descriptor.block_shape == [128, 32] and list(descriptor.shape) == [256, 64]
    descriptor, k_major = fw.operand_descriptor(x.t(), 128, 32)
    assert not k_major and descriptor.block_shape == [32, 128] and list(descriptor.shape) == [256, 64]


def test_wgmma_kernel_needs_an_sm90_device():
    x = torch.zeros(4096, 64, dtype=torch.float16)
    assert not fw.wgmma_runs(x, torch.zeros(4096, 64, dtype=torch.float16), multiprocessors=1)


# --- CUDA ----------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 (Hopper) device")


def triton_kernel_product(x, w, b, splits, combine):
    (m, k), n = x.shape, w.shape[0]
    blocks_per_split, splits = chunks(k, splits)
    out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    ft.run_gemm(ft._tuned_for_large_m, x, w, b, out, blocks_per_split * 16, splits, splits, 1, combine == "fp32",
                block_m=None)
    return out


def wgmma_kernel_product(x, w, b, splits, combine):
    (m, k), n = x.shape, w.shape[0]
    blocks_per_split, splits = chunks(k, splits)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=x.device)  # unwritten stays NaN
    fw.launch_fp16acc_wgmma(x, w, b, out, blocks_per_split * 16, splits, combine == "fp32")
    return out


# (m, k, n, operand layout): tails in M (777: forward layouts only, as TMA needs 16-byte aligned
# rows and x transposed has rows of M), N and K; chunks of 16-, 32- and 64-wide k-tiles; every
# operand layout of the forward and the backward pass (dX: w transposed; dW: both); chunks unrolled
# and looped on either side of MAX_UNROLLED_TILES (K = 2048 and 2112 with one split: 32 and 33 tiles).
WGMMA_CASES = [(777, 2056, 520, "forward"), (777, 2056, 520, "w transposed"), (776, 2056, 520, "x transposed"),
               (304, 1000, 136, "both transposed"), (304, 1000, 136, "forward"), (128, 4096, 256, "both transposed"),
               (256, 2048, 264, "forward"), (256, 2112, 264, "forward")]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("combine", ["fp32", "fp16"])
@pytest.mark.parametrize("splits", [1, 5, 32])
@pytest.mark.parametrize("m,k,n,layout", WGMMA_CASES)
def test_wgmma_kernel_equals_the_triton_kernel(m, k, n, layout, splits, combine):
    """The same chunks through the same k16 MMA steps: the same bits as the Triton kernel, bias
    or none; every element written."""
    x, w, b = operands(m, k, n, seed=11, device="cuda")
    if layout in ("x transposed", "both transposed"):
        x = x.t().contiguous().t()
    if layout in ("w transposed", "both transposed"):
        w = w.t().contiguous().t()
    bias = b if splits != 5 else None
    expected = triton_kernel_product(x, w, bias, splits, combine)
    assert torch.equal(wgmma_kernel_product(x, w, bias, splits, combine), expected)


@pytest.mark.gpu
@needs_sm90
def test_the_wgmma_kernel_is_a_library_op():
    """lowconv::fp16acc_wgmma (a custom op: the Triton op's body calls it) by torch.library.opcheck;
    an unaligned operand goes to the Triton kernel when the op runs."""
    x, w, b = operands(1024, 512, 4096, seed=15, device="cuda")
    torch.library.opcheck(ft.wgmma_gemm, (x, w, b, 4, "fp32"))
    unaligned = torch.cat([torch.zeros(1, dtype=torch.float16, device="cuda"), x.flatten()])[1:].view(1024, 512)
    assert torch.equal(ft.wgmma_gemm(unaligned, w, b, 4, "fp32"), triton_kernel_product(x, w, b, 4, "fp32"))


@pytest.mark.gpu
@needs_sm90
def test_wgmma_kernel_is_not_given_what_tma_cannot_read():
    """Rows that are not 16-byte aligned (here a transposed x with rows of M = 777 fp16, and an
    output with rows of N = 4100) and problems with fewer 128 x 256 output tiles than 3/4 of the
    SMs go to the Triton kernel."""
    w = torch.empty(4096, 512, dtype=torch.float16, device="cuda")
    assert fw.wgmma_runs(torch.empty(4096, 512, dtype=torch.float16, device="cuda"), w, 132)
    assert not fw.wgmma_runs(torch.empty(512, 777, dtype=torch.float16, device="cuda").t(), w, 132)
    assert not fw.wgmma_runs(torch.empty(4096, 512, dtype=torch.float16, device="cuda"),
                             torch.empty(4100, 512, dtype=torch.float16, device="cuda"), 132)
    assert not fw.wgmma_runs(torch.empty(512, 512, dtype=torch.float16, device="cuda"), w, 132)


@pytest.mark.gpu
@needs_sm90
def test_large_gemms_and_their_gradients_run_the_wgmma_kernel(monkeypatch):
    """A GEMM with an output tile per SM (and its dX and dW, transposed operands) goes to the wgmma
    kernel; its result is the Triton kernel's."""
    launches = []
    real = ft.launch_fp16acc_wgmma
    monkeypatch.setattr(ft, "launch_fp16acc_wgmma", lambda *args: launches.append(args[0].shape) or real(*args))
    m, k, n = 4096, 2048, 4096
    x, w, b = operands(m, k, n, seed=12, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(13)).half().cuda()
    y = fp16acc_matmul(*leaves, 8)
    y.backward(grad)
    assert launches == [(m, k), (m, n), (n, m)]  # forward, dX = g w, dW = g^T x
    assert torch.equal(y, triton_kernel_product(x, w, b, 8, "fp32"))
    assert torch.equal(leaves[0].grad, triton_kernel_product(grad, w.t(), None, auto_splits(n, m), "fp32"))
    assert torch.equal(leaves[1].grad, triton_kernel_product(grad.t(), x.t(), None, auto_splits(m, n), "fp32"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tuned_calls_skip_the_autotuner(monkeypatch):
    """Once the autotuner has picked a config for a key, later calls launch that config directly
    (tuned_config reads the autotuner's cache under Triton's key), with the same result; a new key
    still goes through the autotuner."""
    tuner = ft._tuned_for_small_m
    x, w, b = operands(8, 2048, 4096, seed=12, device="cuda")
    first = ft.launch_fp16acc(x, w, b, 4, "fp32")
    calls = []
    real_run = tuner.run
    monkeypatch.setattr(tuner, "run", lambda *args, **kwargs: calls.append(1) or real_run(*args, **kwargs))
    assert torch.equal(ft.launch_fp16acc(x, w, b, 4, "fp32"), first)
    assert calls == []
    ft.launch_fp16acc(x[:, :1024], w[:, :1024], b, 4, "fp32")  # another K, another key
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("combine", ["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n", [(1, 14336, 4096), (1, 14336, 2048), (48, 4096, 512), (256, 4096, 1024)],
                         ids=["decode, chunks in turn", "decode, chunks in parallel", "64-row tiles", "large M"])
@pytest.mark.parametrize("splits", [1, 8, "auto"])
def test_cpu_emulation_predicts_the_gpu_error(m, k, n, splits, combine):
    """The issue's test: on the same inputs the reference run on the CPU has an error vs float64
    within 2x of the GPU kernel's, either way (shapes large enough for the autotuned configs)."""
    splits = auto_splits(k, m) if splits == "auto" else splits
    x, w, b = operands(m, k, n, seed=8, device="cpu")
    exact = x.double() @ w.double().t() + b.double()
    cpu = rel_error(fp16acc_matmul_reference(x, w, b, splits, combine), exact)
    poison_cuda_cache(m, n)
    gpu = rel_error(fp16acc_matmul(x.cuda(), w.cuda(), b.cuda(), splits, combine).cpu(), exact)
    assert 0.5 < gpu / cpu < 2, (gpu, cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 256])
def test_cublas_backend_on_cuda(m, fp16_accumulation_flag):
    """16 cuBLAS fp16-acc matmuls are at worst 2x as far from float64 as the reference's 16 fp16
    chains (cuBLAS may accumulate some parts in more precision, never in less); the flag is off
    again after the forward and after the backward."""
    fp16_accumulation_flag.allow_fp16_accumulation = False
    x, w, b = operands(m, 8192, 512, seed=9, device="cuda")
    exact = x.double() @ w.double().t() + b.double()
    split = rel_error(fp16acc_matmul(x, w, b, 16, backend="cublas"), exact)
    reference = rel_error(fp16acc_matmul_reference(x, w, b, 16, "fp32"), exact)
    assert split < 2 * reference, (split, reference)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    fp16acc_matmul(*leaves, 16, backend="cublas").float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    assert fp16_accumulation_flag.allow_fp16_accumulation is False


def test_overlapping_cublas_blocks_in_two_threads_leave_the_flag_as_it_was():
    """Two threads (DataParallel replicas, a serving pool) inside cublas_fp16_accumulation at once:
    the flag stays on until the last leaves, then the value from before the first comes back."""
    import threading

    from lowconv.kernels.fp16acc import cublas_fp16_accumulation

    settings = torch.backends.cuda.matmul
    before = settings.allow_fp16_accumulation
    settings.allow_fp16_accumulation = False
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with cublas_fp16_accumulation():
            a_in.set()
            b_in.wait()
        a_out.set()

    def b():
        a_in.wait()
        with cublas_fp16_accumulation():
            b_in.set()
            a_out.wait()
            seen.append(settings.allow_fp16_accumulation)  # a has left: still on for b

    threads = [threading.Thread(target=f) for f in (a, b)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert seen == [True] and settings.allow_fp16_accumulation is False
    finally:
        settings.allow_fp16_accumulation = before
