"""`sparse_attention`: attention through lowconv's attention kernels, in a chosen dtype and tile
layout (attention_calls.py: the options and how a call computes).

One op, one module per form of attention site (site.AttentionInfo.form), each in its own file:
  sdpa, handwritten  F.scaled_dot_product_attention, or softmax(q k^T) v written out: a
                     SparseAttention called with the site's (q, k, v[, mask]) (functional_attention.py)
  mha                an nn.MultiheadAttention: a SparseMultiheadAttention with its parameters and
                     state-dict names (mha_attention.py)
  window             an SpTr window-attention chain: a SparseWindowAttention (window_attention.py)
  varlen             a flash-attn varlen call: a VarlenAttention (varlen_attention.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from lowconv.ops.attention_calls import SparseAttentionOptions
from lowconv.ops.functional_attention import functional_module, functional_site_problem
from lowconv.ops.mha_attention import mha_empty, mha_from_site, mha_site_problem
from lowconv.ops.registry import register_op
from lowconv.ops.varlen_attention import varlen_module, varlen_site_problem
from lowconv.ops.window_attention import window_module, window_site_problem
from lowconv.ops.window_rows import drop_pair_layouts
from lowconv.site import Site


@dataclass(frozen=True)
class AttentionForm:
    site_problem: Callable[[Site, SparseAttentionOptions], str | None]
    from_site: Callable[[Site, SparseAttentionOptions, dict], nn.Module]
    empty: Callable[[Site, SparseAttentionOptions], nn.Module]


FUNCTIONAL = AttentionForm(functional_site_problem, functional_module, functional_module)
FORMS = {"sdpa": FUNCTIONAL, "handwritten": FUNCTIONAL,
         "mha": AttentionForm(mha_site_problem, mha_from_site, mha_empty),
         "window": AttentionForm(window_site_problem, window_module, window_module),
         "varlen": AttentionForm(varlen_site_problem, varlen_module, varlen_module)}


@register_op(SparseAttentionOptions, name="sparse_attention", kind="attention", rewrite_graph=drop_pair_layouts,
             description="attention in a chosen dtype (fp32 accumulation and softmax) and tile layout (auto, dense, "
                         "causal, local, mask); on CUDA through SDPA, or lowconv's block-attention kernels where they "
                         "skip tiles of the scores that SDPA computes")
class SparseAttentionForms:
    """The op's builder: each form's (FORMS, by site.info.form)."""

    @staticmethod
    def site_problem(site: Site, options: SparseAttentionOptions) -> str | None:
        return FORMS[site.info.form].site_problem(site, options)

    @staticmethod
    def from_site(site: Site, options: SparseAttentionOptions, params: dict) -> nn.Module:
        return FORMS[site.info.form].from_site(site, options, params)

    @staticmethod
    def empty(site: Site, options: SparseAttentionOptions) -> nn.Module:
        return FORMS[site.info.form].empty(site, options)
