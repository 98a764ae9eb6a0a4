"""A stand-in for the flash_attn package (not installed here): its three varlen functions with
flash-attn 2's signatures, computed in torch per segment (fp32 scores and softmax, the output in
q's dtype). `installed(monkeypatch)` puts it in sys.modules as `flash_attn`."""
import sys
from types import ModuleType

import torch


def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])
    for q0, q1, k0, k1 in bounds:
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[k0:k1].float()).to(q.dtype)
    return out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    q, k, v = qkv.unbind(1)
    return attend(q, k, v, cu_seqlens, cu_seqlens, softmax_scale, causal)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    k, v = kv.unbind(1)
    return attend(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    return attend(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


def installed(monkeypatch) -> ModuleType:
    """The stand-in, as sys.modules["flash_attn"] for the test."""
    module = ModuleType("flash_attn")
    for function in (flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_func):
        setattr(module, function.__name__, function)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module
