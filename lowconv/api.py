"""The public API: convert, revert, save, load (compare is in compare.py). Each is the data flow of
DESIGN.md, spelled out: analysis.py plans, build.py builds the converted model, the passes rewrite,
replay.py finds a saved plan's sites again."""
from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import fx, nn

from lowconv import checkpoint, distributed, hf
from lowconv.analysis import (
    copy_of, lost_methods_warnings, own_tensors, plan_conversion, plan_for, static_training_warnings,
    untrained_weights_warnings, with_calibration,
)
from lowconv.build import (
    build_op_modules, carried_out_all, check_runs, decision_groups, mark_shared_inputs, rewritten, site_device,
)
from lowconv.calibration import calibrate, calibrated_on
from lowconv.errors import LowconvError, LowconvWarning
from lowconv.inputs import stand_ins
from lowconv.ops import OPS
from lowconv.ops.dense import linear_holding
from lowconv.ops.registry import ChecksLoadedState
from lowconv.passes.mha_expand import expand_mha
from lowconv.passes.rewrite import freeze_named, rewrite, swap_module
from lowconv.passes.fuse_activation import FUSED_NOTE, fuse_activations, restore_activation
from lowconv.passes.trace import release_graphs
from lowconv.plan import PLAN_ATTR, Plan
from lowconv.recipe import Recipe, load_recipe
from lowconv.replay import cast_floating, cast_like, decided_by_inputs, floating_dtypes, read_plan, refind_sites
from lowconv.site import FLOAT_DTYPES
from lowconv.site_timing import slower_sites
from lowconv.version import __version__


def no_progress(message: str) -> None:
    pass


def convert(model: nn.Module, recipe: str | Path | Recipe, example_inputs, *,
            calibration: Iterable | None = None, calibration_name: str = "the calibration inputs given",
            share_weights: bool = False, recorded: dict | None = None,
            progress: Callable[[str], None] = no_progress) -> nn.Module:
    """A converted copy of `model`, as the recipe (a path, a built-in name or a Recipe) says.

    example_inputs: a tuple of forward args, a dict of kwargs (or any mapping: a tokenizer's
    output) or one tensor; it drives shape propagation and calibration (static/delayed FP8
    scales) unless `calibration` (an iterable of such inputs, which the report calls
    `calibration_name`) is given.
    The conversion reads `model`'s parameters where they are (its modules and buffers are copied)
    and gives the converted model copies of those it keeps only once the layers it replaced are
    gone: the model is never in memory twice. share_weights: no such copies, the kept layers hold
    `model`'s own parameters; for when neither model is trained or changed afterwards (the command
    line's convert does this).
    recorded: what the plan records of the model beside what it finds (the command line's model
    path, seed and dtype, for `lowconv compare`).
    """
    progress("tracing and finding sites")
    recipe = load_recipe(recipe)
    analysis, planned = plan_conversion(model, recipe, example_inputs)
    to_convert = planned.converted()
    progress(f"{len(analysis.sites)} sites, {len(to_convert)} to convert")
    modules, measured, groups = build_op_modules(to_convert, analysis, progress)
    slower = slower_sites(measured, groups)
    for fqn in slower:
        del modules[fqn]
    converted, served, fused = rewritten(analysis, modules, groups)
    decisions = carried_out_all(planned, modules, measured, served, fused)
    plan = plan_for(model, analysis, recipe, decisions, example_inputs, recorded)
    # The analysed copy holds the layers the converted model replaced: let them go before it runs
    del analysis
    if not share_weights:
        own_tensors(converted, model)
    seen = calibrate(converted, calibration if calibration is not None else [example_inputs], progress)
    if not seen:  # calibration ran the converted model already
        check_runs(converted, example_inputs)
    calibrated = calibrated_on(seen, calibration_name if calibration is not None else None) if seen else None
    attach_plan(converted, with_calibration(plan, calibrated))
    for warning in [*plan.warnings, *untrained_weights_warnings(model, plan.converted()),
                    *static_training_warnings(plan.converted()), *lost_methods_warnings(model, converted)]:
        warnings.warn(warning, LowconvWarning, stacklevel=2)
    return converted


