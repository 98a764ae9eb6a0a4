"""Load a user's model file: a Python file defining `build_model()` and `example_inputs()`.

    def build_model() -> torch.nn.Module     # the model to convert, weights loaded (or see weights_path())
    def example_inputs()                      # a tuple of forward args, a dict of kwargs, or one tensor
    def calibration_inputs()                  # optional: an iterable of such batches, for static scales
    def weights_path() -> str | Path          # optional: build_model()'s weights as safetensors (a file, or a
                                              # directory with shards and their index; relative to the file),
                                              # loaded strictly by state-dict name into what build_model()
                                              # built (which may be on meta); convert --stream needs it
    LOGITS = True                             # optional: outputs are logits (report adds KL, top-1)
"""
from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowconv.errors import LowconvError
from lowconv.input_checkpoint import input_checkpoint, load_weights, named_tensors
from lowconv.site import FLOAT_DTYPES



@dataclass
class ModelFile:
    source: str  # the model file's path, or the model source it came from (model_sources.py)
    model: nn.Module
    inputs: object  # as example_inputs() returned it, moved and cast
    logits: bool | None
    # calibration(n): the first n batches of calibration_inputs(), moved and cast, drawn lazily
    # (only a conversion with static or delayed scales asks); None where the file defines none
    calibration: Callable[[int], Iterator] | None = None


def import_file(path: Path):
    if path.is_dir():
        raise LowconvError(f"model file {path} is a directory: give the Python file that defines "
                           "build_model() and example_inputs() (a converted model's directory goes to "
                           "`lowconv compare MODEL_FILE DIR`)")
    if not path.is_file():
        raise LowconvError(f"model file {path} does not exist")
    name = f"lowconv_model_{abs(hash(str(path.resolve())))}"
    # As `python FILE` does: the file's directory first on the import path, so that it imports the
    # modules beside it (kept there: build_model() and the model's code may import them later).
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except SystemExit as err:  # sys.exit() or argparse at import: not lowconv's own exit
        raise LowconvError(f"{path}: importing it called sys.exit({err.code!r}) (does it parse "
                           "command-line arguments at import?)") from None
    except Exception as err:
        raise LowconvError(f"{path}: importing it failed: {type(err).__name__}: {err}") from err
    return module


def call(module, path: Path, function: str):
    fn = getattr(module, function, None)
    if not callable(fn):
        raise LowconvError(f"{path} does not define {function}() (a model file defines build_model() "
                           f"and example_inputs())")
    try:
        return fn()
    except SystemExit as err:
        raise LowconvError(f"{path}: {function}() called sys.exit({err.code!r})") from None
    except Exception as err:
        raise LowconvError(f"{path}: {function}() failed: {type(err).__name__}: {err}") from err


