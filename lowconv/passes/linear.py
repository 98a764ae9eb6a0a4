"""Find linear sites: nn.Linear modules, F.linear calls, torch.addmm(b, x, W) and x @ W (+ b).

The last two are how Hugging Face's Conv1D (GPT-2) and hand-written layers spell a linear; their
weight is laid out (in, out). Only parameter weights count: a product of two activations is not
a linear layer.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lowconv.passes.fx_nodes import ADDS, MATMULS, op_is
from lowconv.passes.mha_expand import ExpandedMultiheadAttention
from lowconv.passes.trace import Region, join_fqn
from lowconv.site import LinearInfo, Site, class_names, dtype_name, tensor_meta, value_meta


def owner_classes(node: fx.Node, region: Region) -> list[str]:
    """Classes of the innermost module whose forward made this node."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        _, cls = list(stack.values())[-1]
        return class_names(cls)
    return class_names(type(region.module))


def parameter_at(region: Region, node) -> nn.Parameter | None:
    """The parameter a get_attr node reads, or None (a buffer, a constant, not a get_attr)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        return region.graph.get_parameter(node.target)
    except AttributeError:
        return None


def module_site(region: Region, fqn: str, linear: nn.Linear, node: fx.Node | None) -> Site:
    if node is not None:
        meta_in, meta_out = tensor_meta(linear_input(node)), tensor_meta(node)
    else:
        args = region.example_args or ()
        meta_in = value_meta(args[0]) if args else None
        meta_out = region.output_meta
    info = LinearInfo(
        form="module",
        in_features=linear.in_features,
        out_features=linear.out_features,
        bias=linear.bias is not None,
        weight=join_fqn(fqn, "weight"),
        bias_name=join_fqn(fqn, "bias") if linear.bias is not None else None,
        weight_layout="out_in",
        dtype=dtype_name(linear.weight.dtype),
    )
    return Site("linear", fqn, region.fqn, class_names(type(linear)), info, meta_in, meta_out,
                output_node=node, module_backed=True)


def linear_input(node: fx.Node):
    """The input of an nn.Linear's or F.linear's call, given by position or as `input=`."""
    return node.args[0] if node.args else node.kwargs.get("input")


def match_functional(node: fx.Node, region: Region):
    """(form, x, weight node, bias node or None, output node, nodes, weight layout) for a functional
    linear."""
    if node.op != "call_function":
        return None
    if node.target is F.linear:
        x, w = linear_input(node), node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if parameter_at(region, w) is None or (b is not None and parameter_at(region, b) is None):
            return None
        return "functional", x, w, b, node, [node], "out_in"
    if node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        b, x, w = node.args
        if parameter_at(region, w) is None or parameter_at(region, b) is None:
            return None
        return "addmm", x, w, b, node, [node], "in_out"
    if node.target in MATMULS and len(node.args) == 2:
        x, w = node.args
        source = transposed_parameter(region, w)  # x @ W.T (Falcon's FalconLinear): W as nn.Linear holds it
        nodes, layout = ([node, w], "out_in") if source is not None else ([node], "in_out")
        w = source if source is not None else w
        param = parameter_at(region, w)
        if param is None or param.dim() != 2:
            return None
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_function" and users[0].target in ADDS:
            add = users[0]
            b = add.args[1] if add.args[0] is node else add.args[0]
            bias = parameter_at(region, b)
            out_features = param.shape[0] if layout == "out_in" else param.shape[1]
            if bias is not None and bias.dim() == 1 and bias.shape[0] == out_features and not add.kwargs:
                return "matmul", x, w, b, add, [add, *nodes], layout
        return "matmul", x, w, None, node, nodes, layout
    return None


def transposed_parameter(region: Region, node) -> fx.Node | None:
    """The get_attr of the 2-D parameter that `node` transposes for its one reader (`w.T`, `w.t()`,
    `w.transpose(0, 1)`), or None."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        source = node.args[0]
    elif op_is(node, (torch.t,), ("t",)) and len(node.args) == 1:
        source = node.args[0]
    elif op_is(node, (torch.transpose,), ("transpose",)) and sorted(node.args[1:]) in ([0, 1], [-2, -1]):
        source = node.args[0]
    else:
        return None
    param = parameter_at(region, source)
    return source if param is not None and param.dim() == 2 else None


