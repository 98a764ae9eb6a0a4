#!/usr/bin/env python3
"""Whole training steps: a Llama-architecture model converted for training by each recipe, against
the same bf16 model's step eager and under torch.compile, in one process per model.

A step is what a user's loop runs: zero_grad, forward, cross-entropy over every position, backward,
AdamW (fused). The bf16 baseline is pure bf16 (weights, gradients and AdamW's states in bf16), and
so is each converted model around its converted linears (fp8's master weights are the model's bf16
weights). "compiled" compiles the forward and the loss (`torch.compile(fullgraph=True)`; the
backward is compiled through AOTAutograd); the optimizer step runs eagerly, fused. Reported per
variant: the median of interleaved rounds (each round one triton do_bench median of a whole step
per variant, the variants in a shuffled order) with the rounds' spread, the ratios to the bf16
step, the step's peak GPU memory above the model and its optimizer state, the first step's loss
and weight gradients against the bf16 model's (checked before timing), and on CUDA the host time
of a compiled step (host_probe_ms: launched while the GPU sleeps ahead of it, so the host never
waits; a step above its GPU time is host-bound, and one that reads about the sleep, ~1 s, waited
for the GPU inside: a sync, or a full launch queue).

Models (random weights, bf16, SDPA attention, vocab 32000, batch 4 x 1024 tokens):
  llama-2048  hidden 2048, 32 / 8 heads, intermediate 8192, 16 layers (issue 24's shapes)
  llama-4096  hidden 4096, 32 / 8 heads, intermediate 14336, 4 layers

Recipes (scripts/train_fp8.py TRAINING_RECIPES: every linear but lm_head, training = true;
semi-sparse on the MLP linears only):
  fp8-tensor, fp8-row   fp8 with dynamic scaling, per tensor / per row of x and W
  semi-sparse           2:4 weights with a fixed mask (pruned once), cuSPARSELt where `auto` finds
                        its layer faster alone
  semi-sparse-cusparselt, semi-sparse-transposable
                        the same on cuSPARSELt wherever it can run; transposable: dX on it too

    PYTHONPATH=. python3 scripts/bench_training.py --out DIR [--models llama-2048] [--recipes fp8-row]
    python3 scripts/bench_training.py --out DIR --device cpu --tiny --rounds 1   # plumbing only
"""
import gc
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv  # noqa: E402
from scripts.bench_common import first_line  # noqa: E402
from scripts.bench_models import (  # noqa: E402
    llama_model, median_cell, model_bench_parser, ratio, run_header, run_models, sqnr_db, time_and_profile,
)
from scripts.train_fp8 import TRAINING_RECIPES, training_recipe  # noqa: E402

MODELS = ("llama-2048", "llama-4096")
LR = 1e-5  # small: random data, and the timed steps should leave the weights near where the checks found them
# The first step against the bf16 model's: FP8's loss over 32000 classes moves by well under 1%;
# its weight gradients read 6.5 dB in the random 16-layer llama-2048 (e5m2 gradients through 16
# layers; H200), a gradient in the wrong layout or with a lost scale about 0 dB or less.
LOSS_RELATIVE = 0.02
GRAD_SQNR_DB = 3.0
HOST_PROBE_CYCLES = 2_000_000_000  # GPU sleep ahead of a probed step: about 1 s at the H200's 1.98 GHz


@dataclass
class Variant:
    name: str
    recipe: str | None
    loss: float | None = None
    compiled_loss: float | None = None
    grad_sqnr_db: float | None = None  # the first step's weight gradients against bf16's, eager
    compiled_grad_sqnr_db: float | None = None
    step_peak_bytes: int | None = None  # one compiled step's peak (step_peak)
    eager_peak_bytes: int | None = None  # one eager step's
    sites: str = ""
    eager_rounds_ms: list = field(default_factory=list)
    compiled_rounds_ms: list = field(default_factory=list)
    compiled_host_ms: list = field(default_factory=list)  # host_probe_ms samples
    error: str | None = None


