"""Put op modules in the place of the sites they convert.

A site that is a whole module (nn.Linear, nn.MultiheadAttention) is swapped for the op module
at the same FQN. A site that is a piece of graph (F.linear, addmm, SDPA, hand-written attention)
becomes one call_module of the op module, registered at the site's FQN; the old nodes and the
parameters only they used are removed, and the region's GraphModule takes the place of the
region's module in the model (a region with swaps only keeps its own module and class, unless a
module in it has a fused inference path that reads the swapped modules' weights). An attention
site of a transformers attention module is not a piece of graph to replace: its op module goes
beside that module, which calls it through transformers' attention interface (hf_attention.py),
so a region with such sites and swaps keeps its class too. Each op's rewrite_graph then runs
on each rewritten region's graph (SpTr's pair layout that only converted window attention
reads is dropped: ops/window_rows.py).
The model passed in is changed: callers pass their own copy.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from lowconv.passes import hf_attention
from lowconv.passes.trace import HOOKS, Region, Trace, has_hooks
from lowconv.passes.tracer import has_fused_path, recompile
from lowconv.ops import OPS
from lowconv.site import Site


def relative(fqn: str, region: Region) -> str:
    return fqn[len(region.fqn) + 1:] if region.fqn else fqn


def set_module(root: nn.Module, fqn: str, module: nn.Module) -> nn.Module:
    """Put `module` at `fqn` under root (replacing a module or parameter there); returns the root."""
    if not fqn:
        return module
    *path, name = fqn.split(".")
    parent = root
    for item in path:  # a GraphModule holds only the modules its graph uses: add missing parents
        if not isinstance(getattr(parent, item, None), nn.Module):
            setattr(parent, item, nn.Module())
        parent = getattr(parent, item)
    if hasattr(parent, name) and not isinstance(getattr(parent, name), (nn.Module, nn.Parameter)):
        delattr(parent, name)  # a plain attribute or buffer would shadow the module
    setattr(parent, name, module)
    return root


def swap_module(root: nn.Module, fqn: str, module: nn.Module) -> nn.Module:
    """set_module, the old module's hooks moved onto `module`: where a module is swapped whole (a
    site module for its op module, a region for its traced graph) its hooks still run, on the
    module that now takes its inputs and gives its output."""
    old = root.get_submodule(fqn) if fqn else root
    if has_hooks(old):
        for name in HOOKS:
            getattr(module, name).update(getattr(old, name))
            getattr(old, name).clear()
        if old._backward_hooks:
            module._is_full_backward_hook = old._is_full_backward_hook
    return set_module(root, fqn, module)


def delete_attr(root: nn.Module, target: str) -> None:
    parent_name, _, name = target.rpartition(".")
    parent = root.get_submodule(parent_name)
    if hasattr(parent, name):
        delattr(parent, name)


def site_params(site: Site, model: nn.Module) -> dict[str, torch.Tensor]:
    """The site's original tensors, as `Op.from_site` takes them (weights laid out (out, in))."""
    if site.kind == "linear":
        return linear_site_params(site, lambda name: model.get_parameter(name).detach())
    if site.module_backed:
        return {k: v.detach() for k, v in model.get_submodule(site.fqn).state_dict().items()}
    return {}


