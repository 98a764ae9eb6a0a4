"""libcusparseLt through ctypes: the library found and loaded once, its functions typed, one handle
per CUDA device, the enum values lowconv passes, and whether a device can run it at all.

The opaque cuSPARSELt structs (handle, descriptors, plan) are fixed-size byte arrays in the
header (1 KiB to 11 KiB depending on the version); they are allocated here bigger than any of
those, 64-byte aligned, and never moved or copied, since the plan points into the descriptors.
Enum values are those of cusparse.h / cusparseLt.h (0.6 and later; scripts/bench_semi_sparse.py
checks them against the headers shipped beside the library: they matched cuSPARSELt 0.8.0).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import torch

from lowconv.errors import LowconvError

STRUCT_BYTES = 16384
STRUCT_ALIGN = 64

CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 2, 14, 28  # cudaDataType
ORDER_ROW = 2  # cusparseOrder_t
OP_NON_TRANSPOSE, OP_TRANSPOSE = 0, 1  # cusparseOperation_t
SPARSITY_50_PERCENT = 0  # cusparseLtSparsity_t
COMPUTE_32F = 2  # cusparseComputeType (0.6+): fp32 accumulation for fp16, bf16 and e4m3 operands
MATMUL_BIAS_POINTER = 8  # cusparseLtMatmulDescAttribute_t
MATMUL_ALG_DEFAULT = 0  # cusparseLtMatmulAlg_t
# cusparseLtMatmulAlgAttribute_t
ALG_CONFIG_ID, ALG_CONFIG_MAX_ID, ALG_SPLIT_K, ALG_SPLIT_K_MODE, ALG_SPLIT_K_BUFFERS = 0, 1, 3, 4, 5


class Opaque:
    """One of cuSPARSELt's opaque structs: zeroed, aligned memory at a fixed address."""

    def __init__(self):
        self._buffer = ctypes.create_string_buffer(STRUCT_BYTES + STRUCT_ALIGN)
        base = ctypes.addressof(self._buffer)
        self.ptr = ctypes.c_void_p(base + (-base % STRUCT_ALIGN))


def find_library() -> str | None:
    """libcusparseLt's path: the copy this process already loaded (torch's CUDA build links it),
    else one in an installed nvidia-cusparselt wheel, else the system's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcusparseLt.so" in line:
                    return line.split(maxsplit=5)[-1].strip()
    except OSError:
        pass
    for root in sys.path:
        found = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcusparseLt.so*")))
        if found:
            return found[0]
    return ctypes.util.find_library("cusparseLt")


VOID_P, I64, U32, INT, SIZE_P = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)
SIGNATURES = {  # name: argument types; every function returns a cusparseStatus_t (int)
    "cusparseLtInit": [VOID_P],
    "cusparseLtGetVersion": [VOID_P, ctypes.POINTER(INT)],
    "cusparseLtStructuredDescriptorInit": [VOID_P, VOID_P, I64, I64, I64, U32, INT, INT, INT],
    "cusparseLtDenseDescriptorInit": [VOID_P, VOID_P, I64, I64, I64, U32, INT, INT],
    "cusparseLtMatDescriptorDestroy": [VOID_P],
    "cusparseLtMatmulDescriptorInit": [VOID_P, VOID_P, INT, INT, VOID_P, VOID_P, VOID_P, VOID_P, INT],
    "cusparseLtMatmulDescSetAttribute": [VOID_P, VOID_P, INT, VOID_P, ctypes.c_size_t],
    "cusparseLtMatmulAlgSelectionInit": [VOID_P, VOID_P, VOID_P, INT],
    "cusparseLtMatmulAlgSetAttribute": [VOID_P, VOID_P, INT, VOID_P, ctypes.c_size_t],
    "cusparseLtMatmulAlgGetAttribute": [VOID_P, VOID_P, INT, VOID_P, ctypes.c_size_t],
    "cusparseLtMatmulPlanInit": [VOID_P, VOID_P, VOID_P, VOID_P],
    "cusparseLtMatmulGetWorkspace": [VOID_P, VOID_P, SIZE_P],
    "cusparseLtMatmulPlanDestroy": [VOID_P],
    "cusparseLtMatmul": [VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P,
                         ctypes.POINTER(VOID_P), ctypes.c_int32],
    "cusparseLtMatmulSearch": [VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P, VOID_P,
                               ctypes.POINTER(VOID_P), ctypes.c_int32],
    "cusparseLtSpMMACompressedSize2": [VOID_P, VOID_P, SIZE_P, SIZE_P],
    "cusparseLtSpMMACompress2": [VOID_P, VOID_P, INT, INT, VOID_P, VOID_P, VOID_P, VOID_P],
}


class Library:
    """The loaded libcusparseLt with typed functions, and one handle per CUDA device."""

    def __init__(self, path: str):
        self.path = path
        self.dll = ctypes.CDLL(path)
        for name, argtypes in SIGNATURES.items():
            function = getattr(self.dll, name)
            function.argtypes, function.restype = argtypes, INT
        self.handles: dict[int, Opaque] = {}

    def call(self, name: str, *args) -> None:
        status = getattr(self.dll, name)(*args)
        if status:
            raise LowconvError(f"cuSPARSELt {name} failed: {self.status_text(status)} ({self.path})")

    def status_text(self, status: int) -> str:
        describe = getattr(self.dll, "cusparseLtGetErrorString", None)
        if describe is None:
            return f"status {status}"
        describe.restype = ctypes.c_char_p
        return f"{describe(status).decode()} (status {status})"

    def handle(self, device: torch.device) -> ctypes.c_void_p:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.handles:
            handle = Opaque()
            with torch.cuda.device(index):  # a handle belongs to the device current at its init
                self.call("cusparseLtInit", handle.ptr)
            self.handles[index] = handle
        return self.handles[index].ptr

    def version(self, device: torch.device) -> str:
        version = INT()
        self.call("cusparseLtGetVersion", self.handle(device), ctypes.byref(version))
        major, rest = divmod(version.value, 1000)
        return f"{major}.{rest // 100}.{rest % 100}"


_library: Library | None = None
_library_error: str | None = None


def library() -> Library:
    """The library, loaded on first use; LowconvError when there is none to load."""
    global _library, _library_error
    if _library is None and _library_error is None:
        path = find_library()
        if path is None:
            _library_error = "libcusparseLt was not found (torch's CUDA wheels ship it as nvidia-cusparselt)"
        else:
            try:
                _library = Library(path)
            except (OSError, AttributeError) as error:
                _library_error = f"{path} could not be loaded: {error}"
    if _library is None:
        raise LowconvError(f"cuSPARSELt is not available: {_library_error}")
    return _library


def unavailable_problem(device: torch.device, dtype: torch.dtype = torch.float16) -> str | None:
    """Why cuSPARSELt cannot run 2:4 GEMMs of `dtype` operands on `device`, or None when it can
    (sm_80 and later; e4m3 on sm_90)."""
    if device.type != "cuda":
        return f"cuSPARSELt runs on CUDA devices, not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"2:4 sparse tensor cores need compute capability 8.0 or later (this GPU is {major}.{minor})"
    if dtype.itemsize == 1 and major < 9:
        return f"cuSPARSELt's e4m3 2:4 GEMM needs compute capability 9.0 or later (this GPU is {major}.{minor})"
    try:
        library().handle(device)
    except LowconvError as error:
        return str(error)
    return None
