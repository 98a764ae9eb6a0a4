"""Attention sites of transformers models, converted through transformers' attention interface.

A transformers attention module (LlamaAttention, GPT2Attention, BertSelfAttention, ...) computes
its core attention by calling the function that `ALL_ATTENTION_FUNCTIONS` holds under its config's
`_attn_implementation` ("sdpa", "eager", ...). Such a site is not rewritten in a graph: its op
module goes beside the module's own, at the site's FQN, and the config names "lowconv" (a model
made with "sdpa") or "lowconv_eager" (made with "eager"), which this file registers with
transformers: `attention_forward` for the attention, and the original's mask function for the
masks the model makes (SDPA's: a bool mask, or none where causal suffices; eager's: an additive
mask always, under which a query row with every key masked, as left padding makes, gets the mean
of v as in eager, not SDPA's zeros). So the model keeps its class, `generate`, its KV cache and
config, and every call (a prefill, a decoding step, lengths never traced) runs the op module with
the causality, scale and dropout that transformers passes, decided per call as its SDPA function
decides them. The original's own attention function runs where the site was kept (modules that
share the config) and, in an eager model, for calls that ask for the attention weights
(output_attentions), which the op does not compute.
"""
from __future__ import annotations

import torch
from torch import nn

from lowconv.errors import LowconvError
from lowconv.passes.trace import Region
from lowconv.site import Site

# The names registered with transformers' interfaces, by the implementation the model was made with
IMPLEMENTATIONS = {"sdpa": "lowconv", "eager": "lowconv_eager"}
OP_NAME = "lowconv_attention"  # the attention module's attribute that names its op module
# Arguments of transformers' attention functions that change the attention and that the op does not take.
NOT_TAKEN = ("position_bias", "softcap", "s_aux", "sinks", "cache")
PLAN_NOTE = ("called through transformers' attention interface (the model keeps its class and generate(); "
             "causality, scale and masks come with each call)")


def owner_path(site: Site) -> str:
    """The FQN of the module whose forward made the site (attention.site_fqn names it owner.attention)."""
    return site.fqn.rpartition(".")[0]


def dispatches_through_interface(module: nn.Module) -> bool:
    """Whether `module` computes its attention by calling what transformers' interface holds
    under its config's implementation, one that the config may be switched from."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    forward = getattr(type(module).forward, "__code__", None)
    return (implementation in (*IMPLEMENTATIONS, *IMPLEMENTATIONS.values()) and forward is not None
            and "ALL_ATTENTION_FUNCTIONS" in forward.co_names)


def served(site: Site, region: Region) -> bool:
    """Whether a converted site of `region` goes through the interface rather than into its graph."""
    if site.kind != "attention" or site.module_backed or site.info.form not in ("sdpa", "handwritten"):
        return False
    owner = owner_path(site)  # inside the region, as every site of it
    inside = "" if owner == region.fqn else owner[len(region.fqn) + 1:] if region.fqn else owner
    return dispatches_through_interface(region.module.get_submodule(inside))


def attach(model: nn.Module, site: Site, module: nn.Module) -> None:
    """Put `module` at the site's FQN, beside its attention module's own, and route that module's
    attention to it (its config's implementation becomes lowconv's for the one it was)."""
    register()
    owner = model.get_submodule(owner_path(site))
    name = site.fqn.rpartition(".")[2]
    owner.add_module(name, module)
    setattr(owner, OP_NAME, name)
    owner.config._attn_implementation = IMPLEMENTATIONS.get(owner.config._attn_implementation,
                                                            owner.config._attn_implementation)


def register() -> None:
    """Make lowconv's implementations ones that transformers knows (at every attach: a model loaded
    in a new process registers them again)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    for original, mask in (("sdpa", sdpa_mask_or_causal), ("eager", eager_mask)):
        AttentionInterface.register(IMPLEMENTATIONS[original], attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATIONS[original], mask)


def sdpa_mask_or_causal(*args, **kwargs) -> torch.Tensor | None:
    """transformers' sdpa_mask, but None (SDPA's is_causal, no mask) for a plain causal mask over as
    many keys as queries with no padding mask under torch.compile too, as sdpa_mask decides eagerly.
    With torch before 2.14 sdpa_mask cannot tell compiling from exporting (where a fixed is_causal
    would be wrong for other lengths) and always makes the mask; SDPA then computes every tile, the
    masked half too (a compiled Llama prefill's attention took twice the time, BENCHMARKS.md).
    Dynamo guards the decision: it rests on Python values and shapes, never on a tensor's data."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if not args and torch.compiler.is_compiling() and not exporting() and plain_causal(kwargs, causal_mask_function):
        return None
    return sdpa_mask(*args, **kwargs)


def exporting() -> bool:
    """torch.export's flag, read directly: dynamo before torch 2.14 folds torch.compiler.is_exporting()
    to True while compiling. Where the flag is missing, assume exporting (keep the mask)."""
    return getattr(torch.compiler, "_is_exporting_flag", True)


def plain_causal(kwargs: dict, causal_mask_function) -> bool:
    """Whether transformers asks for the causal mask alone, of as many keys as queries from position 0,
    with no padding mask and nothing added (transformers' own skip rule for these arguments): the
    arguments by their names in transformers 5 (q_length and q_offset, or cache_position before)."""
    q_length = kwargs.get("q_length")
    if q_length is None and isinstance(kwargs.get("cache_position"), torch.Tensor):
        q_length = kwargs["cache_position"].shape[0]
    q_offset = kwargs.get("q_offset", 0)
    return (kwargs.get("allow_is_causal_skip", True) and kwargs.get("mask_function") is causal_mask_function
            and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kwargs.get("kv_offset", 0) == 0
            and q_length is not None and q_length == kwargs.get("kv_length"))


def original_attention(module: nn.Module):
    """The attention function the module ran before: its model file's eager_attention_forward (what
    the module falls back to) for an eager model, else transformers' SDPA function."""
    if module.config._attn_implementation == IMPLEMENTATIONS["eager"]:
        eager = type(module).forward.__globals__.get("eager_attention_forward")
        if eager is not None:
            return eager
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for "lowconv": (output (batch, seq, heads, head_dim), None).

    q (batch, heads, seq_q, d), k and v (batch, kv_heads, seq_k, d): grouped heads go to the op
    as they are. Causal where transformers' SDPA function is: more than one query, no mask, and
    the module causal; a causal call over more keys than queries (an empty static cache at
    prefill) attends to the first seq_q keys, as SDPA's top-left causal band does.
    """
    name = getattr(module, OP_NAME, None)
    weights = kwargs.get("output_attentions", getattr(module.config, "output_attentions", False))
    if name is None or (weights and module.config._attn_implementation == IMPLEMENTATIONS["eager"]):
        if is_causal is not None:
            kwargs["is_causal"] = is_causal
        return original_attention(module)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
    given = [arg for arg in NOT_TAKEN if kwargs.get(arg) is not None]
    if given:
        raise LowconvError(f"{type(module).__name__}: lowconv's attention op does not take {', '.join(given)} "
                           f"(this attention was converted where the model did not pass it)")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    out = getattr(module, name)(query, key, value, attention_mask, is_causal=bool(causal), scale=scaling,
                                dropout=dropout)
    return out.transpose(1, 2).contiguous(), None