def linear_site_params(site: Site, tensor: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A linear site's {"weight": (out, in), "bias"}, each read by `tensor(parameter name)`."""
    weight = tensor(site.info.weight)
    params = {"weight": weight if site.info.weight_layout == "out_in" else weight.t().contiguous()}
    if site.info.bias_name:
        params["bias"] = tensor(site.info.bias_name)
    return params


def freeze_named(module: nn.Module, frozen: list[str]) -> nn.Module:
    """`module` with requires_grad off on its parameters named in `frozen` (a site's: those whose
    originals the user froze, so that a frozen backbone stays frozen)."""
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return module


def replace_in_graph(gm: fx.GraphModule, site: Site, rel: str, module: nn.Module,
                     replaced: dict[fx.Node, fx.Node]) -> None:
    """`replaced` maps the output nodes of the region's sites already replaced to their calls
    (a site's args, taken when it was found, can be another site's output: F.linear(F.linear(x, a), b));
    this site's is added."""
    if site.module_backed:
        swap_module(gm, rel, module)
        return
    graph = gm.graph
    with graph.inserting_before(site.output_node):
        # create_node, not call_module: the module is registered once the old attributes are gone
        args = fx.node.map_arg(tuple(site.args), lambda node: replaced.get(node, node))
        call = graph.create_node("call_module", rel, args=args)
    site.output_node.replace_all_uses_with(call)
    replaced[site.output_node] = call
    read = {a for node in site.nodes for a in node.all_input_nodes if a.op == "get_attr"} - set(site.nodes)
    erase_unread(graph, sorted(site.nodes, reverse=True))  # graph order, last first: each before what it reads
    for node in read:  # the site's weights and buffers that nothing reads any more
        if not node.users:
            graph.erase_node(node)
            if not any(n.op == "get_attr" and n.target == node.target for n in graph.nodes):
                delete_attr(gm, node.target)
    set_module(gm, rel, module)


def erase_unread(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase each of a site's `nodes` that nothing reads any more, then the computations that only
    they read (e.g. the index ranges of a causal mask that causal=True replaced): pure
    call_function and call_method nodes left without users."""
    for node in nodes:
        if node.users:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        orphans = [n for n in inputs if not n.users and n.op in ("call_function", "call_method")
                   and n not in nodes and not n.is_impure()]
        erase_unread(graph, orphans)


def rewrite(model: nn.Module, trace: Trace, sites: list[Site], modules: dict[str, nn.Module]) -> nn.Module:
    """Replace each site whose FQN is in `modules` by that module; returns the converted model."""
    for region in trace.regions:
        region_sites = [s for s in sites if s.region == region.fqn and s.fqn in modules]
        if not region_sites:
            continue
        for site in region_sites:
            modules[site.fqn].train(region.module.training)
        if not replaces_region(region, region_sites):  # the model keeps its own classes
            for site in region_sites:
                if site.module_backed:
                    model = swap_module(model, site.fqn, modules[site.fqn])
                else:
                    hf_attention.attach(model, site, modules[site.fqn])
            continue
        gm, replaced = region.graph, {}
        for site in region_sites:
            replace_in_graph(gm, site, relative(site.fqn, region), modules[site.fqn], replaced)
        for op in OPS.values():  # once all of the region's sites are in: a kept chain's layout stays
            if op.rewrite_graph:
                op.rewrite_graph(gm)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        recompile(gm)
        gm.train(region.module.training)
        keep_buffers_out_of_state_dict(gm, region.module)
        model = swap_module(model, region.fqn, gm)
    leave_fused_paths(model, modules.values())
    return model


def replaces_region(region: Region, converted: list[Site]) -> bool:
    """Whether converting these sites of the region replaces its module by its rewritten graph:
    where a site is a piece of graph (not a module, nor an attention that transformers' interface
    calls), or a module with a fused inference path would read swapped modules' weights."""
    return (any(not s.module_backed and not hf_attention.served(s, region) for s in converted)
            or (bool(converted) and has_fused_path(region.module)))


def served_sites(trace: Trace, sites: list[Site], converted) -> list[Site]:
    """The sites (of those whose FQN is in `converted`) that transformers' attention interface will call."""
    served = []
    for region in trace.regions:
        region_sites = [s for s in sites if s.region == region.fqn and s.fqn in converted]
        if not replaces_region(region, region_sites):
            served += [s for s in region_sites if not s.module_backed]
    return served


def leave_fused_paths(model: nn.Module, converted) -> None:
    """Keep torch's fused inference paths away from converted modules where a module with one
    (tracer.FUSED_INFERENCE_PATHS) kept its class (it did not trace, or is above the traced
    regions): an encoder's nested-tensor path would hand them nested tensors, and a layer's fused
    kernel would read their weights instead of calling them. Both are off for such modules (torch
    reads these attributes only to choose the fast path). Encoders without a converted module
    keep theirs."""
    converted = {id(m) for m in converted}
    for module in model.modules():
        if not any(id(m) in converted for m in module.modules()):
            continue
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
        elif isinstance(module, nn.TransformerEncoderLayer):
            module.activation_relu_or_gelu = 0


def keep_buffers_out_of_state_dict(gm: fx.GraphModule, original: nn.Module) -> None:
    """GraphModule registers every buffer it copies as persistent: restore the original's
    non-persistent ones (rotary tables, causal masks) so the checkpoint does not grow."""
    for name, _ in gm.named_buffers():
        path, _, attr = name.rpartition(".")
        try:
            owner = original.get_submodule(path)
        except AttributeError:
            continue
        if attr in owner._non_persistent_buffers_set:
            gm.get_submodule(path)._non_persistent_buffers_set.add(attr)


class SiteTap(nn.Module):
    """Identity on a site's output that hands record(fqn, output, args, kwargs) what the site saw."""

    def __init__(self, fqn: str, record):
        super().__init__()
        self.fqn, self.record = fqn, record

    def forward(self, output, *args):
        self.record(self.fqn, output, args, {})
        return output


def tap_sites(model: nn.Module, trace: Trace, sites: list[Site], record) -> nn.Module:
    """`model` with each site's output and inputs passed to record(fqn, output, args, kwargs);
    the computation is unchanged."""
    for site in sites:
        if site.module_backed:
            model.get_submodule(site.fqn).register_forward_hook(
                lambda mod, args, kwargs, out, fqn=site.fqn: record(fqn, out, args, kwargs), with_kwargs=True)
    for region in trace.regions:
        region_sites = [s for s in sites if s.region == region.fqn and not s.module_backed]
        if not region_sites or region.graph is None:
            continue
        gm = region.graph
        for i, site in enumerate(region_sites):
            name = f"_lowconv_tap_{i}"
            gm.add_submodule(name, SiteTap(site.fqn, record))
            with gm.graph.inserting_after(site.output_node):
                tap = gm.graph.call_module(name, args=(site.output_node, *site.args))
            site.output_node.replace_all_uses_with(tap, delete_user_cb=lambda user, tap=tap: user is not tap)
        recompile(gm)
        gm.train(region.module.training)
        model = swap_module(model, region.fqn, gm)
    return model
