"""From a plan to the converted model, as convert and the streamed conversion build it: each
converted site's op module (timed against the original where never-slower asks), the rewrite with
activations fused into the layers, the decisions as carried out, and the converted model's check
run on its example inputs."""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from lowconv.analysis import Analysis
from lowconv.errors import LowconvError, first_line
from lowconv.inputs import normalize_inputs, run_eval
from lowconv.ops import OPS
from lowconv.ops.registry import NotesThePlan, SharesInputStep
from lowconv.passes import hf_attention
from lowconv.passes.example_values import short_path
from lowconv.passes.fuse_activation import FUSED_NOTE, fuse_activations
from lowconv.passes.rewrite import freeze_named, rewrite, served_sites, site_params
from lowconv.passes.trace import release_graphs
from lowconv.plan import Decision, Plan
from lowconv.site import Site
from lowconv.site_timing import SiteTiming, input_groups, time_linear_site


def rewritten(analysis: Analysis, modules: dict[str, nn.Module], groups: dict[str, tuple]
              ) -> tuple[nn.Module, set[str], dict[str, str]]:
    """The analysed model with its sites' op modules in place and activations fused into them;
    the sites served through the model's attention interface, and what was fused where."""
    mark_shared_inputs(modules, groups)
    served = {site.fqn for site in served_sites(analysis.trace, analysis.sites, modules)}
    converted = rewrite(analysis.model, analysis.trace, analysis.sites, modules)
    converted, fused = fuse_activations(converted, modules)
    release_graphs(analysis.trace, converted)
    return converted, served, fused


def carried_out_all(planned: Plan, modules: dict[str, nn.Module], measured: dict[str, SiteTiming | None],
                    served: set[str], fused: dict[str, str]) -> list[Decision]:
    """The plan's decisions as convert carried them out (carried_out)."""
    return [carried_out(d, modules.get(d.fqn), measured.get(d.fqn), d.fqn in served, fused.get(d.fqn))
            if d.converted else d for d in planned.decisions]


def carried_out(decision: Decision, module: nn.Module | None, timing: SiteTiming | None, served: bool,
                fused: str | None) -> Decision:
    """A converted decision as convert carried it out: kept where never-slower measured its op
    slower (no module), else with the notes of what was measured, chosen and moved into it."""
    if module is None:
        return replace(decision, op="keep", options=OPS["keep"].options(),
                       reason=f"{decision.reason}, but kept: {timing.describe(decision.op)}; "
                              f"force = true in the rule converts it anyway")
    notes = [hf_attention.PLAN_NOTE if served else "", module.plan_note() if isinstance(module, NotesThePlan) else "",
             timing and f"measured {timing.describe(decision.op)}", fused and f"its input's {fused} {FUSED_NOTE}"]
    return replace(decision, note="; ".join(filter(None, notes)))


def build_op_modules(to_convert: list[Decision], analysis: Analysis, progress: Callable[[str], None]
                     ) -> tuple[dict[str, nn.Module], dict[str, SiteTiming | None], dict[str, tuple]]:
    """Each decision's op module by fqn; where its op is timed (never slower), its timing against
    the original; and the groups of sites that share an input (site_timing.input_groups)."""
    by_fqn = {s.fqn: s for s in analysis.sites}
    groups = decision_groups(to_convert, by_fqn)
    shared_by = Counter(groups.values())
    modules, timings, measured = {}, {}, {}
    for i, decision in enumerate(to_convert, 1):
        progress(f"[{i}/{len(to_convert)}] {decision.fqn} -> {decision.op}")
        site, op = by_fqn[decision.fqn], OPS[decision.op]
        params = site_params(site, analysis.model)
        modules[site.fqn] = op_module(decision, site, params, site_device(site, analysis.model))
        if op.timed and not decision.forced:
            sharers = shared_by[groups[site.fqn]]
            key = timing_key(decision, site, params, sharers)
            if key not in timings:
                timings[key] = time_linear_site(site, modules[site.fqn], params, sharers)
            measured[site.fqn] = timings[key]
    return modules, measured, groups


def op_module(decision: Decision, site: Site, params: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """The decision's op module for the site, built from its original tensors (`params`, as
    Op.from_site takes them), on `device` with its own buffers."""
    op = OPS[decision.op]
    return freeze_named(op.from_site(site, decision.options, params), site.frozen).to(device)


def timing_key(decision: Decision, site: Site, params: dict[str, torch.Tensor], sharers: int) -> tuple:
    """What one never-slower timing stands for: sites of the same GEMM (a layer's repeats) are timed once."""
    return (decision.op, repr(decision.options), repr(site.input), tuple(params["weight"].shape), "bias" in params,
            sharers)


def decision_groups(decisions: list[Decision], sites: dict[str, Site]) -> dict[str, tuple]:
    """fqn -> its group of sites that read one input under one op and options (input_groups)."""
    return input_groups([sites[d.fqn] for d in decisions], {d.fqn: f"{d.op} {d.options!r}" for d in decisions})


def mark_shared_inputs(modules: dict[str, nn.Module], groups: dict[str, tuple]) -> None:
    """Tell each op module with a step on its input alone (SharesInputStep) whether other converted
    layers of its group read that input too."""
    sizes = Counter(groups[fqn] for fqn in modules)
    for fqn, module in modules.items():
        if isinstance(module, SharesInputStep):
            module.input_shared = sizes[groups[fqn]] > 1


def site_device(site: Site, model: nn.Module) -> torch.device:
    """Where the site's op module must live: beside the site's own tensors, else the model's."""
    if site.kind == "linear":
        return model.get_parameter(site.info.weight).device
    owner = model.get_submodule(site.fqn) if site.module_backed else model
    return next(owner.parameters(), torch.empty(0)).device


def check_runs(converted: nn.Module, example_inputs) -> None:
    """The converted model answers its example inputs, or convert fails here and says where: the
    model's own code may read a converted layer's tensors where tracing could not see it (T5 casts
    its input to `self.wo.weight.dtype` behind an isinstance check, which a traced value fails)."""
    try:
        with torch.no_grad():
            run_eval(converted, *normalize_inputs(example_inputs))
    except Exception as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename
                  and "/lowconv/" not in f.filename]
        where = f" at {short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        raise LowconvError(f"the converted model does not run on the example inputs: {first_line(err)}{where}; "
                           f"if that code reads a converted layer's own tensors (its weight's dtype or values), "
                           f"leave that layer out of the recipe (ignore = [...])") from err
