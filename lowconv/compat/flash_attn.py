"""flash-attn's variable-length attention calls, as lowconv's tracer and passes need them.

    flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)        qkv (T, 3, h, d)
    flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, ...)   kv (T, 2, h, d)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)          q, k, v (T, h, d)

Each row attends to the rows of its segment (cu_seqlens (B+1,) int32: segment b is rows
cu_seqlens[b]:cu_seqlens[b+1]), softmax(q k^T * softmax_scale) v, softmax_scale None meaning
d^-0.5; the output (T, h, d) in q's dtype. Point Transformer V3 calls the packed form on its
serialized patches. The parameters are flash-attn 2's, in order (its documented signatures);
`flash_attn` is never imported here: a model that calls it has imported it already.
"""
from __future__ import annotations

import sys
from types import ModuleType

from lowconv.compat.trace_hooks import TraceHook

MODULES = ("flash_attn", "flash_attn.flash_attn_interface")
OPTIONAL = (("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False))
# Each function's parameters before the optional ones above, and the tensors among them.
VARLEN_FUNCTIONS = {
    "flash_attn_varlen_qkvpacked_func": ("qkv", "cu_seqlens", "max_seqlen"),
    "flash_attn_varlen_kvpacked_func": ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
}
TENSORS = {"flash_attn_varlen_qkvpacked_func": ("qkv",), "flash_attn_varlen_kvpacked_func": ("q", "kv"),
           "flash_attn_varlen_func": ("q", "k", "v")}
PACKED = {"flash_attn_varlen_qkvpacked_func": (True,), "flash_attn_varlen_kvpacked_func": (False, True),
          "flash_attn_varlen_func": (False, False, False)}  # whether each tensor packs two or three
ONLY_VARLEN_FUNC = ("block_table",)  # flash_attn_varlen_func's paged KV cache, last


def loaded_modules() -> list[ModuleType]:
    """flash-attn's modules that hold the functions, where a model has imported them."""
    return [sys.modules[name] for name in MODULES if isinstance(sys.modules.get(name), ModuleType)]


def varlen_functions() -> dict[object, str]:
    """The loaded varlen functions, each with its name."""
    return {function: name for module in loaded_modules() for name in VARLEN_FUNCTIONS
            if callable(function := getattr(module, name, None))}


def parameter_names(name: str) -> tuple[str, ...]:
    """The parameters of varlen function `name`, in order."""
    extra = ONLY_VARLEN_FUNC if name == "flash_attn_varlen_func" else ()
    return VARLEN_FUNCTIONS[name] + tuple(p for p, _ in OPTIONAL) + extra


def defaults(name: str) -> dict:
    return dict(OPTIONAL) | ({p: None for p in ONLY_VARLEN_FUNC} if name == "flash_attn_varlen_func" else {})


# The functions stay single calls when traced (their autograd Functions and CUDA extension cannot
# take a Proxy), called by name or as `flash_attn.flash_attn_varlen_qkvpacked_func(...)`.
TRACE_HOOK = TraceHook(autowrap_functions=lambda: tuple(varlen_functions()), autowrap_modules=loaded_modules)