def functional_site(node: fx.Node, region: Region) -> Site | None:
    match = match_functional(node, region)
    if match is None:
        return None
    form, x, w, b, out, nodes, layout = match
    weight = parameter_at(region, w)
    out_features, in_features = weight.shape if layout == "out_in" else weight.shape[::-1]
    weight_name = join_fqn(region.fqn, w.target)
    bias_name = join_fqn(region.fqn, b.target) if b is not None else None
    rel = op_place(w.target)
    info = LinearInfo(form, in_features, out_features, b is not None, weight_name, bias_name, layout,
                      dtype_name(weight.dtype))
    site = Site("linear", join_fqn(region.fqn, rel), region.fqn, owner_classes(node, region), info,
                tensor_meta(x), tensor_meta(out), args=(x,), output_node=out, nodes=nodes)
    site.unsupported = functional_linear_problem(site, region, rel, w, b)
    return site


def op_place(weight_target: str) -> str:
    """Where the op module goes in the region: the weight's place (`mlp.fc.weight` -> `mlp.fc`,
    `mlp.w1` -> `mlp.w1`); `linear` when the region itself owns the weight (a traced Conv1D)."""
    if weight_target == "weight":
        return "linear"
    return weight_target.removesuffix(".weight")


def functional_linear_problem(site: Site, region: Region, rel: str, w: fx.Node, b: fx.Node | None) -> str | None:
    """Why the op module cannot take its place in the region, if it cannot."""
    own = {w.target} | ({b.target} if b is not None else set())
    if rel == "linear" and hasattr(region.module, "linear"):
        return f"{site.fqn} already exists"
    if len(w.users) > 1 or (b is not None and len(b.users) > 1):
        return "its weight or bias is also used by other computation"
    for node in region.graph.graph.nodes:
        if node is w or node is b or node.op not in ("get_attr", "call_module"):
            continue
        if node.target in own:
            return "its weight or bias is read twice in the graph"
        if node.target == rel or node.target.startswith(rel + "."):
            return f"{site.fqn} is also used by other computation ({node.name})"
    return None


def mha_out_proj_site(region: Region, mha_fqn: str, mha: nn.MultiheadAttention) -> Site:
    """nn.MultiheadAttention's out_proj: an nn.Linear that the MHA's fused forward never calls
    (F.multi_head_attention_forward reads its weight, as it reads in_proj_weight), so no linear op
    can take its place. Listed, so that inspect shows every nn.Linear, and kept with the reason."""
    site = module_site(region, join_fqn(mha_fqn, "out_proj"), mha.out_proj, None)
    site.input = site.output = None  # the lone-region reading would be the MHA's own input
    site.unsupported = ("inside nn.MultiheadAttention, whose forward reads this weight (and in_proj_weight) "
                        "itself; the sparse_attention op converts the attention and keeps both projections")
    return site


def find_linear_sites(region: Region) -> list[Site]:
    if region.graph is None:
        if isinstance(region.module, nn.Linear):
            return [module_site(region, region.fqn, region.module, None)]
        if isinstance(region.module, nn.MultiheadAttention):
            return [mha_out_proj_site(region, region.fqn, region.module)]
        return []
    sites, called = [], set()
    for node in region.graph.graph.nodes:
        if node.op == "call_module" and node.target not in called:  # one site however often called
            called.add(node.target)
            module = region.graph.get_submodule(node.target)
            if isinstance(module, nn.Linear):
                sites.append(module_site(region, join_fqn(region.fqn, node.target), module, node))
            elif isinstance(module, nn.MultiheadAttention):
                sites.append(mha_out_proj_site(region, join_fqn(region.fqn, node.target), module))
        else:
            site = functional_site(node, region)
            if site is not None:
                sites.append(site)
    return sites + uncalled_in_projs(region, called)


def uncalled_in_projs(region: Region, called: set[str]) -> list[Site]:
    """The in_proj of each expanded MHA in the region's graph that the graph does not call: its q,
    k and v are not one tensor (cross-attention, or an MHA traced as a region of its own, whose
    three inputs are three placeholders), so it projects them with slices of the weight. Listed,
    kept, with the reason."""
    sites = []
    for name, module in region.graph.named_modules():
        if isinstance(module, ExpandedMultiheadAttention) and module.packed and f"{name}.in_proj" not in called:
            site = module_site(region, join_fqn(region.fqn, f"{name}.in_proj"), module.in_proj, None)
            site.input = site.output = None
            site.unsupported = ("the expanded nn.MultiheadAttention's query is not its key and value (cross-attention, "
                                "or an attention traced on its own, with q, k and v as three inputs): it projects "
                                "them with slices of this weight")
            sites.append(site)
    return sites