def to_device(value, device: torch.device, dtype: torch.dtype | None):
    """Move tensors (nested in tuples, named tuples, lists, dicts and other mappings, which become
    dicts) to device; cast floating ones to dtype."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [to_device(v, device, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Mapping):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    return value


BUILT_FROM = "build_model()'s model"  # for messages
CALIBRATION_BATCHES = 64  # what convert takes of calibration_inputs() unless --calibration says
CALIBRATION_INPUTS = "the calibration inputs given"  # what the plan says calibrated on calibration_inputs()


def load_model_file(path: str | Path, *, device: str = "cpu", dtype: str | None = None,
                    seed: int = 0) -> ModelFile:
    """Import the file, build the model (its weights_path() loaded into it, where the file defines
    one) and its example inputs under `seed`, on `device`."""
    path = Path(path)
    cast = checked_cast(dtype, seed)
    module = import_file(path)
    torch.manual_seed(seed)
    model = build_file_model(module, path)
    if hasattr(module, "weights_path"):
        load_weights(model, input_checkpoint(file_weights(module, path), str(path)), str(path), BUILT_FROM)
    check_no_meta([name for name, t in named_tensors(model) if t.is_meta], module, path)
    reseed = inputs_seed(module, seed)
    loaded = placed(str(path), model, example_inputs(module, path, reseed), logits_flag(module, path), device, cast)
    if hasattr(module, "calibration_inputs"):
        loaded.calibration = lambda count: calibration_batches(module, path, count, torch.device(device), cast, reseed)
    return loaded


def build_file_model(module, path: Path) -> nn.Module:
    model = call(module, path, "build_model")
    if not isinstance(model, nn.Module):
        raise LowconvError(f"{path}: build_model() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_no_meta(names: list[str], module, path: Path) -> None:
    """Refuse a model that build_model() built with tensors on the meta device that nothing fills."""
    if names:
        fix = ("save them in weights_path()'s checkpoint, or build them with values (a buffer that is not "
               "persistent is in no state dict)") if hasattr(module, "weights_path") else \
            "define weights_path() to load its weights into it, or build it with them"
        raise LowconvError(f"{path}: build_model() built {len(names)} tensors on the meta device (no values) that "
                           f"nothing fills: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}; {fix}")


def inputs_seed(module, seed: int) -> int | None:
    """The seed example_inputs() and calibration_inputs() each run under, where the file defines
    weights_path() (None: they run on from where build_model() left torch's generator). The draws
    for weights that the checkpoint replaces then do not shift the inputs, which are the same in
    memory and streamed (where build_model() builds on the meta device and draws nothing)."""
    return seed if hasattr(module, "weights_path") else None


def example_inputs(module, path: Path, reseed: int | None):
    if reseed is not None:
        torch.manual_seed(reseed)
    inputs = call(module, path, "example_inputs")
    if inputs is None:
        raise LowconvError(f"{path}: example_inputs() returned None; return a tuple of forward arguments "
                           "(() for none), a dict of keyword arguments, or one tensor")
    return inputs


def logits_flag(module, path: Path) -> bool | None:
    logits = getattr(module, "LOGITS", None)
    if logits is not None and not isinstance(logits, bool):
        raise LowconvError(f"{path}: LOGITS must be True or False, got {logits!r}")
    return logits


def file_weights(module, path: Path) -> Path:
    """Where weights_path() says the weights are: a path relative to the model file's directory."""
    where = call(module, path, "weights_path")
    if not isinstance(where, (str, os.PathLike)):
        raise LowconvError(f"{path}: weights_path() returned {type(where).__name__}, not a path (a safetensors file, or "
                           f"a directory with model.safetensors or shards and their index)")
    return path.resolve().parent / where


def calibration_batches(module, path: Path, count: int, device: torch.device, cast: torch.dtype | None,
                        reseed: int | None) -> Iterator:
    """The first `count` batches of the file's calibration_inputs() (under `reseed`, inputs_seed),
    moved and cast as the example inputs are."""
    if reseed is not None:
        torch.manual_seed(reseed)
    batches = call(module, path, "calibration_inputs")
    try:
        batches = iter(batches)
    except TypeError:
        raise LowconvError(f"{path}: calibration_inputs() returned {type(batches).__name__}, not an iterable of "
                           f"batches (each a tuple of forward arguments, a dict of keyword arguments or one "
                           f"tensor)") from None
    for batch in itertools.islice(batches, count):
        yield to_device(batch, device, cast)


def no_calibration_inputs(spec: str) -> LowconvError:
    return LowconvError(f"--calibration: {spec} defines no calibration_inputs() (a model file may define one that "
                        "returns an iterable of batches, each as example_inputs() returns them; an hf: text model "
                        "takes --calibration-text FILE)")


def checked_cast(dtype: str | None, seed) -> torch.dtype | None:
    """The dtype to cast a model and its inputs to (None: as built), after checking the options."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise LowconvError(f"dtype {dtype!r} is not one of: {', '.join(FLOAT_DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise LowconvError(f"seed {seed!r} is not an integer")
    if not -2 ** 63 <= seed < 2 ** 64:  # what torch.manual_seed takes
        raise LowconvError(f"seed {seed} is out of range (-2^63 to 2^64 - 1)")
    return FLOAT_DTYPES[dtype] if dtype else None


def placed(source: str, model: nn.Module, inputs, logits: bool | None, device: str,
           cast: torch.dtype | None) -> ModelFile:
    """The built model and inputs moved to `device` and cast (floating tensors only)."""
    model = model.to(device=device, dtype=cast) if cast else model.to(device)
    return ModelFile(source, model, to_device(inputs, torch.device(device), cast), logits)
