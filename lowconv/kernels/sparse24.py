"""2:4 semi-structured sparsity: pruning, the compressed-tensors bitmask format, and the linear.

2:4 runs along the last dim (K for a weight (N, K) and for an activation (..., K)): of every 4
consecutive values, 2 are kept.

Bitmask format (compressed-tensors' "sparse-24-bitmask", which vLLM reads):
    compressed  (rows, cols/2)       the kept values of each row, in row-major order
    bitmask     uint8 (rows, ceil(cols/8))   mask bit of column c is bit (c % 8) of byte c // 8,
                                     least significant bit first (numpy.packbits bitorder="little"),
                                     the last byte of a row zero-padded
    shape       int64 (2, 1)         [[rows], [cols]], the dense shape
The mask is the 2:4 mask, not `!= 0`: a group with fewer than 2 nonzeros still keeps 2 values
(zeros among them), so every row holds exactly cols/2 values.

The linear runs as a masked dense product (semi_sparse_linear: cuBLAS on CUDA, the fp32 reference
elsewhere) or on cuSPARSELt's 2:4 GEMM (lowconv.kernels.cusparselt), through custom ops with fake
implementations and registered autograd: compressed_linear for a fixed weight, fixed_mask_linear
for fixed-mask training; choose_backend, for "auto", times both on a layer's own GEMM.
"""
from __future__ import annotations

import functools
import itertools
import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from lowconv.errors import LowconvError
from lowconv.kernels import cusparselt, cusparselt_library
from lowconv.kernels.cuda_timing import cuda_ms_per_call
from lowconv.kernels.pack24 import kept_codes, mask_codes, pack_kept_reference, transpose_kept, unpack_kept