def attach_plan(converted: nn.Module, plan: Plan) -> None:
    """Keep the plan on the converted model, also through copy.deepcopy: a GraphModule's deepcopy
    keeps only the attributes its meta lists (torch.fx.graph_module._USER_PRESERVED_ATTRIBUTES_KEY).
    A transformers model's save_pretrained, which would write the converted weights under the
    original's config, refuses and points to lowconv.save."""
    setattr(converted, PLAN_ATTR, plan)
    if hasattr(converted, "save_pretrained"):
        converted.save_pretrained = hf.refuse_save_pretrained
    if isinstance(converted, fx.GraphModule):
        converted.meta.setdefault("_user_preserved_attributes", {})[PLAN_ATTR] = plan


def plan_of(converted: nn.Module) -> Plan:
    plan = getattr(converted, PLAN_ATTR, None)
    if plan is None:
        raise LowconvError("this model was not made by lowconv.convert or lowconv.load (it has no plan)")
    return plan


def revert(converted: nn.Module, ops: str | Iterable[str] | None = None) -> nn.Module:
    """A copy of a converted model whose converted linears (those of the ops named in `ops`, one
    name or several; default every linear op) are plain nn.Linear layers with the weights they
    compute with: a 2:4 layer's pruned weight (its dense weight under a runtime mask), an fp8
    layer's dequantized weight (its master weight in training). The plan says `dense` for them, so save and load keep
    them that way. For "train sparse, finish dense": convert, fine-tune, revert, fine-tune.
    """
    plan = plan_of(converted)
    linear_ops = sorted(name for name, op in OPS.items() if op.kind == "linear" and name != "dense")
    wanted = set(linear_ops if ops is None else [ops] if isinstance(ops, str) else ops)
    if wanted - set(linear_ops):
        raise LowconvError(f"revert: {sorted(wanted - set(linear_ops))} are not linear ops that revert undoes "
                           f"(valid choices: {', '.join(linear_ops)})")
    reverted = copy.deepcopy(converted)
    decisions = []
    for decision in plan.decisions:
        if decision.op in wanted:
            module = reverted.get_submodule(decision.fqn)
            linear = linear_holding(module.linear_weight().detach(), module.bias)
            restore_activation(reverted, decision.fqn)  # an nn.Linear takes no activation
            swap_module(reverted, decision.fqn, freeze_named(linear, decision.site.frozen))
            decision = replace(decision, op="dense", options=OPS["dense"].options(), rule=None,
                               reason=f"reverted from {decision.op} by lowconv.revert (converted because: "
                                      f"{decision.reason})",
                               note="; ".join(n for n in decision.note.split("; ") if FUSED_NOTE not in n))
        decisions.append(decision)
    attach_plan(reverted, replace(plan, decisions=decisions))
    return reverted


def save(converted: nn.Module, directory: str | Path, text_files: dict[str, str] | None = None,
         max_shard_bytes: int = checkpoint.MAX_SHARD_BYTES) -> Path:
    """Write directory/model.safetensors (shards and their index above max_shard_bytes): the
    converted state dict, recipe and plan; for a transformers model the Hugging Face folder around
    it (hf.py: config.json, tokenizer files); and any `text_files` ({file name: text}, the CLI's
    plan and reports) beside it, all or none.

    A model sharded by FSDP2 (torch.distributed.fsdp.fully_shard): call save on every rank; the
    whole tensors are gathered (torch.distributed.checkpoint's full state dict) and rank 0 writes
    the same checkpoint an unsharded model would, which lowconv.load reads."""
    plan = plan_of(converted)
    state = converted.state_dict()

    def write(state: dict[str, torch.Tensor]) -> Path:
        return checkpoint.save_checkpoint(directory, state, checkpoint_metadata(plan),
                                          saved_files(plan, state, text_files), max_shard_bytes)
    if distributed.is_sharded(state):
        whole = distributed.full_state_dict(converted)
        return distributed.on_rank0(lambda: write(whole))
    return write(state)


