"""lowconv's command line: convert, compare, inspect, recipes."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from tabulate import tabulate

from lowconv import api, checkpoint, report as reports
from lowconv.analysis import plan_conversion
from lowconv.compare import compare
from lowconv.replay import read_plan
from lowconv.errors import LowconvError, LowconvWarning, ModelRunError
from lowconv.model_file import CALIBRATION_BATCHES, CALIBRATION_INPUTS, no_calibration_inputs
from lowconv.model_sources import load_model, text_calibration
from lowconv.plan import Plan
from lowconv.recipe import builtin_recipes, load_recipe
from lowconv.stream import stream_convert
from lowconv.site import FLOAT_DTYPES, SiteRecord, TensorMeta

DESCRIPTION = ("Convert a PyTorch model's linear and attention layers to faster, smaller ops "
               "(FP8, 2:4 sparse, fp16 accumulation, lowconv attention), and report what it costs in accuracy.")
EPILOG = """examples:
  lowconv recipes
  lowconv inspect examples/vit.py                     # every linear and attention site
  lowconv inspect examples/vit.py fp8-dynamic         # ... and what the recipe would do to each
  lowconv convert examples/vit.py fp8-dynamic -o out/ # out/model.safetensors, report.md, report.json
  lowconv compare examples/vit.py out/                # rebuild from out/, re-check; exit 1 if the gate fails
  lowconv inspect hf:path/to/llama sparse-attention-bf16   # a local Hugging Face directory
  lowconv convert timm:vit_base_patch16_224 fp8-dynamic -o out/

