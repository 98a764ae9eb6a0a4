"""All sites of a traced model, region by region, each checked for what forbids converting it."""
from __future__ import annotations

from torch import nn

from lowconv.passes.attention import find_attention_sites
from lowconv.passes.linear import find_linear_sites
from lowconv.passes.trace import Trace
from lowconv.passes.window_attention import find_window_attention_sites
from lowconv.site import Site


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name the model holds it under (more than one: tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def find_sites(model: nn.Module, trace: Trace) -> list[Site]:
    """Linear and attention sites of every traced region of `model`."""
    names = parameter_names(model)
    sites = []
    for region in trace.regions:
        for site in find_linear_sites(region):
            others = [n for n in names[id(model.get_parameter(site.info.weight))] if n != site.info.weight]
            if others and site.unsupported is None:
                site.unsupported = f"weight is tied to {', '.join(others)}; converting would untie it"
            sites.append(site)
        taken: dict[str, set[str]] = {}  # attention sites are named per owner: one namespace per region
        sites.extend(find_attention_sites(region, taken))
        sites.extend(find_window_attention_sites(region, taken))
    return sites
