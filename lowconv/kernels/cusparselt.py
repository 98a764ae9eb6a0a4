"""cuSPARSELt 2:4 GEMMs with the plan made once per shape: ctypes bindings to libcusparseLt.

Why not torch._cslt_sparse_mm: it builds the cuSPARSELt descriptors and the matmul plan on every
call, 0.5-1 ms of host time on the H100 (../shared/notes/h100-anchors.md), more than the 2:4
kernel saves at ViT-L MLP shapes. Here a SparseWeight keeps one plan per input row count (and
input layout and bias); a forward is one cusparseLtMatmul on torch's current stream.

The product is a linear y = x W^T + b, W (N, K) pruned 2:4 along K. cuSPARSELt's structured
operand is A, so it computes D = A op(B) + bias with
    A = W        structured, row-major N x K (the 2:4 groups run along its rows, i.e. along K)
    op(B) = x^T  K x M: a row-major x (M, K) described as it lies with opB = transpose, or a
                 column-major x (an earlier layer's transposed output) as a row-major K x M
    D = y^T      N x M, one bias value per row of D (per output feature)
D is written row-major, i.e. y^T contiguous, and y is returned as its transposed view (as torch's
own 2:4 tensor does). Operands are fp16 or bf16, D of their type; or e4m3 (sm_90), x row-major
only, D in bf16 or fp16 (the fp32 sums rounded once, unscaled: kernels/fp8_sparse24.py scales
them). Writing D column-major (y contiguous; torch's transpose_result=True) took
1.8-2.2x the time on the H100 with cuSPARSELt 0.8.0 at the ViT-L MLP shapes (BENCHMARKS.md). The
next layer reads such a column-major x as it lies (x^T row-major), without a copy.

Algorithm tuning, for the products a caller asks it for (the op asks for its site's traced
shape), once per process and product: the candidates are cuSPARSELt's own search pick
(cusparseLtMatmulSearch), its default, and every configuration id (torch asks for 0), timed here
on the product's operands (`tune`); later plans of the product take the winner, so that two
modules of one weight compute the same bits. Measured on the H100 (scripts/bench_semi_sparse.py): in
bf16 1.08-1.13x over cuSPARSELt's default at the ViT-L shapes and 1.13x at 8192^3; in fp16 within
that run's noise.

The ops (lowconv.kernels.sparse24's custom ops) take plain values, not Python objects: a SparseGemm,
and a fixed-mask training layer's TrainingGemms, are named by an int key into REGISTRY, which
holds them weakly: an entry lives as long as the module that holds its object, and no key is used
twice in a process. The key is a constant of a module's compiled graph, the same for every call.

The library itself (loading, typed functions, handles, enum values) is in cusparselt_library.py.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from lowconv.errors import LowconvError
from lowconv.kernels.cuda_timing import cuda_ms_per_call
from lowconv.kernels.pack24 import kept_codes, pack_kept, unpack_kept
from lowconv.site import dtype_name
from lowconv.kernels.cusparselt_library import (ALG_CONFIG_ID, ALG_CONFIG_MAX_ID, ALG_SPLIT_K, ALG_SPLIT_K_BUFFERS,
                                               ALG_SPLIT_K_MODE, COMPUTE_32F, CUDA_R_16BF, CUDA_R_16F,
                                               CUDA_R_8F_E4M3, MATMUL_ALG_DEFAULT, MATMUL_BIAS_POINTER,
                                               OP_NON_TRANSPOSE, OP_TRANSPOSE, ORDER_ROW, SPARSITY_50_PERCENT,
                                               VOID_P, Library, Opaque, library, unavailable_problem)

ALIGNMENT = 16  # bytes; every operand's pointer and leading dimension must keep it
MAX_PLANS = 32  # per weight: distinct (rows, input layout, bias) seen; the oldest plan is freed first

TUNING_SAMPLES, TUNING_CALLS = 3, 3  # one timing of a candidate: the median of 3 samples of 3 calls
FINALISTS, FINAL_ROUNDS = 3, 5
VALUE_TYPES = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF, torch.float8_e4m3fn: CUDA_R_8F_E4M3}
OUTPUT_TYPES = (torch.float16, torch.bfloat16)  # what an e4m3 product writes (a 16-bit one writes its own type)


def shape_multiple(dtype: torch.dtype) -> int:
    """What N and K of a structured operand of `dtype` must be multiples of (torch's constraints for
    cuSPARSELt: 16 for 16-bit types, 32 for 8-bit ones)."""
    return 32 if dtype.itemsize == 1 else 16


def row_multiple(dtype: torch.dtype) -> int:
    """What the dense operand's rows (M) are zero-padded to (as torch pads them: 8 for 16-bit types,
    16 for 8-bit ones)."""
    return 16 if dtype.itemsize == 1 else 8


REGISTRY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> SparseGemm or TrainingGemms
KEYS = itertools.count(1)


def register(plans) -> int:
    """The key under which the ops find `plans` (a SparseGemm or a TrainingGemms) while it lives."""
    key = next(KEYS)
    REGISTRY[key] = plans
    return key


def registered(key: int):
    """The SparseGemm or TrainingGemms registered under `key`."""
    plans = REGISTRY.get(key)
    if plans is None:
        raise LowconvError(f"no cuSPARSELt GEMM is registered under key {key} in this process (the module "
                           f"that made it is gone, or was moved to another device or dtype)")
    return plans


def shape_problem(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why cuSPARSELt cannot take a 2:4 weight (out_features, in_features) of `dtype`, or None."""
    if dtype not in VALUE_TYPES:
        # e4m3 too, for fp8_semi_sparse's quantized weights: a 2:4 layer's own weight is 16-bit
        return f"cuSPARSELt's 2:4 GEMM takes float16 or bfloat16 (this weight is {dtype_name(dtype)})"
    multiple = shape_multiple(dtype)
    if out_features % multiple or in_features % multiple:
        return (f"cuSPARSELt needs out_features and in_features multiples of {multiple} "
                f"(weight is ({out_features}, {in_features}))")
    return None