MODEL is a model file (it defines build_model() and example_inputs()), or a model source with
example inputs made for it: hf:DIR (config.json, and safetensors weights if any), timm:NAME,
torchvision:NAME (random weights), nn:transformer-encoder, nn:multihead-attention. Nothing is
downloaded. RECIPE is a .toml path or a built-in name."""


MODEL_HELP = "model file (defines build_model() and example_inputs()), or hf:DIR, timm:NAME, torchvision:NAME, nn:NAME"


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of batches, 1 or more (got {text!r})")
    return value


def progress(message: str) -> None:
    print(f"lowconv: {message}", file=sys.stderr, flush=True)


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise LowconvError("--device cuda: no CUDA device is available (use --device cpu)")
    return name


def shape(meta: TensorMeta | None) -> str:
    return "x".join(map(str, meta.shape)) if meta else "?"


def site_details(site: SiteRecord) -> str:
    hidden = {"form", "weight", "bias_name", "dtype"}
    if site.info.form == "mha":  # its masks are call arguments, not part of the site
        hidden |= {"mask", "causal", "scale"}
    info = {k: v for k, v in asdict(site.info).items() if k not in hidden}
    if site.kind == "attention":
        info = {k: v for k, v in info.items() if v is not None}
    details = ", ".join(f"{k}={v}" for k, v in info.items())
    return details + (f"; cannot convert: {site.unsupported}" if site.unsupported else "")


def sites_table(plan: Plan) -> str:
    rows = [[d.fqn, d.site.kind, d.site.info.form, shape(d.site.input), shape(d.site.output),
             (d.site.input or d.site.output or d.site.info).dtype or "?", site_details(d.site)]
            for d in plan.decisions]
    return tabulate(rows, ["site", "kind", "form", "input", "output", "dtype", "details"])


def plan_table(plan: Plan) -> str:
    rows = []
    for d in plan.decisions:
        options = ", ".join(f"{k}={v}" for k, v in asdict(d.options).items())
        reason = f"{d.reason}; {d.note}" if d.note else d.reason
        rows.append([d.fqn, d.site.kind, d.op, options, d.rule or "-", reason])
    return tabulate(rows, ["site", "kind", "op", "options", "rule", "reason"])


def plan_notes(plan: Plan) -> str:
    lines = [f"not traced: {u['fqn'] or '(whole model)'}: {u['error']}" for u in plan.untraced]
    lines += [f"warning: {w}" for w in plan.warnings]
    converted = len(plan.converted())
    lines.append(f"{len(plan.decisions)} sites: {converted} converted, {len(plan.decisions) - converted} kept")
    return "\n".join(lines)


def cmd_recipes(args) -> int:
    rows = [[name, load_recipe(path).description] for name, path in builtin_recipes().items()]
    print(tabulate(rows, ["recipe", "description"]))
    return 0


def cmd_inspect(args) -> int:
    loaded = load_model(args.model, device=pick_device(args.device), dtype=args.dtype, seed=args.seed)
    recipe = args.recipe or "keep-all"
    _, plan = plan_conversion(loaded.model, recipe, loaded.inputs)
    print(sites_table(plan))
    if args.recipe:
        print(f"\nrecipe {plan.recipe}:")
        print(plan_table(plan))
    print()
    print(plan_notes(plan))
    return 0


def print_report(report: reports.Report) -> int:
    print(reports.report_to_table(report))
    failures = reports.gate_failures(report)
    if failures:
        print("\nGATE FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def cmd_convert(args) -> int:
    if not args.output.strip():
        raise LowconvError("-o: give the output directory's path (it was empty)")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise LowconvError(f"the output directory {out} is a file; give a directory (-o)")
    prefix, _, source = args.model.partition(":")
    if prefix == "hf" and out.exists() and out.resolve() == Path(source).resolve():
        raise LowconvError(f"-o {out} is the model's own directory: the converted checkpoint would replace the "
                           f"weights it is made from; give another directory")
    check_writable(out)
    if args.stream:
        return stream(args, out)
    device = pick_device(args.device)
    loaded = load_model(args.model, device=device, dtype=args.dtype, seed=args.seed)
    recipe = load_recipe(args.recipe)
    calibration_name = CALIBRATION_INPUTS
    if args.calibration_text:
        loaded.calibration, calibration_name = text_calibration(loaded, args.model, args.calibration_text)
    if args.calibration and loaded.calibration is None:
        raise no_calibration_inputs(args.model)
    calibration = None if loaded.calibration is None else loaded.calibration(args.calibration or CALIBRATION_BATCHES)
    with warnings.catch_warnings():  # the plan's warnings: plan_notes prints them
        warnings.simplefilter("ignore", LowconvWarning)
        converted = api.convert(loaded.model, recipe, loaded.inputs, calibration=calibration,
                                calibration_name=calibration_name, share_weights=True, recorded=recorded(args),
                                progress=progress)
    if args.sparse_format == "dense" and any(d.op == "semi_sparse" for d in api.plan_of(converted).converted()):
        progress("2:4 layers to plain weights with their zeros (--sparse-format dense)")
        converted = api.revert(converted, "semi_sparse")
    plan = api.plan_of(converted)
    print(plan_table(plan))
    print(plan_notes(plan))
    progress("comparing original and converted on the example inputs")
    report = compare(loaded.model, converted, loaded.inputs, logits=loaded.logits)
    # Everything is computed before the first write, and the four files replace the old ones all
    # or none, so a failure leaves out/ as it was.
    replaced = " (replacing the conversion there)" if (out / "plan.json").exists() else ""
    progress(f"writing {out / 'model.safetensors'}{replaced}")
    api.save(converted, out, text_files={
        "plan.json": plan.to_json(), "report.md": reports.report_to_markdown(report),
        "report.json": json.dumps(reports.report_to_dict(report), indent=1)}, max_shard_bytes=args.max_shard_size)
    print()
    status = print_report(report)
    progress(f"wrote {out}/model.safetensors, report.md, report.json, plan.json")
    return status


def stream(args, out: Path) -> int:
    """convert --stream: the checkpoint written tensor by tensor (stream.py), scales calibrated and
    the models compared module by module (stream_pass.py)."""
    if args.sparse_format == "dense":
        raise LowconvError("--stream does not take --sparse-format dense: it converts no 2:4 layers; convert without "
                           "--stream (in memory) for those")

    def text_files(plan: Plan, report: reports.Report | None) -> dict[str, str]:
        return {"plan.json": plan.to_json(), "report.md": reports.report_to_markdown(report) if report else "",
                "report.json": json.dumps(reports.report_to_dict(report), indent=1) if report else ""}
    streamed = stream_convert(args.model, args.recipe, out, seed=args.seed, dtype=args.dtype,
                              device=pick_device(args.device),
                              calibration_text=args.calibration_text,
                              calibration_batches=args.calibration, text_files=text_files,
                              max_shard_bytes=args.max_shard_size, progress=progress,
                              recorded=recorded(args))
    print(plan_table(streamed.plan))
    print(plan_notes(streamed.plan))
    print()
    status = print_report(streamed.report)
    resumed = f" ({streamed.skipped} tensors kept from an interrupted run)" if streamed.skipped else ""
    progress(f"wrote {streamed.path}{resumed}, plan.json, report.md, report.json")
    return status


def shard_size(text: str) -> int:
    """argparse type: bytes, as a whole number with an optional unit (KB, MB, GB: powers of 1000,
    as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    number, unit = text.strip().upper(), 1
    for suffix, size in units.items():
        if number.endswith(suffix):
            number, unit = number[:-len(suffix)].strip(), size
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB, 500MB or a number of bytes (got {text!r})")
    return int(number) * unit


def check_writable(out: Path) -> None:
    """Fail before the work where out/ cannot be written: a read-only or full disk was otherwise
    found after the whole conversion and comparison. A byte is written and synced beside where
    out/ goes (its nearest existing directory), then removed."""
    existing = out
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing) as probe:
            probe.write(b"\0")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        raise LowconvError(f"-o {out}: cannot write in {existing}: {err.strerror or err}") from None


