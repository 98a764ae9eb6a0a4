"""All sites of a traced model, region by region, each checked for what forbids converting it."""
from __future__ import annotations

from torch import nn

from lowconv.passes.attention import find_attention_sites
from lowconv.passes.linear import find_linear_sites
from lowconv.passes.trace import Trace, join_fqn
from lowconv.passes.varlen_attention import find_varlen_attention_sites
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.site import Site


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name the model holds it under (more than one: tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def read_by_traced_code(trace: Trace) -> dict[str, bool]:
    """Full names of what the traced code reads itself (get_attr: a parameter, a buffer), beside
    what the modules it calls read, each with whether only its device is read."""
    reads: dict[str, bool] = {}
    for region in trace.regions:
        for node in region.graph.graph.nodes if region.graph is not None else ():
            if node.op == "get_attr":
                device_only = bool(node.users) and all(
                    user.op == "call_function" and user.target is getattr and user.args[1:] == ("device",)
                    for user in node.users)
                name = join_fqn(region.fqn, node.target)
                reads[name] = reads.get(name, True) and device_only
    return reads


def own_parameters(site: Site) -> list[tuple[str, str]]:
    """A linear site's (name in its op module, full name in the model): weight, and bias if any."""
    return [(kind, target) for kind, target in (("weight", site.info.weight), ("bias", site.info.bias_name))
            if target is not None]


def weight_holding_problem(model: nn.Module, site: Site, names: dict[int, list[str]]) -> str | None:
    """Why a linear site's op module cannot hold its weight or bias (None: it can): the tensor is
    tied to another name, or computed on access (torch.nn.utils.parametrize)."""
    for kind, target in own_parameters(site):
        try:
            param = model.get_parameter(target)
        except AttributeError:  # a property: weight_norm, spectral_norm or another parametrization
            return (f"{kind} is computed on access (torch.nn.utils.parametrize: weight_norm, spectral_norm, "
                    "...), not a parameter; converting would drop that")
        others = [n for n in names[id(param)] if n != target]
        if others:
            return f"{kind} is tied to {', '.join(others)}; converting would untie it"
    return None


def find_sites(model: nn.Module, trace: Trace) -> list[Site]:
    """Linear and attention sites of every traced region of `model`."""
    names = parameter_names(model)
    read = read_by_traced_code(trace)
    sites = []
    for region in trace.regions:
        for site in find_linear_sites(region):
            site.unsupported = site.unsupported or weight_holding_problem(model, site, names)
            if site.unsupported is None:
                site.frozen = [kind for kind, target in own_parameters(site)
                               if not model.get_parameter(target).requires_grad]
            own = [target for _, target in own_parameters(site) if site.module_backed and target in read]
            also_read = [n for n in own if not read[n]]
            site.reads_parameter_device = bool(own) and not also_read
            if also_read and site.unsupported is None:
                site.unsupported = (f"{' and '.join(also_read)} {'are' if len(also_read) > 1 else 'is'} also "
                                    "read by other code of the model; converting would change what it reads")
            sites.append(site)
        taken: dict[str, set[str]] = {}  # attention sites are named per owner: one namespace per region
        for site in [*find_attention_sites(region, taken), *find_window_attention_sites(region, taken),
                     *find_varlen_attention_sites(region, taken)]:
            if site.module_backed:  # nn.MultiheadAttention: its projections
                params = dict(model.get_submodule(site.fqn).named_parameters())
                shared = [other for name, p in params.items() for other in names[id(p)]
                          if other != join_fqn(site.fqn, name)]
                if shared and site.unsupported is None:
                    site.unsupported = f"its parameters are tied to {', '.join(shared)}; converting would untie them"
                site.frozen = [name for name, p in params.items() if not p.requires_grad]
            sites.append(site)
    return sites
