"""The model a streamed conversion converts, built without its weights: its parameters zero
stand-ins (a zero expanded to the shape: no memory), its buffers real, its example inputs, and
where each tensor is stored in its checkpoint.

Two sources: an hf:DIR model, built from config.json as from_pretrained builds it (its dtype, the
names transformers renames as it loads), and a model file whose build_model() can build with its
parameters on the meta device and whose weights_path() names its safetensors weights (strict: the
model's state dict, as lowconv loads them in memory, model_file.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lowconv.errors import LowconvError
from lowconv.input_checkpoint import (InputCheckpoint, check_shapes, checkpoint_names, input_checkpoint, named_tensors,
                                      put_tensors, strict_names)
from lowconv.model_file import (BUILT_FROM, ModelFile, build_file_model, calibration_batches, check_no_meta,
                                checked_cast, example_inputs, file_weights, import_file, logits_flag, to_device)
from lowconv.model_sources import hf_inputs, library

HF_BUILT_FROM = "config.json's model"  # for messages


@dataclass
class StreamModel:
    """A model to stream, and where its tensors are."""
    loaded: ModelFile  # the model with stand-ins, on the device; its inputs, logits, calibration
    built: dict[int, torch.dtype]  # each parameter's dtype as built (before a --dtype cast), by id of its stand-in
    source: InputCheckpoint
    stored_as: dict[str, str]  # parameter or buffer name -> the name its checkpoint holds it under
    built_from: str  # what built it, for messages: "config.json's model"


def stream_model(spec: str, seed: int, dtype: str | None, device: torch.device) -> StreamModel:
    """The model `spec` names (an hf:DIR or a model file's path) on stand-ins, on `device`."""
    prefix, colon, name = spec.partition(":")
    if prefix == "hf" and colon:
        return hf_stream_model(Path(name), spec, seed, dtype, device)
    if Path(spec).exists() or spec.endswith(".py") or not colon:
        return file_stream_model(Path(spec), seed, dtype, device)
    raise LowconvError(f"--stream converts hf:DIR models and model files (build_model() with weights_path()); "
                       f"{spec} is neither")


@contextmanager
def parameters_on_meta():
    """Modules built inside register their parameters on the meta device and keep their buffers
    real (accelerate's init_empty_weights(include_buffers=False)): the model costs no memory, and
    buffers computed at build time (rotary frequencies) keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:  # one on meta already stays itself: a tied weight
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def hf_stream_model(directory: Path, spec: str, seed: int, dtype: str | None, device: torch.device) -> StreamModel:
    """DIR's model as from_pretrained builds it (module doc), its example inputs as
    model_sources.hf_model makes them."""
    if not (directory / "config.json").is_file():
        raise LowconvError(f"model {spec!r}: {directory / 'config.json'} does not exist")
    source = input_checkpoint(directory, spec)
    transformers = library("transformers", spec, "pip install transformers")
    cast = checked_cast(dtype, seed)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise LowconvError(f"model {spec!r}: transformers cannot read {directory / 'config.json'}: {err}") from None
    named = [getattr(transformers, name) for name in config.architectures or [] if hasattr(transformers, name)]
    if getattr(config, "dtype", None) is None:  # from_pretrained's dtype="auto" records what it chose
        config.dtype = source.load_dtype()
    built = config.dtype
    built = getattr(torch, built) if isinstance(built, str) else built
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(built)
    try:
        with parameters_on_meta():
            model = named[0](config) if named else transformers.AutoModel.from_config(config)
    finally:
        torch.set_default_dtype(default)
    stored_as = checkpoint_names(model, loaded_as(model, source, spec))
    check_shapes(model, {name for name, _ in model.named_buffers(remove_duplicate=False)}, stored_as, source, spec,
                 HF_BUILT_FROM)  # (parameters' shapes are checked before anything is written)
    put_tensors(model, source, stored_as, parameters=False)
    dtypes = with_stand_ins(model, cast, device)
    inputs = to_device(hf_inputs(model, config, spec), device, cast)
    return StreamModel(ModelFile(spec, model, inputs, None), dtypes, source, stored_as, HF_BUILT_FROM)


def file_stream_model(path: Path, seed: int, dtype: str | None, device: torch.device) -> StreamModel:
    """The model file's model, built by build_model() with its parameters on the meta device, its
    weights in weights_path()'s safetensors (strict_names), its example and calibration inputs."""
    cast = checked_cast(dtype, seed)
    module = import_file(path)
    if not callable(getattr(module, "weights_path", None)):
        raise LowconvError(f"--stream reads a model file's weights from the safetensors weights_path() names, and "
                           f"{path} defines no weights_path() (README: The model file); convert without --stream")
    source = input_checkpoint(file_weights(module, path), str(path))
    torch.manual_seed(seed)
    with parameters_on_meta():
        model = build_file_model(module, path)
    stored_as = strict_names(model, source, str(path), BUILT_FROM)
    put_tensors(model, source, stored_as, parameters=False)
    check_no_meta([name for name, b in model.named_buffers(remove_duplicate=False) if b.is_meta], module, path)
    dtypes = with_stand_ins(model, cast, device)
    draw = None
    if hasattr(module, "calibration_inputs"):
        def draw(count: int) -> Iterator:
            return calibration_batches(module, path, count, device, cast, seed)
    loaded = ModelFile(str(path), model, to_device(example_inputs(module, path, seed), device, cast),
                       logits_flag(module, path), draw)
    return StreamModel(loaded, dtypes, source, stored_as, BUILT_FROM)


def with_stand_ins(model: nn.Module, cast: torch.dtype | None, device: torch.device) -> dict[int, torch.dtype]:
    """Give `model` zero stand-ins for its parameters, in `cast` where floating (tied ones stay
    tied), and its buffers on `device`; in eval mode. Each parameter's dtype as built, by id of its
    stand-in."""
    stand_ins, built = {}, {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in stand_ins:
                final = cast if cast and param.dtype.is_floating_point else param.dtype
                stand_ins[id(param)] = nn.Parameter(torch.zeros((), dtype=final, device=device).expand(param.shape),
                                                    param.requires_grad)
                built[id(stand_ins[id(param)])] = param.dtype
            module._parameters[name] = stand_ins[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device, cast if cast and buffer.is_floating_point() else buffer.dtype)
    model.eval()
    return built


class StandInLinears(TorchFunctionMode):
    """F.linear with a stand-in weight (zeros) gives its bias broadcast, computed without the
    weight: planning runs every linear of the model three times (trace, shape propagation, plan),
    and a stand-in, a zero expanded, would be copied whole for each product (half of a 48-layer
    13B model's planning time)."""

    def __init__(self, stand_ins: set[int]):
        super().__init__()
        self.stand_ins = stand_ins  # their ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = (*args, *[None] * 3)[:3]
            weight, bias = kwargs.get("weight", weight), kwargs.get("bias", bias)
            if id(weight) in self.stand_ins and isinstance(x, torch.Tensor):
                out = x.new_zeros(*x.shape[:-1], weight.shape[0])
                return out if bias is None else out + bias
        return func(*args, **kwargs)


def loaded_as(model: nn.Module, source: InputCheckpoint, spec: str) -> dict[str, str]:
    """{the name from_pretrained loads a checkpoint tensor as: its name in the checkpoint}, after
    the renamings this transformers applies to the model's checkpoints (its conversion mapping:
    GPT-NeoX's embed_out is lm_head; a base model's prefix added or stripped). A tensor that
    transformers converts as it loads (experts merged, a weight split) is refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings loads checkpoints under their own names
        return {key: key for key in source.files}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys((name for name, _ in named_tensors(model)), True)
    found = {}
    for key in source.files:
        name, converted = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None), names)
        if converted is not None:
            raise LowconvError(f"model {spec!r}: transformers converts {key} of {source.files[key]} as it loads it "
                               f"(a {type(model).__name__} checkpoint's {converted}), which --stream does not: "
                               f"convert without --stream")
        found[name] = key
    return found