def checkpoint_metadata(plan: Plan) -> dict[str, str]:
    """What a converted checkpoint's metadata says of it: lowconv's version, the plan, the
    original model's signature."""
    return {"lowconv.version": __version__, "lowconv.plan": plan.to_json(),
            "lowconv.model": plan.model.get("signature", "")}


def saved_files(plan: Plan, state: dict[str, torch.Tensor], text_files: dict[str, str] | None) -> dict[str, str | bytes]:
    """The files save writes beside the weights of `state` (meta tensors do): the Hugging Face
    folder's, in the one floating dtype of the weights where they have one, and `text_files`."""
    floating = floating_dtypes(state.values())
    dtype = str(floating.pop()).removeprefix("torch.") if len(floating) == 1 else None
    return {**hf.folder_files(plan, dtype), **(text_files or {})}


def load(model: nn.Module, directory: str | Path, example_inputs=None) -> nn.Module:
    """Rebuild the converted model from `model` (the original) and a saved checkpoint.

    The plan's structure is replayed without redoing the conversion work: each op module is
    built empty and filled from the checkpoint, strictly. Regions whose branches the conversion's
    example inputs decided are traced again with `example_inputs`, or without them with stand-ins
    of the shapes and dtypes the plan kept (lowconv/inputs.py); where it kept none (an input that
    is neither a tensor nor a constant), load says to pass them.
    """
    if hasattr(model, PLAN_ATTR):
        raise LowconvError("load rebuilds a converted model from the original one: this model was made by lowconv (it "
                           "holds a plan); pass the model as it was before convert")
    plan, tensors = read_plan(directory)
    path = checkpoint.checkpoint_path(directory)
    state = model.state_dict()
    if plan.model.get("signature") not in (None, checkpoint.model_signature(state)):
        made_in = [name for name, dtype in FLOAT_DTYPES.items()
                   if checkpoint.model_signature(cast_floating(state, dtype)) == plan.model["signature"]]
        if made_in:
            raise LowconvError(f"{path} was converted from this model in {made_in[0]}: load it with the model "
                               "in that dtype (a cast made after the conversion is applied from the checkpoint)")
        raise LowconvError(
            f"{path} was converted from a different model (its parameter names, shapes or "
            f"dtypes differ from this one's): load it with the model it was made from")
    work = expand_mha(copy_of(model), plan.expanded_mha)
    made_up = example_inputs is None and plan.example_inputs is not None and decided_by_inputs(plan)
    if made_up:
        example_inputs = stand_ins(plan.example_inputs, next(work.parameters(), torch.empty(0)).device, str(path))
    try:
        trace, sites = refind_sites(work, plan, example_inputs, str(path))
    except LowconvError as error:
        if not made_up:
            raise
        raise LowconvError(f"{error} (load ran the model on stand-ins of the inputs it was converted with, random "
                           f"values of the shapes the plan kept; inputs whose values matter, as a point cloud's or "
                           f"packed sequences' do, need lowconv.load(model, directory, example_inputs=...))") from error
    modules = {}
    for decision in plan.converted():
        op = OPS[decision.op]
        site = sites[decision.fqn]
        modules[site.fqn] = freeze_named(op.empty(site, decision.options), site.frozen).to(site_device(site, work))
    mark_shared_inputs(modules, decision_groups(plan.converted(), sites))
    converted, _ = fuse_activations(rewrite(work, trace, list(sites.values()), modules), modules)
    release_graphs(trace, converted)
    own_tensors(converted, model)  # before the checkpoint's values are loaded into the kept layers
    cast_like(converted, tensors)
    checkpoint.check_tensors(converted.state_dict(), tensors, path)
    try:
        converted.load_state_dict(tensors, strict=True)
    except LowconvError as error:  # a layer that refuses what the checkpoint holds names its key
        raise LowconvError(f"{path}: {error}") from None
    for fqn, module in modules.items():
        problem = module.loaded_state_problem() if isinstance(module, ChecksLoadedState) else None
        if problem:
            raise LowconvError(f"{path}: {fqn}: {problem}")
    attach_plan(converted, plan)
    for warning in lost_methods_warnings(model, converted):
        warnings.warn(warning, LowconvWarning, stacklevel=2)
    return converted