def llama_config(name: str, tiny: bool):
    from transformers import LlamaConfig
    if tiny:
        return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                           num_hidden_layers=2, vocab_size=256, max_position_embeddings=256,
                           attn_implementation="sdpa")
    hidden, intermediate, layers = {"llama-2048": (2048, 8192, 16), "llama-4096": (4096, 14336, 4)}[name]
    return LlamaConfig(hidden_size=hidden, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=intermediate, num_hidden_layers=layers, vocab_size=32000,
                       max_position_embeddings=2048, attn_implementation="sdpa")


class Trainer:
    """One variant's model, its AdamW, and its step (eager or compiled forward + loss)."""

    def __init__(self, model, ids, fused: bool):
        self.model = model.train()
        self.ids = ids
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
        self.compiled_loss = torch.compile(self.loss, fullgraph=True)

    def loss(self, ids):
        logits = self.model(input_ids=ids[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())

    def step(self, compiled: bool) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = (self.compiled_loss if compiled else self.loss)(self.ids)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def first_gradients(self, compiled: bool):
        """The loss and weight gradients of one forward and backward (no optimizer step)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = (self.compiled_loss if compiled else self.loss)(self.ids)
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), grads


def gradient_sqnr(reference: dict, grads: dict) -> float:
    """SQNR of the weight gradients the converted model has by the original's names (those of
    the converted linears keep their name: `<linear>.weight`), all of them as one vector."""
    common = [name for name in reference if name in grads and grads[name].shape == reference[name].shape]
    if not common:
        raise AssertionError("no weight gradient to compare")
    return sqnr_db(torch.cat([reference[n].flatten().float() for n in common]),
                   torch.cat([grads[n].flatten().float() for n in common]))


def step_peak(trainer: Trainer, compiled: bool, device) -> int | None:
    """A step's peak GPU memory above the model and its optimizer state (made by a step before),
    with no gradients held: the activations, the gradients and the step's temporaries."""
    if device.type != "cuda":
        return None
    trainer.step(compiled)
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.step(compiled)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def host_probe_ms(trainer: Trainer, samples: int = 3) -> list[float]:
    """Host ms to launch one compiled step while the GPU sleeps ahead of it: the step's host cost
    alone (module doc)."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOST_PROBE_CYCLES)
        start = time.perf_counter()
        trainer.step(True)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def bench_model(name: str, args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = llama_config(name, args.tiny)
    batch, tokens = (2, 32) if args.tiny else (4, 1024)
    ids = torch.randint(config.vocab_size, (batch, tokens + 1), device=device)
    original = llama_model(config, device)
    fused = device.type == "cuda"
    variants = [Variant("bf16", None)]
    trainers = {}
    for recipe in args.recipes:
        variant = Variant(recipe, recipe)
        variants.append(variant)
        try:
            converted = lowconv.convert(original, training_recipe(recipe), example_inputs={"input_ids": ids[:, :-1]})
            plan = converted.lowconv_plan
            variant.sites = f"{len(plan.converted())}/{len(plan.decisions)}"
            trainers[recipe] = Trainer(converted, ids, fused)
        except Exception as error:  # noqa: BLE001 - a recipe that fails is a row of the table
            variant.error = f"convert: {first_line(error)}"
            del error
            gc.collect()
        print(f"[{name}] converted {recipe}: {variant.error or variant.sites}", flush=True)
    trainers["bf16"] = Trainer(original, ids, fused)
    reference_loss, reference_grads = trainers["bf16"].first_gradients(compiled=False)
    calls, profiled = [], {}
    for variant in variants:
        trainer = trainers.get(variant.name)
        if trainer is None:
            continue
        try:
            check_first_step(variant, trainer, reference_loss, reference_grads)
            variant.eager_peak_bytes = step_peak(trainer, False, device)
            variant.step_peak_bytes = step_peak(trainer, True, device)
            calls.append((variant.eager_rounds_ms, lambda t=trainer: t.step(False)))
            calls.append((variant.compiled_rounds_ms, lambda t=trainer: t.step(True)))
            profiled[variant.name] = lambda t=trainer: t.step(True)
        except Exception as error:  # noqa: BLE001
            variant.error = f"{variant.error + '; ' if variant.error else ''}{first_line(error)}"
        print(f"[{name}] {variant.name}: loss {variant.loss} / compiled {variant.compiled_loss}, grads "
              f"{variant.grad_sqnr_db} / {variant.compiled_grad_sqnr_db} dB, {variant.error or 'ok'}", flush=True)
    time_and_profile(calls, profiled, name, args, device)
    if device.type == "cuda":
        for variant in variants:
            if variant.name in profiled:
                variant.compiled_host_ms = host_probe_ms(trainers[variant.name])
    return {"model": name, **run_header(args, device), "variants": [asdict(v) for v in variants]}


def check_first_step(variant: Variant, trainer: Trainer, reference_loss: float, reference_grads: dict):
    """The first step's loss and gradients, eager and compiled, near the bf16 model's eager ones."""
    variant.loss, grads = trainer.first_gradients(compiled=False)
    variant.grad_sqnr_db = gradient_sqnr(reference_grads, grads)
    variant.compiled_loss, grads = trainer.first_gradients(compiled=True)
    variant.compiled_grad_sqnr_db = gradient_sqnr(reference_grads, grads)
    for loss in (variant.loss, variant.compiled_loss):
        if not abs(loss - reference_loss) <= LOSS_RELATIVE * abs(reference_loss):
            raise AssertionError(f"first loss {loss:.4f} against bf16's {reference_loss:.4f}")
    if variant.recipe and variant.recipe.startswith("fp8"):  # 2:4 pruning changes the gradients by design
        for db in (variant.grad_sqnr_db, variant.compiled_grad_sqnr_db):
            if not db >= GRAD_SQNR_DB:
                raise AssertionError(f"weight gradients {db:.1f} dB from bf16's (bar {GRAD_SQNR_DB} dB)")


def table(data: dict) -> str:
    variants = data["variants"]
    eager, compiled = variants[0]["eager_rounds_ms"], variants[0]["compiled_rounds_ms"]
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"  # noqa: E731
    num = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    rows = [[v["name"], median_cell(v["eager_rounds_ms"]), median_cell(v["compiled_rounds_ms"]),
             ratio(eager, v["eager_rounds_ms"]), ratio(compiled, v["compiled_rounds_ms"]),
             median_cell(v["compiled_host_ms"]), gb(v["eager_peak_bytes"]), gb(v["step_peak_bytes"]),
             num(v["loss"], ".4f"), num(v["compiled_loss"], ".4f"), num(v["grad_sqnr_db"], ".1f"),
             num(v["compiled_grad_sqnr_db"], ".1f"), v["sites"], v["error"] or ""]
            for v in variants]
    headers = ["variant", "eager step ms (spread)", "compiled step ms (spread)", "eager vs bf16 eager",
               "compiled vs bf16 compiled", "compiled host ms", "eager peak GB", "compiled peak GB", "first loss",
               "compiled first loss", "grads dB", "compiled grads dB", "sites converted", "notes"]
    return (f"### {data['model']}\n\n{data['device']}, torch {data['torch']}, {data['date']}, "
            f"{data['rounds']} interleaved rounds ({data['do_bench']})\n\n"
            + tabulate(rows, headers, tablefmt="github") + "\n")


def main():
    parser = model_bench_parser(__doc__, MODELS, TRAINING_RECIPES, f"comma-separated: {', '.join(TRAINING_RECIPES)}",
                                rounds=3, warmup_ms=100, rep_ms=500, profiled="step")
    args = parser.parse_args()
    args.recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in args.recipes if r not in TRAINING_RECIPES]
    if unknown:
        sys.exit(f"bench_training: unknown recipe {unknown[0]!r} (choices: {', '.join(TRAINING_RECIPES)})")
    args.profile = [v for v in args.profile.split(",") if v]
    run_models(args, "bench_training", __file__, MODELS, bench_model, table)


if __name__ == "__main__":
    main()