class Plan:
    """Descriptors, matmul descriptor, algorithm selection and plan of one product, kept together
    at fixed addresses (the plan refers to the others) and destroyed together."""

    def __init__(self, lib: Library, handle, n: int, k: int, m: int, dtype: torch.dtype, out_dtype: torch.dtype,
                 x_row_major: bool, bias: torch.Tensor | None, algorithm: Algorithm | None = None):
        self.lib, self.handle = lib, handle
        self.sparse, self.dense, self.out = Opaque(), Opaque(), Opaque()
        self.matmul, self.selection, self.plan = Opaque(), Opaque(), Opaque()
        self.descriptors = []
        value = VALUE_TYPES[dtype]
        lib.call("cusparseLtStructuredDescriptorInit", handle, self.sparse.ptr, n, k, k, ALIGNMENT, value,
                 ORDER_ROW, SPARSITY_50_PERCENT)
        self.descriptors.append(self.sparse)
        if x_row_major:  # x (M, K) as it lies; op(B) = its transpose
            dense_shape, op_b = (m, k, k), OP_TRANSPOSE
        else:  # x column-major is x^T (K, M) row-major
            dense_shape, op_b = (k, m, m), OP_NON_TRANSPOSE
        lib.call("cusparseLtDenseDescriptorInit", handle, self.dense.ptr, *dense_shape, ALIGNMENT, value, ORDER_ROW)
        self.descriptors.append(self.dense)
        lib.call("cusparseLtDenseDescriptorInit", handle, self.out.ptr, n, m, m, ALIGNMENT, VALUE_TYPES[out_dtype],
                 ORDER_ROW)
        self.descriptors.append(self.out)
        lib.call("cusparseLtMatmulDescriptorInit", handle, self.matmul.ptr, OP_NON_TRANSPOSE, op_b,
                 self.sparse.ptr, self.dense.ptr, self.out.ptr, self.out.ptr, COMPUTE_32F)
        if bias is not None:
            self.bias_pointer = ctypes.c_void_p(bias.data_ptr())
            lib.call("cusparseLtMatmulDescSetAttribute", handle, self.matmul.ptr, MATMUL_BIAS_POINTER,
                     ctypes.byref(self.bias_pointer), ctypes.sizeof(self.bias_pointer))
        lib.call("cusparseLtMatmulAlgSelectionInit", handle, self.selection.ptr, self.matmul.ptr, MATMUL_ALG_DEFAULT)
        if algorithm is not None:
            for attribute, value in algorithm.attributes():
                lib.call("cusparseLtMatmulAlgSetAttribute", handle, self.selection.ptr, attribute,
                         ctypes.byref(ctypes.c_int32(value)), 4)
        lib.call("cusparseLtMatmulPlanInit", handle, self.plan.ptr, self.matmul.ptr, self.selection.ptr)
        self.initialized = True
        workspace = ctypes.c_size_t()
        lib.call("cusparseLtMatmulGetWorkspace", handle, self.plan.ptr, ctypes.byref(workspace))
        self.workspace_bytes = workspace.value

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int32()
        self.lib.call("cusparseLtMatmulAlgGetAttribute", self.handle, self.selection.ptr, attribute,
                      ctypes.byref(value), 4)
        return value.value

    def algorithm(self) -> Algorithm:
        """The algorithm this plan's selection holds (after a search: the fastest it found)."""
        return Algorithm(*(self.attribute(a) for a in (ALG_CONFIG_ID, ALG_SPLIT_K, ALG_SPLIT_K_MODE,
                                                      ALG_SPLIT_K_BUFFERS)))

    def ms(self, compressed: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> float:
        """Median ms per call of this plan's product, timed with CUDA events after a warm-up."""
        times = cuda_ms_per_call(lambda: self.run("cusparseLtMatmul", compressed, x, out), TUNING_SAMPLES,
                                 TUNING_CALLS)
        return sorted(times)[len(times) // 2]

    def run(self, function: str, compressed: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        """cusparseLtMatmul (or cusparseLtMatmulSearch, which also times every algorithm and
        keeps the fastest in the plan's selection) of the compressed weight and x into out, on
        torch's current stream."""
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=x.device) \
            if self.workspace_bytes else None
        stream = (VOID_P * 1)(current_stream(x.device))
        self.lib.call(function, self.handle, self.plan.ptr, ONE_REF, compressed.data_ptr(), x.data_ptr(), ZERO_REF,
                      out.data_ptr(), out.data_ptr(), None if workspace is None else workspace.data_ptr(), stream, 1)

    def __del__(self):
        destroy = getattr(getattr(self, "lib", None), "dll", None)
        if destroy is None:  # init failed before anything was made, or interpreter shutdown
            return
        if getattr(self, "initialized", False):
            destroy.cusparseLtMatmulPlanDestroy(self.plan.ptr)
        for descriptor in getattr(self, "descriptors", []):
            destroy.cusparseLtMatDescriptorDestroy(descriptor.ptr)


ONE, ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha, beta: float for COMPUTE_32F
ONE_REF, ZERO_REF = ctypes.byref(ONE), ctypes.byref(ZERO)


@dataclass(frozen=True)
class Algorithm:
    """A cuSPARSELt algorithm selection: configuration id and split-K settings."""

    config_id: int
    split_k: int
    split_k_mode: int
    split_k_buffers: int

    def attributes(self) -> list[tuple[int, int]]:
        split = [(ALG_SPLIT_K, self.split_k), (ALG_SPLIT_K_MODE, self.split_k_mode),
                 (ALG_SPLIT_K_BUFFERS, self.split_k_buffers)] if self.split_k > 1 else []
        return [(ALG_CONFIG_ID, self.config_id), *split]


# product (N, K, M, dtype, out dtype, x row-major, bias, device) -> the algorithm tuning picked for it
TUNED: dict[tuple, Algorithm] = {}


def current_stream(device: torch.device) -> int:
    """torch's current CUDA stream on `device`, as a raw handle (without building a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                              torch.cuda.current_device())


class WeightLayout:
    """The structured descriptor of a 2:4 weight (N, K) and its compressed and scratch sizes, made
    once: its init and destroy take ~185 us of host time on the H100 machines' hosts, against
    ~10 us for the compression call itself (4096 x 1024 fp16, on the H100); fixed-mask training
    compresses with it per mask (FixedMaskCompression), or every step where that falls back."""

    def __init__(self, lib: Library, handle, n: int, k: int, dtype: torch.dtype):
        self.lib, self.descriptor = lib, Opaque()
        lib.call("cusparseLtStructuredDescriptorInit", handle, self.descriptor.ptr, n, k, k, ALIGNMENT,
                 VALUE_TYPES[dtype], ORDER_ROW, SPARSITY_50_PERCENT)
        self.initialized = True
        size, buffer_size = ctypes.c_size_t(), ctypes.c_size_t()
        lib.call("cusparseLtSpMMACompressedSize2", handle, self.descriptor.ptr, ctypes.byref(size),
                 ctypes.byref(buffer_size))
        self.compressed_bytes, self.buffer_bytes = size.value, buffer_size.value

    def __del__(self):
        dll = getattr(getattr(self, "lib", None), "dll", None)
        if dll is not None and getattr(self, "initialized", False):  # else: init failed, or shutdown
            dll.cusparseLtMatDescriptorDestroy(self.descriptor.ptr)


class SparseGemm:
    """cuSPARSELt products y = x W^T + b with 2:4 weights W of one shape (N, K), dtype and CUDA
    device: compression of such weights, and one plan per input row count, input layout and
    bias, made on first use and kept (the weight's values are not part of a plan, so a training
    step compresses its new weight and reuses the plans). x has W's dtype; y has it too, or, for
    e4m3 operands, `out_dtype` (float16 or bfloat16: the fp32 sums rounded once, unscaled)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device,
                 out_dtype: torch.dtype | None = None):
        out_dtype = out_dtype or dtype
        reason = unavailable_problem(device, dtype) or shape_problem(out_features, in_features, dtype)
        allowed = OUTPUT_TYPES if dtype.itemsize == 1 else (dtype,)
        if not reason and out_dtype not in allowed:
            reason = (f"a {dtype_name(dtype)} product writes {' or '.join(map(dtype_name, allowed))}, "
                      f"not {dtype_name(out_dtype)}")
        if reason:
            raise LowconvError(f"cuSPARSELt cannot take this 2:4 weight: {reason}")
        self.lib = library()
        self.out_features, self.in_features, self.dtype, self.device = out_features, in_features, dtype, device
        self.out_dtype = out_dtype
        self.handle = self.lib.handle(device)
        self.weights = WeightLayout(self.lib, self.handle, out_features, in_features, dtype)
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()
        # One call at a time: ctypes lets go of the GIL in cusparseLtMatmul, and a plan evicted
        # (and destroyed) by another thread's call must not be the one running.
        self.lock = threading.Lock()
        self.key = register(self)

    def __deepcopy__(self, memo) -> SparseGemm:
        """Itself: a copy of a module shares its plans, which hold no weights (and a lock, which
        does not copy)."""
        return self

    def compress(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight (N, K) in cuSPARSELt's layout (kept values and metadata in one uint8 buffer).
        Values outside the 2:4 pattern are not checked: the caller prunes."""
        if weight.shape != (self.out_features, self.in_features) or weight.dtype != self.dtype:
            raise LowconvError(f"cuSPARSELt compress: weight {tuple(weight.shape)} {weight.dtype} is not "
                               f"({self.out_features}, {self.in_features}) {self.dtype}")
        weight = weight.contiguous()
        layout = self.weights
        compressed = torch.empty(layout.compressed_bytes, dtype=torch.uint8, device=self.device)
        buffer = torch.empty(max(layout.buffer_bytes, 1), dtype=torch.uint8, device=self.device)
        stream = VOID_P(current_stream(self.device))
        self.lib.call("cusparseLtSpMMACompress2", self.handle, layout.descriptor.ptr, 1, OP_NON_TRANSPOSE,
                      VOID_P(weight.data_ptr()), VOID_P(compressed.data_ptr()), VOID_P(buffer.data_ptr()), stream)
        return compressed

    def plan(self, x2: torch.Tensor, x_row_major: bool, bias: torch.Tensor | None, tuned: bool,
             compressed: torch.Tensor, out: torch.Tensor) -> Plan:
        """The plan of this product, made on first use (after tuning, if asked for and not yet
        done in this process for this product)."""
        rows = x2.shape[0]
        key = (rows, x_row_major, None if bias is None else bias.data_ptr(), tuned)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        make = functools.partial(Plan, self.lib, self.handle, self.out_features, self.in_features, rows, self.dtype,
                                 self.out_dtype, x_row_major, bias)
        algorithm = None
        if tuned:
            product = (self.out_features, self.in_features, rows, self.dtype, self.out_dtype, x_row_major,
                       bias is not None, self.device)
            if product not in TUNED:
                TUNED[product] = tune(make, compressed, x2, out)
            algorithm = TUNED[product]
        plan = self.plans[key] = make(algorithm)
        if len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return plan

    def linear(self, compressed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
               tuned: bool = False) -> torch.Tensor:
        """y = x W^T + b, W given compressed, x (..., K); y is y^T's transposed view. tuned=True:
        this product runs the algorithm that tuning picks for it (tuned once per process and
        product, on its first call)."""
        if x.shape[-1] != self.in_features or x.dtype != self.dtype or x.device != self.device:
            raise LowconvError(f"cuSPARSELt 2:4 linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit "
                               f"the weight ({self.out_features}, {self.in_features}) {self.dtype} on {self.device}")
        if bias is not None and (bias.shape != (self.out_features,) or bias.dtype != self.out_dtype):
            raise LowconvError(f"cuSPARSELt 2:4 linear: bias {tuple(bias.shape)} {bias.dtype} does not fit "
                               f"({self.out_features},) {self.out_dtype}")
        rows = x.numel() // self.in_features
        out, y = linear_output(x, self.out_features, self.out_dtype)
        if rows:
            x2, x_row_major = dense_operand(x.reshape(rows, self.in_features))
            with self.lock:
                plan = self.plan(x2, x_row_major, None if bias is None else bias.contiguous(), tuned, compressed, out)
                plan.run("cusparseLtMatmul", compressed, x2, out)
        return y


def linear_output(x: torch.Tensor, out_features: int,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, y) of a product y = x W^T + b, x (..., K): D = y^T (N, M padded as dense_operand pads
    it), row-major, of out_dtype (default x's), into which cuSPARSELt writes; and y (..., N), D's
    transposed view. What the custom ops' fake implementations return too (torch.compile then
    knows y's strides)."""
    rows = x.numel() // x.shape[-1]
    out = torch.empty(out_features, rows + -rows % row_multiple(x.dtype), dtype=out_dtype or x.dtype,
                      device=x.device)
    return out, out[:, :rows].t().reshape(*x.shape[:-1], out_features)


class FixedMaskCompression:
    """Compression of the weights (N, K) of one SparseGemm under one fixed 2:4 mask, without
    cuSPARSELt's compression per weight. Its layout (cuSPARSELt 0.8.0 on the H100, checked at
    (32..4096) x (64..4096), fp16 and bf16; a 64 x 32 weight came out otherwise): the kept values,
    row-major (N, K/2), then metadata that depends on the kept positions only. So the metadata
    comes once, from compressing the mask itself (every kept value 1), into a buffer whose values
    part each `compress_kept` overwrites with a copy of the weight's kept values (a training
    layer's parameter). The layout is checked again here, per mask, against cuSPARSELt's own
    compression of a probe (its kept values gathered by lowconv.kernels.pack24); where it differs,
    `compress_kept` falls back to cuSPARSELt's compression (with a warning).

    One buffer serves every call: a weight compressed here is valid until the next compression, in
    stream order. That is what a forward, or a backward, of one layer needs on one stream; calls of
    one layer on several streams at once would race on it. Another mask is taken in place (`use`),
    so that a CUDA graph that captured a compression keeps reading and writing live buffers, and
    compresses under the new mask once `use` has run. Memory: the buffer (about 0.56x the weight's
    bytes in fp16/bf16) and the codes (1 byte per 4 values) stay allocated.

    `name` names the mask in errors (e.g. a transposable mask's transpose)."""

    def __init__(self, gemm: SparseGemm, mask: torch.Tensor, name: str = "a 2:4 mask"):
        n, k = gemm.out_features, gemm.in_features
        self.gemm, self.name = gemm, name
        self.codes = torch.empty(n, k // 4, dtype=torch.uint8, device=gemm.device)
        self.buffer = torch.empty(gemm.weights.compressed_bytes, dtype=torch.uint8, device=gemm.device)
        self.values = self.buffer[:n * k // 2 * gemm.dtype.itemsize].view(gemm.dtype).view(n, k // 2)
        self.use(mask)

    def use(self, mask: torch.Tensor) -> None:
        """Compress under `mask` from now on: its codes and metadata written over the old ones."""
        gemm = self.gemm
        n, k = gemm.out_features, gemm.in_features
        if mask.shape != (n, k):
            raise LowconvError(f"{self.name} {tuple(mask.shape)} does not fit the weight ({n}, {k})")
        self.codes.copy_(kept_codes(mask, self.name))
        self.buffer.copy_(gemm.compress(mask.to(gemm.dtype)))
        self.mask = mask
        ramp = (torch.arange(n * k, device=mask.device) % 251 + 1).to(gemm.dtype).view(n, k)
        probe = torch.where(mask, ramp, torch.zeros((), dtype=gemm.dtype, device=mask.device))
        self.gathers = torch.equal(gemm.compress(probe), self._gather(probe))
        if not self.gathers:
            warnings.warn(f"cuSPARSELt {gemm.lib.version(gemm.device)} compresses 2:4 weights in a layout lowconv "
                          f"does not know; fixed-mask training compresses with cuSPARSELt every step (slower)")

    def compress_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """The weight given as its kept values (N, K/2), row-major in the mask's order (pack_kept's
        output), in cuSPARSELt's layout: a copy into the values part."""
        if self.gathers:
            self.values.copy_(kept)
            return self.buffer
        return self.gemm.compress(unpack_kept(kept, self.codes))

    def _gather(self, weight: torch.Tensor) -> torch.Tensor:
        pack_kept(weight, self.codes, self.values)
        return self.buffer


def tune(make, compressed: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> Algorithm:
    """The fastest algorithm for a product (make(algorithm) -> its Plan), timed on the product's
    own operands: among cuSPARSELt's search pick, its default and every configuration id without
    split-K (27 for fp16, 21 for bf16 with cuSPARSELt 0.8.0 on the H100), each timed briefly (one
    that fails to plan or run is left out); then the FINALISTS fastest again, interleaved, with
    more calls. Short timings of three candidates picked a configuration no faster than the
    default in one run out of several (scripts/bench_semi_sparse.py, H100)."""
    searched, default = make(), make()
    searched.run("cusparseLtMatmulSearch", compressed, x, out)
    configurations = default.attribute(ALG_CONFIG_MAX_ID)  # ids 0 .. configurations - 1
    candidates = {searched.algorithm(), default.algorithm(),
                  *(Algorithm(config, 1, 0, 0) for config in range(configurations))}
    plans, times = {}, {}
    for algorithm in candidates:
        try:
            plan = make(algorithm)
            times[algorithm] = plan.ms(compressed, x, out)
        except LowconvError:  # a configuration the library does not take (or run) for this product
            continue
        plans[algorithm] = plan
    finalists = sorted(times, key=times.get)[:FINALISTS]
    samples = {algorithm: [] for algorithm in finalists}
    for _ in range(FINAL_ROUNDS):
        for algorithm in finalists:
            samples[algorithm].append(plans[algorithm].ms(compressed, x, out))
    return min(finalists, key=lambda algorithm: sorted(samples[algorithm])[FINAL_ROUNDS // 2])


class SparseWeight:
    """A fixed 2:4-pruned weight (N, K) compressed for cuSPARSELt, for inference:
    `linear(x, bias)` is y = x W^T + b."""

    def __init__(self, weight: torch.Tensor):
        self.gemm = SparseGemm(*weight.shape, weight.dtype, weight.device)
        self.compressed = self.gemm.compress(weight)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, tuned: bool = False) -> torch.Tensor:
        return self.gemm.linear(self.compressed, x, bias, tuned)


def dense_operand(x2: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x (M, K) as cuSPARSELt can read it, and whether it is row-major: as it lies when row-major,
    or column-major (a transposed layer output), with 16-byte aligned data; else a row-major
    copy, its rows zero-padded to a multiple of row_multiple(x's dtype)."""
    rows, cols = x2.shape
    multiple = row_multiple(x2.dtype)
    if rows % multiple:
        return torch.cat([x2, x2.new_zeros(-rows % multiple, cols)]), True
    if x2.data_ptr() % ALIGNMENT == 0:
        if x2.stride() == (cols, 1):
            return x2, True
        if x2.stride() == (1, rows) and x2.dtype.itemsize != 1:  # e4m3 products take x row-major only
            return x2, False
    return x2.clone(memory_format=torch.contiguous_format), True
