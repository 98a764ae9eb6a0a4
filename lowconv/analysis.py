"""Analysis: a copy of the user's model traced, its sites found and the recipe's plan made, before
anything is rewritten (what `lowconv inspect` shows and `convert` carries out)."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowconv import checkpoint, hf
from lowconv.errors import LowconvError
from lowconv.inputs import describe as describe_inputs
from lowconv.kernels.fp8 import E4M3, E5M2
from lowconv.passes.mha_expand import expand_mha, mha_to_expand
from lowconv.passes.sites import find_sites
from lowconv.passes.trace import Trace, trace_model
from lowconv.plan import PLAN_ATTR, Decision, Plan
from lowconv.recipe import Recipe, decide_sites, load_recipe, make_plan, plan_warnings, would_convert
from lowconv.site import Site


@dataclass
class Analysis:
    """What the passes found in a copy of the model, before anything is rewritten."""

    model: nn.Module  # the copy that was traced
    trace: Trace
    sites: list[Site]
    expanded_mha: list[str]  # its nn.MultiheadAttention modules expanded before tracing



def copy_of(model: nn.Module, share_buffers: bool = False) -> nn.Module:
    """The copy lowconv works on, leaving the user's model as it is: its modules and buffers copied,
    its parameters its own (no memory: tracing, a comparison and a conversion read them and write
    none; a forward may write its buffers, a counter or a cache). A converted model gets copies of
    the parameters it keeps from own_tensors. share_buffers: the buffers the model's own too, for a
    model lowconv built itself (a streamed conversion's, which finds its tensors by identity)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers() if share_buffers else ())}
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # e.g. torch.nn.utils.weight_norm's and prune's hooks hold non-leaf tensors
        raise LowconvError(f"the model cannot be copied (lowconv works on a copy and leaves yours as it is): "
                           f"{type(err).__name__}: {err}") from err


def own_tensors(converted: nn.Module, model: nn.Module) -> None:
    """Give `converted` copies of the tensors it shares with `model` (the layers a conversion kept,
    taken over from copy_of): its parameters, buffers and tensor attributes (in dicts, lists and
    tuples too) whose storage is one of model's, each copied once (tied weights stay tied). Made
    after the replaced layers are gone, so a conversion never holds the model twice. A tensor a
    module holds inside another object (a dataclass, a namespace) is not looked for."""
    theirs = set().union(*map(storages_of, itertools.chain(model.parameters(), model.buffers())))
    memo: dict = {}  # copy.deepcopy's: each shared tensor's copy, by id

    def owned(value):
        """value, or where shared tensors are in it a new one with them copied (a dict, list or tuple,
        their subclasses too, remade, not changed: it may be one the model holds too)."""
        if isinstance(value, torch.Tensor):
            return copy.deepcopy(value, memo) if storages_of(value) & theirs else value
        if isinstance(value, (dict, list)):
            keys = list(value) if isinstance(value, dict) else range(len(value))
            changed = {key: owned(value[key]) for key in keys}
            if all(changed[key] is value[key] for key in keys):
                return value
            remade = copy.copy(value)  # its type and the rest of its state (a defaultdict's factory)
            for key, item in changed.items():
                remade[key] = item
            return remade
        if isinstance(value, tuple):
            items = [owned(item) for item in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)  # a namedtuple's
        return value

    for module in converted.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                tensors[name] = owned(t)
        for name, value in list(vars(module).items()):
            if name not in ("_parameters", "_buffers", "_modules"):
                changed = owned(value)
                if changed is not value:
                    setattr(module, name, changed)


def storages_of(t: torch.Tensor) -> set[tuple[torch.device, int]]:
    """The (device, data pointer) of each storage t's values live in: a wrapper subclass's (as a
    training fp8 layer's master weight) are its inner tensors'. An empty storage has none (its
    pointer may be any other's)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return set().union(*(storages_of(getattr(t, name)) for name in names))
    storage = t.untyped_storage()
    return {(t.device, storage.data_ptr())} if storage.nbytes() else set()


def analyze(model: nn.Module, example_inputs, recipe: Recipe | None = None, share_buffers: bool = False) -> Analysis:
    """Trace a copy of `model` (copy_of) and find its sites (the user's model is never touched).
    With a recipe, the nn.MultiheadAttention modules whose projections it converts are expanded first."""
    work = copy_of(model, share_buffers)
    expanded = mha_to_expand(work, lambda site: would_convert(site, recipe.rules)) if recipe else []
    work = expand_mha(work, expanded)
    trace = trace_model(work, example_inputs)
    return Analysis(work, trace, find_sites(work, trace), expanded)


PLAIN_OPS = ("keep", "dense")  # a model lowconv made whose sites are all these holds no op module: it converts again


def plan_conversion(model: nn.Module, recipe, example_inputs, share_buffers: bool = False) -> tuple[Analysis, Plan]:
    if not isinstance(model, nn.Module):
        raise LowconvError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise LowconvError("example_inputs is None: give a tuple of forward arguments (() for none), a dict "
                           "of keyword arguments, or one tensor")
    made_by = getattr(model, PLAN_ATTR, None)  # the plan of an earlier conversion
    held = [d for d in made_by.decisions if d.op not in PLAIN_OPS] if made_by is not None else []
    if held:
        raise LowconvError(f"the model was made by lowconv and {len(held)} of its sites are lowconv's op modules "
                           f"({', '.join(sorted({d.op for d in held}))}; e.g. {held[0].fqn}), whose checkpoint would "
                           f"not load as it is; convert the original model (a recipe with every rule), or, where "
                           f"only linears were converted, lowconv.revert(model) first (every op), for plain layers "
                           f"with the weights it holds (a trained model's), and convert that")
    recipe = load_recipe(recipe)
    quantized = quantized_model_problem(model)
    if quantized:
        raise LowconvError(f"the model is quantized already: {quantized}; convert the model it was made from")
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise LowconvError(f"the model has {len(on_meta)} tensors on the meta device (no values), e.g. "
                           f"{', '.join(on_meta[:3])}: load its weights first (e.g. load_state_dict(..., assign=True) "
                           f"or to_empty() then load)")
    analysis = analyze(model, example_inputs, recipe, share_buffers)
    return analysis, plan_for(model, analysis, recipe, decide_sites(analysis.sites, recipe), example_inputs)


def plan_for(model: nn.Module, analysis: Analysis, recipe: Recipe, decisions: list[Decision], example_inputs,
             recorded: dict | None = None) -> Plan:
    """The plan of `decisions` (the recipe's, or those convert carried out) for `model`: its
    warnings, how the original was made, the example inputs described, and what the caller records
    of the model (`recorded`: the command line's model path, seed and dtype). Where calibration
    ran, with_calibration says so."""
    made = {"signature": checkpoint.model_signature(model.state_dict()), **hf.origin(model), **(recorded or {})}
    return make_plan(decisions, analysis.trace, recipe, warnings=conversion_warnings(model, analysis, decisions, recipe),
                     model=made, expanded_mha=analysis.expanded_mha, example_inputs=describe_inputs(example_inputs))



def with_calibration(plan: Plan, calibration: str | None) -> Plan:
    """The plan, complete: saying what calibrated its scales, on what (None: nothing calibrated)."""
    return replace(plan, model={**plan.model, "calibration": calibration}) if calibration else plan


def quantized_model_problem(model: nn.Module) -> str | None:
    """Why a model is a quantized one already (None: it is not): a quantization_config, FP8 weights,
    or tensor subclasses (torchao's quantized weights). A model lowconv made is refused before this."""
    described = hf.quantized_config_problem(model)
    if described:
        return described
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            return f"{name} is a {type(tensor).__name__} (a tensor subclass, as torchao's quantized weights are)"
        if tensor.dtype in (E4M3, E5M2):
            return f"{name} is {tensor.dtype}"
    return None



def conversion_warnings(model: nn.Module, analysis: Analysis, decisions: list[Decision], recipe: Recipe) -> list[str]:
    """The plan's warnings for these decisions (once never-slower has kept sites, a region none of
    whose sites is converted any more is not rewritten)."""
    return plan_warnings(decisions, analysis.sites, analysis.trace, recipe) + nested_tensor_warnings(model, decisions)


def untrained_weights_warnings(model: nn.Module, decisions: list[Decision]) -> list[str]:
    """What a model converted in train mode no longer trains: the converted linears whose op holds
    the weight for inference (options with training false: e4m3, 2:4 compressed buffers), which
    training leaves as they are. Ops without a training option (dense, fp16acc) keep a parameter.
    Said to Python's callers only: the plan, and so the checkpoint, is the same in either mode."""
    if not model.training:
        return []
    held = [d.fqn for d in decisions if d.converted and d.site.kind == "linear" and "weight" not in d.site.frozen
            and getattr(d.options, "training", True) is False]
    if not held:
        return []
    some = f"{converted_linears(held)} {'hold their weights' if len(held) > 1 else 'holds its weight'}"
    return [f"the model was converted in train mode, but {some} for inference, as buffers: training the converted "
            f"model leaves them as they are (an op's training = true keeps them trainable; eval() before converting "
            f"for inference)"]


def static_training_warnings(decisions: list[Decision]) -> list[str]:
    """FP8 layers that train with static scales: x's scale stays as calibrated while training
    changes x, so what grows past it clips (a trial: 48% of a head's inputs after 50 steps)."""
    static = [d.fqn for d in decisions if d.converted and getattr(d.options, "training", False)
              and getattr(d.options, "scaling", None) == "static"]
    if not static:
        return []
    some = f"{converted_linears(static)} {'train' if len(static) > 1 else 'trains'}"
    return [f"{some} with static FP8 scales: x's scale stays as calibrated while training changes x, and what grows "
            f"past it clips (each layer's report_stats() counts it); scaling = \"delayed\" follows x, \"dynamic\" "
            f"takes each x's own"]


def converted_linears(fqns: list[str]) -> str:
    """A warning's subject: "3 converted linears (a, b, c)", "1 converted linear (a)"."""
    listed = ", ".join(fqns[:3]) + (", ..." if len(fqns) > 3 else "")
    return f"{len(fqns)} converted linear{'s' if len(fqns) > 1 else ''} ({listed})"


def lost_methods_warnings(model: nn.Module, converted: nn.Module) -> list[str]:
    """What a model whose whole forward was rewritten (the converted model is a GraphModule of it,
    as a GPT-2 whose Conv1D layers convert) no longer has: the public methods of its class beyond
    nn.Module's, transformers' generate() and save_pretrained() first. Said to Python's callers."""
    if not isinstance(converted, torch.fx.GraphModule) or isinstance(model, torch.fx.GraphModule):
        return []
    cls = type(model)
    lost = sorted((name for name in dir(cls) if not name.startswith("_") and not hasattr(nn.Module, name)
                   and callable(getattr(cls, name, None)) and not hasattr(converted, name)),
                  key=lambda name: (name not in ("generate", "save_pretrained"), name))
    if not lost:
        return []
    named = ", ".join(f"{name}()" for name in lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
    return [f"the converted model is a torch.fx GraphModule of the whole {cls.__name__} (its forward's code was "
            f"rewritten), which has only forward() of its methods: {named} {'is' if len(lost) == 1 else 'are'} not "
            f"on it; save it with lowconv.save"]


def nested_tensor_warnings(model: nn.Module, decisions: list[Decision]) -> list[str]:
    """An nn.TransformerEncoder with its nested-tensor path on, around converted sites, loses that
    path (passes/rewrite.py leave_fused_paths): say what changes, which compare cannot show (it
    runs both models on the plain path)."""
    converted = [d.fqn for d in decisions if d.converted]
    return [f"{fqn or '(whole model)'}: nn.TransformerEncoder built with enable_nested_tensor; the converted "
            f"model runs it on the plain path, so in eval mode without grad the rows of padding hold "
            f"computed values where the original gives zeros (mask them before pooling)"
            for fqn, module in model.named_modules()
            if isinstance(module, nn.TransformerEncoder) and module.use_nested_tensor
            and any(site == fqn or site.startswith(f"{fqn}.") or not fqn for site in converted)]