def recorded(args) -> dict:
    """What the plan records of how the command line made the model: `lowconv compare` makes it so again."""
    return {"file": recorded_path(args.model), "seed": args.seed, "dtype": args.dtype}


def recorded_path(spec: str) -> str:
    """The model as the plan records it: a path (a model file's, hf:DIR's) relative to the working
    directory, however it was spelled, so that the same conversion writes the same bytes."""
    prefix, colon, rest = spec.partition(":")
    if colon and prefix == "hf":
        return f"hf:{os.path.relpath(rest)}"
    return os.path.relpath(spec) if Path(spec).exists() else spec


def cmd_compare(args) -> int:
    plan, _ = read_plan(args.output)
    seed = args.seed if args.seed is not None else plan.model.get("seed", 0)
    converted_dtype = plan.model.get("dtype")
    # Only `lowconv convert` records its --dtype (None: none given); a checkpoint saved from Python has none.
    if args.dtype and "dtype" in plan.model and args.dtype != converted_dtype:
        made = f"with --dtype {converted_dtype}" if converted_dtype else "without --dtype (as the model file builds it)"
        raise LowconvError(f"{args.output} was converted {made}; compare it the same way (leave --dtype out to "
                           f"reuse that), not with --dtype {args.dtype}")
    dtype = args.dtype or converted_dtype
    loaded = load_model(args.model, device=pick_device(args.device), dtype=dtype, seed=seed)
    progress(f"rebuilding the converted model from {args.output}")
    converted = api.load(loaded.model, args.output, example_inputs=loaded.inputs)
    differ = parameters_not_from(loaded.model, converted, plan)
    if differ:
        converted_seed = plan.model.get("seed", 0)
        why = f" (it was converted with --seed {converted_seed}, this run used --seed {seed})" \
            if converted_seed != seed else ""
        kept = f"{len(differ)} parameters the conversion kept as they were" if len(differ) > 1 else \
            "a parameter the conversion kept as it was"
        raise LowconvError(f"{args.output}: its checkpoint holds other values than this model for {kept} "
                           f"(e.g. {', '.join(differ[:3])}): it was converted from other weights{why}")
    report = compare(loaded.model, converted, loaded.inputs, logits=loaded.logits)
    return print_report(report)


# A converted linear's weight (e4m3, or pruned 2:4) against the original's reads about 30 dB, or
# 5-10 dB for random weights pruned 2:4; another draw of the same random init about -3 dB.
OTHER_WEIGHTS_SQNR_DB = 0.0


def parameters_not_from(original: torch.nn.Module, converted: torch.nn.Module, plan: Plan) -> list[str]:
    """Names of the parameters of the model rebuilt from a checkpoint that did not come from the
    original model: those outside every converted site (kept as they were) whose values differ (NaN
    equal to NaN), and converted linears' weights that are no quantization or pruning of the
    original's (SQNR under OTHER_WEIGHTS_SQNR_DB). Buffers are left out: one made with torch.empty
    holds other bytes on every build."""
    sites = [d.fqn for d in plan.converted()]
    rebuilt = dict(converted.named_parameters())
    kept = [name for name, t in original.named_parameters()
            if not any(site in ("", name) or name.startswith(site + ".") for site in sites) and name in rebuilt
            and rebuilt[name].shape == t.shape and rebuilt[name].dtype == t.dtype
            and not torch.allclose(rebuilt[name], t, rtol=0, atol=0, equal_nan=True)]
    return kept + converted_weights_not_from(original, converted, plan)


