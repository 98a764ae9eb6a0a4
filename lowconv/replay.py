"""Replaying a saved plan: the plan read from a checkpoint and checked, the model traced again and
each converted site found as it was converted, the model's floating tensors cast as the checkpoint's
(what `load` and `compare` build on)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from lowconv import checkpoint
from lowconv.errors import LowconvError
from lowconv.kernels.fp8 import E4M3, E5M2
from lowconv.passes.sites import find_sites
from lowconv.passes.trace import Trace, trace_model
from lowconv.plan import Plan, PlanError
from lowconv.site import LinearInfo, Site, SiteRecord


def read_plan(directory: str | Path) -> tuple[Plan, dict[str, torch.Tensor]]:
    tensors, metadata = checkpoint.read_checkpoint(directory)
    path = checkpoint.checkpoint_path(directory)
    try:
        plan = Plan.from_json(metadata["lowconv.plan"])
    except RecursionError:
        raise LowconvError(f"{path}: the plan in its metadata is not valid (nested too deep to read)") from None
    except PlanError as err:
        raise LowconvError(f"{path}: {err}") from None
    except (ValueError, TypeError, KeyError) as err:
        raise LowconvError(f"{path}: the plan in its metadata is not valid ({type(err).__name__}: {err})") from None
    return plan, tensors



def cast_like(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """A model saved after a module-wide cast (.half(), .to(torch.bfloat16)) holds its floating
    tensors in another dtype than the original it is rebuilt from: cast the rebuilt model the same
    way. Only where each side has one floating dtype (FP8 weights aside, which casts keep)."""
    saved, built = floating_dtypes(tensors.values()), floating_dtypes(model.state_dict().values())
    if len(saved) == 1 and len(built) == 1 and saved != built:
        model.to(saved.pop())



def floating_dtypes(tensors) -> set[torch.dtype]:
    """The floating dtypes among the tensors, FP8 aside."""
    return {t.dtype for t in tensors if t.is_floating_point() and t.dtype not in (E4M3, E5M2)}



def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating tensors as empty meta tensors of `dtype` (for model_signature)."""
    return {name: torch.empty(t.shape, dtype=dtype, device="meta")
            if isinstance(t, torch.Tensor) and t.is_floating_point() else t for name, t in state.items()}



def decided_by_inputs(plan: Plan) -> bool:
    """Whether a region the plan converts in had branches that its example inputs decided (tracing
    it again takes inputs that decide them)."""
    return any(plan.decided.get(d.site.region) for d in plan.converted())



def refind_sites(model: nn.Module, plan: Plan, example_inputs, source: str) -> tuple[Trace, dict[str, Site]]:
    """Trace `model` (a copy of the original) again and find the sites the plan converts, each
    checked to be the same graph as at conversion and given what the conversion learned."""
    to_replay = plan.converted()
    trace = trace_model(model, example_inputs, only=sorted({d.site.region for d in to_replay}),
                        none_args=plan.none_args, constant_args=plan.constant_args)
    traced_sites = {s.fqn: s for s in find_sites(model, trace)}
    sites = {}
    for decision in to_replay:
        site = traced_sites.get(decision.fqn)
        if site is None:
            raise LowconvError(f"{source}: the plan converts {decision.fqn}, which this model does not have")
        if site.graph_signature() != decision.site.graph:
            hint = "" if example_inputs is not None else (
                " (traced again without inputs, its graph differs: pass the inputs it was converted with, "
                "lowconv.load(model, directory, example_inputs=...))")
            raise LowconvError(f"{source}: {decision.fqn} is not the site that was converted{hint}")
        found_names = linear_names(site.info)
        restore_site(site, decision.site)
        if linear_names(site.info) != found_names:
            raise LowconvError(f"{source}: {decision.fqn} is not the site that was converted (the plan names "
                               f"{linear_names(site.info)}, the model {found_names})")
        sites[site.fqn] = site
    return trace, sites



def linear_names(info) -> tuple | None:
    """A linear site's shape and the names of its tensors in the model (None for attention)."""
    if not isinstance(info, LinearInfo):
        return None
    return info.form, info.in_features, info.out_features, info.weight, info.bias_name, info.weight_layout



def restore_site(site: Site, saved: SiteRecord) -> None:
    """What the conversion run learned (shapes from the example inputs) onto a re-found site."""
    site.info, site.input, site.output = replace(saved.info), saved.input, saved.output  # the record stays as saved
