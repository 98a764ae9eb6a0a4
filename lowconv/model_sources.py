"""Model sources: turn what the command line names as MODEL into (model, example inputs).

    path/to/model.py           a model file (lowconv.model_file)
    hf:DIR                     a local Hugging Face directory: config.json, and its safetensors
                               weights when there are any (random weights otherwise)
    timm:NAME                  a timm model with random weights (pretrained=False)
    torchvision:NAME           a torchvision classification model with random weights (weights=None)
    nn:NAME                    a torch.nn model: transformer-encoder, multihead-attention

Nothing is downloaded: real weights come from local files only. Each source makes example inputs
that fit the model: a batch of 2 images at the model's input size for vision models; for text
models 2 rows of 16 token ids with an attention mask whose second row ends in 4 padding tokens
(so the conversion sees a real padding mask), and use_cache=False where the forward takes it
(a run on example inputs must not grow a KV cache).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from lowconv.errors import LowconvError
from lowconv.model_file import ModelFile, checked_cast, load_model_file, placed

BATCH, TOKENS, PADDING = 2, 16, 4
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def load_model(spec: str, *, device: str = "cpu", dtype: str | None = None, seed: int = 0) -> ModelFile:
    """The model and example inputs that `spec` names (see the module docstring), built under
    `seed` on `device`, cast to `dtype` (floating tensors only)."""
    spec = str(spec)
    prefix, colon, name = spec.partition(":")
    if Path(spec).exists() or spec.endswith(".py") or not colon:
        return load_model_file(spec, device=device, dtype=dtype, seed=seed)
    if prefix not in SOURCES:
        raise LowconvError(f"model {spec!r}: unknown source {prefix!r} (one of: a model file path, "
                           f"{', '.join(f'{p}:{SOURCES[p][1]}' for p in SOURCES)})")
    cast = checked_cast(dtype, seed)
    build, _ = SOURCES[prefix]
    torch.manual_seed(seed)
    model, inputs, logits = build(name, spec)
    return placed(spec, model.eval(), inputs, logits, device, cast)


def library(module: str, spec: str, install: str):
    """Import a model library, or say which pip package the source needs."""
    try:
        return importlib.import_module(module)
    except Exception as err:  # torchvision beside a torch it was not built for fails with RuntimeError
        raise LowconvError(f"model {spec!r} needs {module}, which does not import here "
                           f"({type(err).__name__}: {err}): {install}") from None


def known_name(name: str, names: list[str], spec: str, what: str) -> str:
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"close matches: {', '.join(close)}" if close else f"{len(names)} {what} known, e.g. {', '.join(names[:5])}"
        raise LowconvError(f"model {spec!r}: {name!r} is not a {what} name ({hint})")
    return name


def images(channels: int, height: int, width: int) -> torch.Tensor:
    return torch.randn(BATCH, channels, height, width)


# ---- timm, torchvision ----

def timm_model(name: str, spec: str):
    timm = library("timm", spec, "pip install timm (it needs a torchvision built for your torch)")
    known_name(name, timm.list_models(), spec, "timm model")
    model = timm.create_model(name, pretrained=False)
    channels, height, width = model.pretrained_cfg.get("input_size", (3, 224, 224))
    return model, (images(channels, height, width),), getattr(model, "num_classes", 0) > 0


def torchvision_model(name: str, spec: str):
    torchvision = library("torchvision", spec, "pip install the torchvision release built for your torch")
    known_name(name, torchvision.models.list_models(module=torchvision.models), spec,
               "torchvision classification model")
    model = torchvision.models.get_model(name, weights=None)
    randomize_zero_weights(model)
    size = getattr(model, "image_size", 224)  # the ViTs take only their own size
    return model, (images(3, size, size),), True


def randomize_zero_weights(model: nn.Module) -> None:
    """Draw N(0, 0.02) weights for matrices a library initializes to zeros (torchvision's ViT
    head): a model with random weights whose output is always 0 would make every report exact."""
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2 and not weight.any():
                weight.normal_(0.0, 0.02)


# ---- Hugging Face ----

def hf_model(directory: str, spec: str):
    transformers = library("transformers", spec, "pip install transformers")
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise LowconvError(f"model {spec!r}: {path / 'config.json'} does not exist (hf:DIR names a local "
                           f"Hugging Face model directory: config.json, and safetensors weights if any)")
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        # The class config.json's `architectures` names (LlamaForCausalLM), else the base model.
        named = [getattr(transformers, name) for name in config.architectures or [] if hasattr(transformers, name)]
        if any((path / name).is_file() for name in HF_WEIGHTS):
            model, loading = (named[0] if named else transformers.AutoModel).from_pretrained(
                path, local_files_only=True, output_loading_info=True)
        else:  # a config alone: random weights, drawn under the seed
            model = named[0](config) if named else transformers.AutoModel.from_config(config)
            loading = None
    except (OSError, ValueError, KeyError, ImportError, AttributeError, RuntimeError, SafetensorError) as err:
        # ImportError: a model class whose extra dependency is missing; AttributeError: a config
        # naming something this transformers version lacks; RuntimeError: weights of other shapes;
        # SafetensorError: a corrupt weights file.
        raise LowconvError(f"model {spec!r}: transformers cannot build it: {type(err).__name__}: {err}") from None
    if loading is not None:
        check_weights_loaded(model, loading, path, spec)
    return model, hf_inputs(model, config, spec), None


def check_weights_loaded(model: nn.Module, loading: dict, path: Path, spec: str) -> None:
    """Refuse a weights file that fits none of the model's parameters (it would run on random
    weights). Some missing weights are normal (a task head over a base checkpoint)."""
    missing = set(loading.get("missing_keys") or [])
    parameters = [name for name, _ in model.named_parameters()]
    if parameters and missing >= set(parameters):
        unexpected = sorted(loading.get("unexpected_keys") or [])
        held = f"; it holds {', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}" if unexpected else ""
        raise LowconvError(f"model {spec!r}: none of the weights in {path} fit the model (it has "
                           f"{', '.join(parameters[:3])}, ...{held})")


def hf_inputs(model: nn.Module, config, spec: str) -> dict:
    """Example inputs for the model's main input: token ids with a padding mask, or images."""
    main = getattr(model, "main_input_name", "input_ids")
    params = inspect.signature(model.forward).parameters
    if main == "input_ids":
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = text_config.vocab_size
        inputs = {"input_ids": torch.randint(0, vocab, (BATCH, TOKENS))}
        if "attention_mask" in params:
            mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
            mask[1, TOKENS - PADDING:] = 0
            inputs["attention_mask"] = mask
    elif main == "pixel_values":
        if getattr(config, "image_size", None) is None:
            raise LowconvError(f"model {spec!r}: config.json has no image_size, so lowconv cannot make example "
                               f"images: write a model file with build_model() and example_inputs() instead "
                               f"(README: The model file)")
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        inputs = {"pixel_values": images(getattr(config, "num_channels", 3), size, size)}
    else:
        raise LowconvError(f"model {spec!r}: lowconv makes example inputs for text (input_ids) and image "
                           f"(pixel_values) models; this one's main input is {main!r}: write a model file "
                           f"with build_model() and example_inputs() instead (README: The model file)")
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