def converted_weights_not_from(original: torch.nn.Module, converted: torch.nn.Module, plan: Plan) -> list[str]:
    """The converted linears whose weight (linear_weight(): the e4m3 weight dequantized, the 2:4
    pruned one) is further from the original's than OTHER_WEIGHTS_SQNR_DB: a model whose every
    parameter was converted shows another seed's weights here only."""
    weights = dict(original.named_parameters())
    differ = []
    for decision in plan.converted():
        name = f"{decision.fqn}.weight" if decision.fqn else "weight"
        try:
            module = converted.get_submodule(decision.fqn)
        except AttributeError:
            continue
        if name not in weights or not hasattr(module, "linear_weight"):
            continue
        ours, theirs = module.linear_weight().detach().float(), weights[name].detach().float()
        if ours.shape != theirs.shape and ours.shape == theirs.t().shape:
            theirs = theirs.t()  # GPT-2's Conv1D holds (in, out)
        if ours.shape == theirs.shape and reports.tensor_metrics(theirs, ours).sqnr_db < OTHER_WEIGHTS_SQNR_DB:
            differ.append(name)
    return differ


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowconv", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help_, func, example):
        c = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.set_defaults(func=func)
        return c

    def model_options(c, seed_default=0):
        c.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        c.add_argument("--seed", type=int, default=seed_default,
                       help="seed for build_model() and example_inputs()")
        c.add_argument("--dtype", choices=list(FLOAT_DTYPES), help="cast the model and its inputs first")

    command("recipes", "list the built-in recipes", cmd_recipes, "lowconv recipes")
    c = command("inspect", "list the sites of a model, and with a recipe what it would do to each",
                cmd_inspect, "lowconv inspect examples/vit.py fp8-dynamic")
    c.add_argument("model", help=MODEL_HELP)
    c.add_argument("recipe", nargs="?", help="recipe file or built-in recipe name")
    model_options(c)
    c = command("convert", "convert a model; write the checkpoint and the accuracy report",
                cmd_convert, "lowconv convert examples/vit.py fp8-dynamic -o out/")
    c.add_argument("model", help=MODEL_HELP)
    c.add_argument("recipe", help="recipe file or built-in recipe name (see `lowconv recipes`)")
    c.add_argument("-o", "--output", required=True, help="output directory")
    c.add_argument("--calibration", type=positive, metavar="N",
                   help="calibrate static and delayed FP8 scales on the first N batches of the model file's "
                        f"calibration_inputs() (default: up to {CALIBRATION_BATCHES} of them where the file "
                        "defines it, else the example inputs)")
    c.add_argument("--sparse-format", choices=["bitmask", "dense"], default="bitmask",
                   help="how 2:4 layers are written: bitmask (kept values and a bit mask: 2:4 speed, read by "
                        "lowconv alone) or dense (plain weights with their zeros, as lowconv.revert makes them: "
                        "transformers and vLLM load them; the speed-up goes)")
    c.add_argument("--stream", action="store_true",
                   help="hf:DIR with safetensors weights, or a model file with weights_path(): convert tensor by "
                        "tensor, never holding the model (a model larger than memory); linear sites; the report as "
                        "in memory, not timed (README: Streamed conversion)")
    c.add_argument("--max-shard-size", type=shard_size, default=checkpoint.MAX_SHARD_BYTES, metavar="SIZE",
                   help="cut the checkpoint into shards of at most SIZE (5GB, 500MB, bytes; default 5GB)")
    c.add_argument("--calibration-text", metavar="FILE",
                   help="hf: text models: calibrate on this UTF-8 text, tokenized by the model directory's "
                        "tokenizer into rows of up to 512 tokens, 2 rows a batch")
    model_options(c)
    c = command("compare", "rebuild a saved conversion and re-check it against the original",
                cmd_compare, "lowconv compare examples/vit.py out/")
    c.add_argument("model", help="the model file or source the conversion was made from")
    c.add_argument("output", help="the directory `lowconv convert -o` wrote")
    model_options(c, seed_default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (LowconvError, OSError) as err:
        model = f"{args.model}: " if isinstance(err, ModelRunError) and getattr(args, "model", None) else ""
        print(f"lowconv: error: {model}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowconv: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug in lowconv, not the user's input: say so, with the traceback
        traceback.print_exc()
        print("lowconv: internal error: this is a bug in lowconv; please report it with the traceback above",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
