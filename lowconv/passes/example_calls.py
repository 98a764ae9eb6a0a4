"""The example call recorded: the model run once on its example inputs, what each module of
interest got (its arguments by name) and, for a site module, what it gave. Tracing fixes the
arguments that were None or constants, and a lone site module's region keeps its example call."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from lowconv.errors import ModelRunError
from lowconv.inputs import as_called, evaluating, fresh_inputs, is_constant, normalize_inputs
from lowconv.site import TensorMeta, value_meta


# Modules that are sites by themselves: traced as calls, never into.
SITE_MODULES = (nn.Linear, nn.MultiheadAttention)



def is_site_module(module: nn.Module) -> bool:
    """An nn.Linear or nn.MultiheadAttention that computes what its class says (a subclass with
    its own forward, e.g. a LoRA layer, is traced into instead)."""
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in SITE_MODULES)



def fixed_arguments(call: Call | None) -> tuple[list[str], dict]:
    """The arguments of a module's example call that tracing fixes by default: those that are
    None, and those that are a constant (name -> value)."""
    arguments = call.arguments if call is not None and call.arguments else {}
    return ([name for name, value in arguments.items() if value is None],
            {name: value for name, value in arguments.items() if is_constant(value)})



def bind_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The forward's arguments by name, defaults filled, then the extra keyword arguments that
    went to its **kwargs (see bound_forward). None when they cannot be bound, or when extra
    positional arguments went to its *args, which have no names."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments, extra = {}, {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL and value:
            return None
        if kind == inspect.Parameter.VAR_KEYWORD:
            extra = value
        elif kind != inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = value
    return {**arguments, **extra}



@dataclass
class Call:
    arguments: dict | None  # by name, see bind_arguments
    output: TensorMeta | None  # a site module's output's shape and dtype (None for any other module)



def first_calls(model: nn.Module, example_inputs, fqns: list[str]) -> dict[str, Call]:
    """Run the model once (eval mode); what each module in `fqns` got on its first call, and the
    shape and dtype of what it gave if it is a site module (the output_meta of a lone site region:
    the output itself, an LM head's logits, can be GBs).

    The run gets fresh clones of the inputs; the model's own call is recorded with the caller's
    objects, which hold the example values whatever the model wrote into its inputs (a submodule's
    recorded arguments are what it got, as they are after the run). Whatever runs the model on them
    again clones them first (fresh_inputs), so convert holds one copy of a KV cache at a time."""
    calls: dict[str, Call] = {}
    handles = []
    wanted = set(fqns)
    for fqn, module in model.named_modules():
        if fqn not in wanted:
            continue

        def record_arguments(mod, args, kwargs, fqn=fqn):
            if fqn not in calls:
                calls[fqn] = Call(bind_arguments(mod, *as_called(args, kwargs)), None)

        def record_output(mod, args, kwargs, output, fqn=fqn):
            if is_site_module(mod) and calls[fqn].output is None:
                calls[fqn].output = value_meta(output)

        if fqn:
            handles.append(module.register_forward_pre_hook(record_arguments, with_kwargs=True))
        handles.append(module.register_forward_hook(record_output, with_kwargs=True))
    args, kwargs = normalize_inputs(example_inputs)
    if "" in wanted:
        calls[""] = Call(bind_arguments(model, args, kwargs), None)
    run_args, run_kwargs = fresh_inputs(args, kwargs)
    try:
        with evaluating(model):
            model(*run_args, **run_kwargs)
    except Exception as err:
        raise ModelRunError(f"the model failed on its example inputs: {type(err).__name__}: {err}") from err
    finally:
        for h in handles:
            h.remove()
    return calls
