"""The Hugging Face folder of a converted transformers model, written beside lowconv's checkpoint.

config.json is the original's config with a `quantization_config` that says what the safetensors
hold: compressed-tensors' "float-quantized" format where every converted site is an FP8 inference
linear of a scheme it describes (what transformers and vLLM load); else a `lowconv_only` reason and
no `quant_method`, which transformers refuses (a quant_method it does not know, it skips with a
warning and loads the weights as plain values). The source directory's tokenizer and generation
files are copied beside it (checkpoint.py shards the weights above 5 GB, as transformers does).

compressed-tensors' FP8 schemes as lowconv writes them (the tensor names are already theirs:
`weight` e4m3, `weight_scale` (1,) or (out, 1), `input_scale` (1,) for static scales):
  granularity "row":    weights strategy "channel"; dynamic activations strategy "token"
  granularity "token":  weights strategy "tensor";  dynamic activations strategy "token"
  granularity "block":  weights strategy "block" (block_structure [128, 128]); dynamic activations
                        strategy "group" (group_size 128): FP8_BLOCK
  granularity "tensor": weights strategy "tensor";  dynamic activations strategy "tensor" (vLLM
                        runs dynamic FP8 activations per token, which is closer, not the same:
                        "token" is what it runs)
  scaling "static":     activations strategy "tensor", dynamic false, input_scale stored
  scaling "delayed", training modules (master weights), Conv1D sites (GPT-2's: lowconv stores their
  weights (out, in) under HF's (in, out) names) and every other op: no such form.
Sites lowconv.revert made plain again (op "dense", e.g. 2:4 layers written with their zeros by
`convert --sparse-format dense`) are plain weights under the module's own names: no scheme needed.
compressed-tensors 0.20's own forward (transformers on the CPU) takes "token" scales over all but the
last dimension only for inputs of 3 or more; a 2-D input (OPT's MLP, BERT's pooler) it scales as one
tensor, where lowconv scales each row: there transformers computes another model (27-38 dB apart).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from torch import nn

from lowconv.errors import LowconvError
from lowconv.kernels.fp8 import BLOCK, LINEAR_GRANULARITIES
from lowconv.plan import Plan
from lowconv.site import LinearInfo

# What the plan records of a transformers model (Plan.model): its config, and the local directory
# it came from, whose tokenizer and generation files the folder copies.
CONFIG_KEY, SOURCE_KEY = "hf_config", "hf_source"
# Files of a source directory that are not the model's weights or config: the tokenizer's,
# generation_config.json, a chat template. Weights are lowconv's to write.
NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}


def origin(model: nn.Module) -> dict:
    """What Plan.model keeps of a transformers PreTrainedModel ({} for any other model)."""
    config = getattr(model, "config", None)
    if not type(model).__module__.startswith("transformers.") or not hasattr(config, "to_dict"):
        return {}
    found = {CONFIG_KEY: config.to_dict()}
    source = getattr(config, "_name_or_path", "")
    if source and Path(source).is_dir():
        found[SOURCE_KEY] = str(Path(source).resolve())
    return found


def folder_files(plan: Plan, dtype: str | None) -> dict[str, str | bytes]:
    """{file name: content} of the Hugging Face folder for a converted transformers model whose
    floating weights are in `dtype` (None: several), {} for other models. config.json says that
    dtype: a model cast after it was built keeps the dtype it was built in in its config."""
    config = plan.model.get(CONFIG_KEY)
    if config is None:
        return {}
    files: dict[str, str | bytes] = {}
    source = plan.model.get(SOURCE_KEY)
    if source and Path(source).is_dir():
        files.update({p.name: p.read_bytes() for p in sorted(Path(source).iterdir())
                      if p.is_file() and p.name not in NOT_COPIED and not p.name.endswith(WEIGHT_SUFFIXES)})
    config = dict(config)
    for key in ("dtype", "torch_dtype"):
        if dtype is not None and key in config:
            config[key] = dtype
    quantization = quantization_config(plan)
    if quantization is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization
    files["config.json"] = json.dumps(config, indent=2, sort_keys=True) + "\n"
    return files


def quantization_config(plan: Plan) -> dict | None:
    """config.json's quantization_config for what the plan converted; None where nothing was."""
    groups: dict[str, dict] = {}
    unserved = []
    for decision in plan.converted():
        # a 2:4 FP8 layer's checkpoint is an fp8 one of the pruned weight, its x scaled dynamically
        # (ops/fp8_semi_sparse.py)
        scheme = fp8_scheme(asdict(decision.options)) if decision.op in ("fp8", "fp8_semi_sparse") else None
        info = decision.site.info
        if isinstance(info, LinearInfo) and info.weight_layout == "in_out":  # a Conv1D: lowconv stores it (out, in)
            scheme, what = None, f"{decision.op}, a Conv1D stored (out, in) under its (in, out) name"
        elif decision.op == "dense" and decision.site.module_backed:  # plain weights under the module's names
            continue
        else:
            what = decision.op if decision.site.module_backed else f"{decision.op}, a functional site made a module"
        if scheme is None:
            unserved.append(f"{decision.fqn} ({what})")
            continue
        key = json.dumps(scheme, sort_keys=True)
        groups.setdefault(key, {"targets": [], **scheme})["targets"].append(decision.fqn)
    if unserved:  # no quant_method: transformers raises on that (an unknown one it skips, loading plain weights)
        return {"lowconv_only": f"compressed-tensors has no form for {len(unserved)} converted sites, e.g. "
                                f"{', '.join(unserved[:3])}: only lowconv.load reads this folder (its plan is in "
                                f"model.safetensors' metadata)"}
    if not groups:
        return None
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {f"group_{i}": group for i, group in enumerate(groups.values())},
            "ignore": [], "kv_cache_scheme": None}


def fp8_scheme(options: dict) -> dict | None:
    """compressed-tensors' weights and input_activations of an fp8 site's options as a dict (module doc);
    options without `scaling` (fp8_semi_sparse's) scale x dynamically."""
    scaling = options.get("scaling", "dynamic")
    if options.get("training") or scaling not in ("dynamic", "static"):
        return None
    x_scales, w_scales = LINEAR_GRANULARITIES[options.get("granularity", "tensor")]
    weights = {**FP8_ARGS, "strategy": {"row": "channel"}.get(w_scales, w_scales), "dynamic": False}
    if w_scales == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
    if scaling == "static":
        inputs = {**FP8_ARGS, "strategy": "tensor", "dynamic": False}
    else:
        inputs = {**FP8_ARGS, "strategy": {"row": "token"}.get(x_scales, x_scales), "dynamic": True}
        if x_scales == "group":
            inputs["group_size"] = BLOCK
    return {"weights": weights, "input_activations": inputs}


def quantized_config_problem(model: nn.Module) -> str | None:
    """What a transformers model's config says of a quantization it already holds (None: none)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return f"its config has a quantization_config (quant_method {getattr(method, 'value', method)})"


def refuse_save_pretrained(*args, **kwargs):
    """A converted model's save_pretrained: transformers would write lowconv's weights under a
    config that does not describe them."""
    raise LowconvError("save_pretrained cannot describe a lowconv conversion: use lowconv.save(converted, "
                       "directory), which writes the Hugging Face folder (config.json with its "
                       "quantization_config, tokenizer files, model.safetensors)")
