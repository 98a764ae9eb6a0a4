"""The coverage table of README's "Real models": per model, the linears (nn.Linear and Hugging
Face's Conv1D modules) and attention modules it has, the sites `lowconv inspect` finds, what each
recipe converts and keeps (with why), and the output SQNR per recipe with its gate.

    .venv/bin/python scripts/coverage_real_models.py              # the markdown table on stdout
    .venv/bin/python scripts/coverage_real_models.py --out DIR    # also DIR/coverage_real_models.md

Models whose library does not import here are listed as skipped, with the reason. Random weights
(timm pretrained=False, torchvision weights=None, the hf:examples/hf/* configs alone), seed 0.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lowconv  # noqa: E402
from lowconv.errors import LowconvError  # noqa: E402
from lowconv.model_sources import load_model  # noqa: E402

RECIPES = ("fp8-dynamic", "semi-sparse", "sparse-attention-bf16")


def timm_fused(enabled: bool):
    """Switch timm's fused (SDPA) attention for models built after this (Swin's is 'experimental')."""
    def setup():
        import timm.layers
        timm.layers.set_fused_attn(enabled, experimental=enabled)
    return setup


@dataclass
class Row:
    label: str
    spec: str
    setup: object = None  # called before the model is built


ROWS = [
    Row("hf:examples/hf/llama-tiny (LlamaForCausalLM, GQA)", "hf:examples/hf/llama-tiny"),
    Row("hf:examples/hf/gpt2-tiny (GPT2LMHeadModel, Conv1D)", "hf:examples/hf/gpt2-tiny"),
    Row("hf:examples/hf/bert-tiny (BertModel)", "hf:examples/hf/bert-tiny"),
    Row("nn:transformer-encoder", "nn:transformer-encoder"),
    Row("nn:multihead-attention", "nn:multihead-attention"),
    Row("timm:vit_base_patch16_224, fused attention", "timm:vit_base_patch16_224", timm_fused(True)),
    Row("timm:vit_base_patch16_224, fused attention off", "timm:vit_base_patch16_224", timm_fused(False)),
    Row("timm:swin_tiny_patch4_window7_224, fused attention", "timm:swin_tiny_patch4_window7_224", timm_fused(True)),
    Row("timm:swin_tiny_patch4_window7_224, fused attention off", "timm:swin_tiny_patch4_window7_224",
        timm_fused(False)),
    Row("torchvision:vit_b_16", "torchvision:vit_b_16"),
]


def linear_modules(model: nn.Module) -> set[str]:
    """Names of the model's linear layers: nn.Linear and Hugging Face's Conv1D."""
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def attention_modules(model: nn.Module) -> set[str]:
    """Names of the innermost modules whose class says attention (LlamaAttention, BertSelfAttention,
    timm's Attention and WindowAttention, nn.MultiheadAttention): what should hold one site each."""
    named = {name for name, m in model.named_modules() if type(m).__name__.endswith("Attention")}
    return {name for name in named if not any(other.startswith(f"{name}.") for other in named)}


def site_owner(decision) -> str:
    """The module a site belongs to: a linear's weight owner, an attention op's enclosing module."""
    info = decision.site.info
    if decision.site.kind == "linear":
        return info.weight.removesuffix(".weight")
    return decision.fqn if decision.site.module_backed else decision.fqn.rpartition(".")[0]


def short_reason(reason: str) -> str:
    return reason.removeprefix("unsupported: ").replace("rule 1 chose ", "")


def measure(row: Row, device: str) -> dict:
    if row.setup is not None:
        row.setup()
    loaded = load_model(row.spec, device=device)
    linears, attentions = linear_modules(loaded.model), attention_modules(loaded.model)
    result = {"linears": len(linears), "attention modules": len(attentions), "recipes": {}}
    for recipe in RECIPES:
        start = time.perf_counter()
        converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
        report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=loaded.logits)
        decisions = converted.lowconv_plan.decisions
        found = {kind: [d for d in decisions if d.site.kind == kind] for kind in ("linear", "attention")}
        owners = {site_owner(d) for d in decisions}
        result["found linears"] = len(linears & owners)
        result["found attention"] = len(attentions & owners)
        result["not found"] = sorted((linears | attentions) - owners)
        result["attention sites"] = len(found["attention"])
        result["recipes"][recipe] = {
            "linear": sum(d.converted for d in found["linear"]),
            # an nn.MultiheadAttention expanded for this recipe adds its in_proj (no nn.Linear in the model)
            "linear sites": len(found["linear"]),
            "attention": sum(d.converted for d in found["attention"]),
            "kept": [(short_reason(d.reason), d.fqn) for d in decisions
                     if not d.converted and "no rule matched" not in d.reason],
            "sqnr": min(o.metrics.sqnr_db for o in report.outputs),
            "passed": report.passed,
            "seconds": time.perf_counter() - start,
        }
    return result


def sites(fqns: list[str]) -> str:
    """The sites kept for one reason: all of them when few, else the first and how many more."""
    unique = list(dict.fromkeys(fqns))
    return ", ".join(unique) if len(unique) <= 3 else f"{unique[0]} and {len(unique) - 1} more like it"


def table(results: dict[str, dict | str]) -> str:
    head = ("| model | linears found / in the model | attention found / modules | fp8-dynamic: linear sites converted, "
            "output SQNR | semi-sparse (MLP linears): converted, SQNR | sparse-attention-bf16: attention converted, SQNR |")
    lines = [head, "|" + "---|" * 6]
    notes = []  # "- model: sites: why", one line per reason
    for label, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {label} | skipped: {r} | | | | |")
            continue
        cells = []
        for recipe, what in zip(RECIPES, ("linear", "linear", "attention")):
            c = r["recipes"][recipe]
            gate = "gate passed" if c["passed"] else "GATE FAILED"
            cells.append(f"{c[what]} / {c['linear sites'] if what == 'linear' else r['attention sites']}, "
                         f"{c['sqnr']:.1f} dB ({gate})")
        kept: dict[str, list[str]] = {}
        for c in r["recipes"].values():
            for reason, fqn in c["kept"]:
                kept.setdefault(reason, []).append(fqn)
        notes += [f"- {label}: {sites(fqns)}: {reason}" for reason, fqns in kept.items()]
        if r["not found"]:
            notes.append(f"- {label}: {sites(r['not found'])}: no site found in it")
        lines.append(f"| {label} | {r['found linears']} / {r['linears']} | "
                     f"{r['found attention']} / {r['attention modules']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nKept, and why (sites that no rule of the recipe matched are not listed), and not found:\n"
                               + "\n".join(notes) if notes else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="also write the table to OUT/coverage_real_models.md")
    parser.add_argument("--only", nargs="*", help="rows whose label contains one of these words")
    args = parser.parse_args()
    results: dict[str, dict | str] = {}
    for row in ROWS:
        if args.only and not any(word in row.label for word in args.only):
            continue
        print(f"coverage: {row.label}", file=sys.stderr, flush=True)
        try:
            results[row.label] = measure(row, args.device)
        except (LowconvError, ImportError) as err:
            results[row.label] = str(err).splitlines()[0]
    text = table(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "coverage_real_models.md").write_text(text + "\n")
    return 0 if all(isinstance(r, str) or all(c["passed"] for c in r["recipes"].values())
                    for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