def mask_24(x: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 largest-|magnitude| values of each group of 4 along the last dim.

    Ties go to the lower index (stable sort), so the mask is deterministic.
    """
    if x.shape[-1] % 4:
        raise ValueError(f"2:4 sparsity needs the last dim divisible by 4, got shape {tuple(x.shape)}")
    groups = x.detach().abs().reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
    order = groups.argsort(dim=-1, descending=True, stable=True)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, order[..., :2], True)
    return mask.reshape(x.shape)


def transposable_patterns() -> torch.Tensor:
    """The 90 4x4 bool patterns with exactly 2 kept in every row and every column, (90, 16)."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]  # 6 ways to keep 2 of 4
    blocks = [block for block in itertools.product(rows, repeat=4) if all(sum(col) == 2 for col in zip(*block))]
    return torch.tensor(blocks, dtype=torch.bool).reshape(len(blocks), 16)


def mask_24_transposable(w: torch.Tensor) -> torch.Tensor:
    """Bool mask of a 2D (rows, cols) tensor that is 2:4 along cols AND along rows (so that w^T,
    which the backward GEMM dX = dY w multiplies, is 2:4 too): in every 4x4 block, the pattern
    with 2 kept per row and per column that keeps the most magnitude (exhaustive over the 90).
    Keeps at most what mask_24 keeps; ties go to the first pattern, so it is deterministic."""
    if w.dim() != 2 or w.shape[0] % 4 or w.shape[1] % 4:
        raise ValueError(f"transposable 2:4 sparsity needs a 2D tensor with both dims divisible by 4, "
                         f"got shape {tuple(w.shape)}")
    rows, cols = w.shape
    blocks = w.detach().abs().float().reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    patterns = transposable_patterns().to(w.device)
    best = (blocks @ patterns.float().t()).argmax(dim=1)
    return patterns[best].reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def prune_24(x: torch.Tensor) -> torch.Tensor:
    """x with the 2 smaller-magnitude values of each group of 4 (last dim) set to zero."""
    return torch.where(mask_24(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def prune_24_straight_through(x: torch.Tensor) -> torch.Tensor:
    """prune_24 forward, identity backward: the dense tensor gets the whole gradient (torchao's
    runtime sparsity), so pruned entries keep learning and may win their group back."""
    return x + (prune_24(x) - x).detach()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool (rows, cols) -> uint8 (rows, ceil(cols/8)), little-endian bits within each byte."""
    rows, cols = mask.shape
    padded = F.pad(mask.to(torch.uint8), (0, -cols % 8))
    weights = 1 << torch.arange(8, dtype=torch.int32, device=mask.device)
    return (padded.reshape(rows, -1, 8).int() * weights).sum(-1).to(torch.uint8)


def unpack_bits(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 (rows, ceil(cols/8)) -> bool (rows, cols); inverse of pack_bits."""
    bits = (bitmask.int().unsqueeze(-1) >> torch.arange(8, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :cols].bool()


def compress_bitmask(w_pruned: torch.Tensor):
    """2:4-pruned (rows, cols) -> (compressed (rows, cols/2), bitmask uint8, shape int64 (2, 1))."""
    if w_pruned.dim() != 2:
        raise ValueError(f"compress_bitmask takes a 2-D tensor, got shape {tuple(w_pruned.shape)}")
    rows, cols = w_pruned.shape
    mask = mask_24(w_pruned)
    if (w_pruned[~mask] != 0).any():
        raise ValueError("compress_bitmask: the tensor is not 2:4 sparse (prune it with prune_24 first)")
    compressed = w_pruned[mask].reshape(rows, cols // 2)
    shape = torch.tensor([[rows], [cols]], dtype=torch.int64)
    return compressed, pack_bits(mask), shape


def decompress_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """The dense 2:4 tensor that compress_bitmask stored (bit-exact)."""
    rows, cols = shape.flatten().tolist()
    mask = unpack_bits(bitmask, cols)
    if mask.shape != (rows, cols) or compressed.shape != (rows, cols // 2):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} and compressed {tuple(compressed.shape)} "
                         f"do not match the dense shape ({rows}, {cols})")
    dense = torch.zeros(rows, cols, dtype=compressed.dtype, device=compressed.device)
    dense[mask] = compressed.flatten()
    return dense


def bitmask_to_dense(compressed: torch.Tensor, bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """decompress_bitmask of a well-formed weight, its dense width given: in torch ops that
    torch.compile traces (no shape read from a tensor, no indexing by a bool mask)."""
    mask = unpack_bits(bitmask, cols)
    return torch.zeros(mask.shape, dtype=compressed.dtype, device=compressed.device).masked_scatter(mask, compressed)


class KeptToDense(torch.autograd.Function):
    """kept_to_dense of a 2:4 bool mask: the positions come from the mask in the forward and again
    in the backward, so nothing but the mask (the layer's own) is saved, and a layer's values
    always sit where its mask says (a where's backward would save its (rows, cols/4, 2, 4) bool
    condition). One fused kernel each way under torch.compile; torch.func transforms (grad, vmap)
    take it too."""
    generate_vmap_rule = True

    @staticmethod
    def forward(values, mask):
        return unpack_kept(values, mask_codes(mask))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return pack_kept_reference(grad, mask_codes(mask)), None


def kept_to_dense(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense (rows, cols) tensor with `values` (rows, cols/2) where the 2:4 bool `mask` (rows,
    cols) keeps, in order, and zeros elsewhere (pack_kept's inverse), differentiable in values."""
    return KeptToDense.apply(values, mask)


def semi_sparse_linear_reference(x: torch.Tensor, w_pruned: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Masked dense product: fp32 accumulation, one rounding to x's dtype (as the sparse GEMM)."""
    y = x.float() @ w_pruned.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def semi_sparse_linear(x: torch.Tensor, w_pruned: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x w_pruned^T + b with a 2:4 operand (the weight, or x itself), as a masked dense product:
    F.linear on CUDA (cuBLAS accumulates 16-bit operands in fp32 too), the reference elsewhere.
    cuSPARSELt's 2:4 GEMM is compressed_linear, which the op picks per site."""
    if w_pruned.dim() != 2 or x.shape[-1] != w_pruned.shape[1]:
        raise ValueError(f"semi_sparse_linear: x {tuple(x.shape)} and w {tuple(w_pruned.shape)} do not match "
                         f"(w is (N, K))")
    if w_pruned.shape[1] % 4:
        raise ValueError(f"semi_sparse_linear: K={w_pruned.shape[1]} is not divisible by 4")
    if x.is_cuda:
        return F.linear(x, w_pruned, bias)
    return semi_sparse_linear_reference(x, w_pruned, bias)


# --- cuSPARSELt's 2:4 GEMM as torch.library custom ops ---------------------------------------
#
# Opaque to torch.compile: each runs the cuSPARSELt plans of the SparseGemm or TrainingGemms its
# int argument names (cusparselt.registered), on torch's current stream, its memory from torch's
# allocator; the first call of a product makes its plan (and tunes it: a sync), so a CUDA graph
# captures a call that ran once before (torch.compile's cudagraph trees warm up first).


@torch.library.custom_op("lowconv::sparse24_linear", mutates_args=())
def compressed_linear(x: torch.Tensor, sparse_weight: torch.Tensor, bias: Optional[torch.Tensor],
                      values: torch.Tensor, bitmask: torch.Tensor, gemm: int, tuned: bool) -> torch.Tensor:
    """y = x W^T + b through cuSPARSELt's 2:4 GEMM: W as `sparse_weight`, compressed by the
    SparseGemm registered under `gemm` (SparseGemm.linear, `tuned` as there), and as `values` and
    `bitmask` (the bitmask format), which its backward's dX = dY W reads."""
    return cusparselt.registered(gemm).linear(sparse_weight, x, bias, tuned)


@compressed_linear.register_fake
def _(x, sparse_weight, bias, values, bitmask, gemm, tuned):
    return cusparselt.linear_output(x, values.shape[0])[1]


def save_bitmask_weight(ctx, inputs, output):
    _, _, bias, values, bitmask, _, _ = inputs
    ctx.save_for_backward(values, bitmask)
    ctx.has_bias = bias is not None


def compressed_linear_backward(ctx, grad):
    values, bitmask = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad @ bitmask_to_dense(values, bitmask, 2 * values.shape[1])
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, None, grad_bias, None, None, None, None


compressed_linear.register_autograd(compressed_linear_backward, setup_context=save_bitmask_weight)


@torch.library.custom_op("lowconv::sparse24_fixed_mask_linear", mutates_args=())
def fixed_mask_linear(x: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor, bias: Optional[torch.Tensor],
                      gemms: int) -> torch.Tensor:
    """Fixed-mask 2:4 training on cuSPARSELt, with the TrainingGemms registered under `gemms`; the
    weight W (N, K) comes as its kept values `kept` (N, K/2) under the bool `mask` (kept_to_dense).
    y = x W^T + b through the 2:4 GEMM: cuSPARSELt's layout of W is `kept` row-major then metadata
    that the fixed mask decides (FixedMaskCompression), so compressing the new weight of every
    step is a copy. Its backward: dX = dY W through the 2:4 GEMM of W^T when the mask is
    transposable (W^T (K, N) is then 2:4 along N: fixed_mask_grad_input), dense otherwise; dW's
    kept values, packed from the dense dY^T x (neither operand is 2:4).
    The backward's packing is torch ops and a triton_op, which torch.compile launches from its own
    graph: inside custom ops they took 50-160 us of host time a call on the H200's host, and the
    compiled 2:4 step was host-bound (BENCHMARKS.md)."""
    plans = cusparselt.registered(gemms)
    return plans.forward.linear(plans.compressions(mask)[0].compress_kept(kept), x, bias, plans.tuned(x))


@fixed_mask_linear.register_fake
def _(x, kept, mask, bias, gemms):
    return cusparselt.linear_output(x, kept.shape[0])[1]


def save_fixed_mask_operands(ctx, inputs, output):
    x, kept, mask, bias, gemms = inputs
    ctx.save_for_backward(x, kept, mask)
    ctx.gemms, ctx.has_bias = gemms, bias is not None


def fixed_mask_linear_backward(ctx, grad):
    x, kept, mask = ctx.saved_tensors
    codes = mask_codes(mask)
    grad_x = grad_kept = grad_bias = None
    if ctx.needs_input_grad[0]:
        if cusparselt.registered(ctx.gemms).backward is not None:
            kept_t = kept.new_empty(mask.shape[1], mask.shape[0] // 2)
            transpose_kept(kept, codes, mask_codes(mask.t()), kept_t)
            grad_x = fixed_mask_grad_input(grad, kept_t, mask, ctx.gemms)
        else:
            grad_x = grad @ unpack_kept(kept, codes)  # made again here: the forward saves half the bytes
    if ctx.needs_input_grad[1]:
        g = grad.reshape(-1, grad.shape[-1])
        grad_kept = pack_kept_reference(g.t() @ x.reshape(-1, x.shape[-1]), codes)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, grad_kept, None, grad_bias, None


fixed_mask_linear.register_autograd(fixed_mask_linear_backward, setup_context=save_fixed_mask_operands)


@torch.library.custom_op("lowconv::sparse24_fixed_mask_grad_input", mutates_args=())
def fixed_mask_grad_input(grad: torch.Tensor, kept_t: torch.Tensor, mask: torch.Tensor, gemms: int) -> torch.Tensor:
    """dX = dY W through the 2:4 GEMM of W^T (a transposable mask), given as its kept values (K, N/2)."""
    plans = cusparselt.registered(gemms)
    return plans.backward.linear(plans.compressions(mask)[1].compress_kept(kept_t), grad, None, plans.tuned(grad))


@fixed_mask_grad_input.register_fake
def _(grad, kept_t, mask, gemms):
    return cusparselt.linear_output(grad, kept_t.shape[0])[1]


@dataclass
class TrainingGemms:
    """The cuSPARSELt products of one training layer: W (N, K) forward, W^T (K, N) for dX when
    the mask is transposable (else None: dX is dense); tuned at `rows` (the site's M); registered
    under `key` for the ops. The compressions under the layer's mask are made on first use and made
    again, in place, when the mask changes (another tensor, or written in place: load_state_dict)."""

    forward: cusparselt.SparseGemm
    backward: cusparselt.SparseGemm | None
    rows: int | None = None
    key: int = field(init=False, compare=False)
    mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    seen_state: tuple = field(default=(), init=False, repr=False, compare=False)  # mask_state(mask) then
    _compressions: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        self.key = cusparselt.register(self)

    def __deepcopy__(self, memo) -> TrainingGemms:
        """The same plans under a key of its own, for a copy of the layer: its compressions follow
        the copy's mask."""
        return TrainingGemms(self.forward, self.backward, self.rows)

    @staticmethod
    def of(n: int, k: int, dtype: torch.dtype, device: torch.device, transposable: bool,
           rows: int | None = None) -> TrainingGemms:
        """The products of a weight (N, K) of `dtype` on `device`."""
        backward = cusparselt.SparseGemm(k, n, dtype, device) if transposable else None
        return TrainingGemms(cusparselt.SparseGemm(n, k, dtype, device), backward, rows)

    def tuned(self, x: torch.Tensor) -> bool:
        return x.numel() // x.shape[-1] == self.rows

    def compressions(self, mask: torch.Tensor) -> tuple:
        """(W's FixedMaskCompression, W^T's or None) under `mask`."""
        if mask is not self.mask or mask_state(mask) != self.seen_state:
            transposed = "W^T's mask (a transposable mask is 2:4 along out_features too)"
            if self._compressions:
                forward, backward = self._compressions
                forward.use(mask)
                if backward is not None:
                    backward.use(mask.t())
            else:
                forward = cusparselt.FixedMaskCompression(self.forward, mask)
                backward = None if self.backward is None else cusparselt.FixedMaskCompression(
                    self.backward, mask.t(), transposed)
                self._compressions = (forward, backward)
            self.mask, self.seen_state = mask, mask_state(mask)
        return self._compressions


def mask_state(mask: torch.Tensor) -> tuple:
    """What changes when a mask's values may have: its storage (`mask.data = ...`) and, but for
    inference tensors (which keep no count), its version (in-place writes: copy_, load_state_dict;
    writes through `mask.data` bypass the count and go unseen)."""
    return mask.data_ptr(), None if mask.is_inference() else mask._version


@dataclass(frozen=True)
class BackendChoice:
    """Which GEMM a 2:4 layer runs on CUDA, and why: asked for, impossible, or measured (the
    median ms of both at the layer's rows M, dtype and bias, on this device; forward and
    backward for a training layer)."""

    backend: str  # "cusparselt" | "masked-dense"
    reason: str
    rows: int | None = None
    sparse_ms: float | None = None
    dense_ms: float | None = None


# The 2:4 kernel must beat dense by this factor to be chosen: both times are medians of short
# runs, and a site the plan marks sparse must not run slower than dense.
WIN_FACTOR = 0.97


@dataclass(frozen=True)
class GemmCase:
    """What a backend is timed on: y = x W^T (+ b), x (rows, K), W (N, K), forward only
    (inference) or forward and backward (fixed-mask training, W^T 2:4 too if transposable)."""

    rows: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    has_bias: bool
    device: torch.device
    training: bool = False
    transposable: bool = False


def choose_backend(requested: str, case: GemmCase) -> BackendChoice:
    """The backend of a 2:4 layer on a CUDA device: as requested ("cusparselt", "masked-dense"),
    or for "auto" the faster of the two on `case`, measured once per process and case."""
    shapes = [(case.out_features, case.in_features)] + ([(case.in_features, case.out_features)]
                                                         if case.training and case.transposable else [])

    def problem():
        return cusparselt_library.unavailable_problem(case.device) or next(
            filter(None, (cusparselt.shape_problem(*shape, case.dtype) for shape in shapes)), None)
    what = "forward+backward" if case.training else "forward"
    return pick_backend(requested, "masked-dense", problem, lambda: time_backends(case), case.rows, what)


def pick_backend(requested: str, dense: str, find_problem, timed, rows: int, what: str) -> BackendChoice:
    """`requested` (`dense`, the dense backend's name, or "cusparselt", which find_problem(), a
    reason cuSPARSELt cannot run or None, refuses); for "auto" cuSPARSELt where it can run and
    timed() -> (sparse ms, dense ms) says it is faster by WIN_FACTOR. `what` names the timed work."""
    if requested == dense:
        return BackendChoice(dense, f"backend = {dense}")
    problem = find_problem()
    if requested == "cusparselt":
        if problem:
            raise LowconvError(f"backend = cusparselt: {problem}")
        return BackendChoice("cusparselt", "backend = cusparselt")
    if problem:
        return BackendChoice(dense, problem)
    sparse_ms, dense_ms = timed()
    measured = f"{what} 2:4 kernel {sparse_ms:.4f} ms vs dense {dense_ms:.4f} ms at M={rows}"
    if sparse_ms < WIN_FACTOR * dense_ms:
        return BackendChoice("cusparselt", f"faster: {measured}", rows, sparse_ms, dense_ms)
    return BackendChoice(dense, f"2:4 not faster: {measured}", rows, sparse_ms, dense_ms)


TIMING_ROUNDS, TIMING_SAMPLES, TIMING_CALLS = 3, 5, 8  # backends alternate over rounds of samples of calls


@functools.cache  # unbounded: the cases are bounded by a model's sites, and an evicted one could choose anew
def time_backends(case: GemmCase) -> tuple[float, float]:
    """(cuSPARSELt ms, masked-dense ms) on random data, each as the 2:4 modules call them. Once
    per process and case, so that every layer of a shape (and a model converted and then loaded
    in one process) makes the same choice. Autograd is on for the training case even when the
    caller runs under inference_mode or no_grad."""
    with torch.inference_mode(False), torch.enable_grad():
        return measure_backends(case)


def measure_backends(case: GemmCase) -> tuple[float, float]:
    gen = torch.Generator(device=case.device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device=case.device) * scale).to(case.dtype)

    x = randn(case.rows, case.in_features)
    w = randn(case.out_features, case.in_features, scale=case.in_features ** -0.5)
    bias = randn(case.out_features) if case.has_bias else None
    if case.training:
        calls = training_calls(x, w, bias, case.transposable, randn(case.rows, case.out_features))
    else:
        w = prune_24(w)
        sparse = cusparselt.SparseWeight(w)
        values, bitmask, _ = compress_bitmask(w)
        calls = {"sparse": lambda: compressed_linear(x, sparse.compressed, bias, values, bitmask, sparse.gemm.key,
                                                     True),
                 "dense": lambda: F.linear(x, w, bias)}
    samples = {name: [] for name in calls}
    for _ in range(TIMING_ROUNDS):  # alternated, so that clock and thermal drift hit both alike
        for name, call in calls.items():
            samples[name] += cuda_ms_per_call(call, TIMING_SAMPLES, TIMING_CALLS)
    return statistics.median(samples["sparse"]), statistics.median(samples["dense"])


def training_calls(x, w, bias, transposable: bool, grad_out) -> dict:
    """Forward and backward (gradients of x, the kept values and b) of a fixed-mask layer, both
    backends, as MaskedSemiSparseLinear runs them."""
    mask = mask_24_transposable(w) if transposable else mask_24(w)
    kept = pack_kept_reference(w, kept_codes(mask)).requires_grad_()
    x = x.requires_grad_()
    leaves = (x, kept) if bias is None else (x, kept, bias.requires_grad_())
    gemms = TrainingGemms.of(*w.shape, w.dtype, w.device, transposable, rows=x.shape[0])

    def step(forward):
        def run():
            return torch.autograd.grad(forward(), leaves, grad_out)
        return run

    return {"sparse": step(lambda: fixed_mask_linear(x, kept, mask, bias, gemms.key)),
            "dense": step(lambda: F.linear(x, kept_to_dense(kept, mask), bias))}