CALIBRATION_TOKENS = 512  # a row of calibration text; fewer where the model's context is shorter


def text_calibration(loaded: ModelFile, spec: str, text_file: str) -> tuple[Callable[[int], Iterator], str]:
    """For an hf:DIR text model: calibration batches cut from a text file, and what they are (for
    the report). The text is tokenized by DIR's tokenizer, without special tokens, into rows of
    CALIBRATION_TOKENS (one shorter row if the text has fewer), BATCH rows a batch, each batch
    like the example inputs (its other arguments, use_cache=False, kept)."""
    prefix, _, directory = spec.partition(":")
    if prefix != "hf":
        raise LowconvError(f"--calibration-text is for hf:DIR text models; {spec} is not one (a model file "
                           f"defines calibration_inputs() instead)")
    if not isinstance(loaded.inputs, dict) or "input_ids" not in loaded.inputs:
        raise LowconvError(f"--calibration-text: model {spec!r} does not take token ids (input_ids)")
    path = Path(text_file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise LowconvError(f"--calibration-text: cannot read {path} as UTF-8 text: {err}") from None
    transformers = library("transformers", spec, "pip install transformers")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError, AttributeError, TypeError) as err:
        raise LowconvError(f"--calibration-text: {directory} has no tokenizer transformers can load "
                           f"(tokenizer.json, tokenizer_config.json, ...): {type(err).__name__}: {err}") from None
    ids = torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise LowconvError(f"--calibration-text: {path} holds no text to calibrate on")
    vocab = loaded.model.get_input_embeddings().num_embeddings
    if ids.max() >= vocab:
        raise LowconvError(f"--calibration-text: {directory}'s tokenizer gives token id {ids.max().item()}, beyond the "
                           f"model's vocabulary of {vocab}: the tokenizer is not this model's")
    config = loaded.model.config
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    length = min(CALIBRATION_TOKENS, context or CALIBRATION_TOKENS, ids.numel())
    rows = ids[:ids.numel() // length * length].view(-1, length)
    device = loaded.inputs["input_ids"].device

    def batches(count: int) -> Iterator:
        for chunk in itertools.islice(rows.split(BATCH), count):
            chunk = chunk.to(device)
            batch = {**loaded.inputs, "input_ids": chunk}
            if "attention_mask" in batch:
                batch["attention_mask"] = torch.ones_like(chunk)
            yield batch
    return batches, f"{length}-token rows of {path}, up to {BATCH} a batch"


# ---- torch.nn ----

D_MODEL, HEADS, FEEDFORWARD, LAYERS = 64, 4, 128, 2


def nn_model(name: str, spec: str):
    known_name(name, list(NN_MODELS), spec, "nn model")
    return NN_MODELS[name]()


def transformer_encoder():
    """Two post-norm encoder layers over a padded batch (the padding mask reaches every attention)."""
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    padding = torch.zeros(BATCH, TOKENS, dtype=torch.bool)
    padding[1, TOKENS - PADDING:] = True
    return model, {"src": torch.randn(BATCH, TOKENS, D_MODEL), "src_key_padding_mask": padding}, None


def multihead_attention():
    """Self-attention of one nn.MultiheadAttention; its attention weights are not asked for."""
    x = torch.randn(BATCH, TOKENS, D_MODEL)
    return nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True), {"query": x, "key": x, "value": x,
                                                                     "need_weights": False}, None


NN_MODELS = {"transformer-encoder": transformer_encoder, "multihead-attention": multihead_attention}
SOURCES = {  # prefix -> (builder, what follows the prefix)
    "hf": (hf_model, "DIR"),
    "timm": (timm_model, "NAME"),
    "torchvision": (torchvision_model, "NAME"),
    "nn": (nn_model, "|".join(NN_MODELS)),
}
