#!/usr/bin/env python3
"""Does converted training keep up? A small GPT (examples/gpt.py) trained from the same initial
weights on the same batches, once with its linears as they are (the baseline, under bf16 autocast
on CUDA, fp32 on the CPU) and once per training recipe (LOSS_RECIPES by default: lowconv's `fp8` op with
training = true, e4m3 weights and activations forward, e5m2 gradients backward, master weights in
the model's dtype; `semi_sparse` training with a fixed 2:4 mask on the MLP linears; the rest of the
model as the baseline). The language (--corpus) is synthetic and has a known floor: tokens from a
random order-2 Markov chain whose next token is one of a few likely ones, so the loss can fall a
long way below log(vocab) and the runs can be told apart; or real English text that ships with
Python (`--corpus text`: the reference documentation's help() topics, pydoc_data.topics, 465 kB,
its bytes as tokens, the last tenth held out). Reports the loss curves (a table, and a png where
matplotlib is installed), the held-out loss at the end and each run's relative difference from the
baseline (the target for FP8: within 1%; 2:4 pruning removes half of each MLP weight and is not
held to it).

    python3 scripts/train_fp8.py --out DIR [--steps 1500] [--recipes fp8-tensor,fp8-row] [--scaling dynamic|delayed]
    python3 scripts/train_fp8.py --out DIR --device cpu --small    # a smaller model, minutes on a CPU
    python3 scripts/train_fp8.py --out DIR --device cpu --small --corpus text --steps 600 [--seed 1]
    python3 scripts/train_fp8.py --out DIR --device cpu --tiny     # plumbing only
"""
import argparse
import copy
import datetime
import json
import math
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ is not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from lowconv.recipe import parse_recipe  # noqa: E402

TARGET_RELATIVE_LOSS = 0.01  # FP8 runs: held-out loss within 1% of the baseline's
EVAL_BATCHES = 20


@dataclass
class Config:
    vocab: int
    context: int
    dim: int
    depth: int
    heads: int
    batch: int
    lr: float


# 16 tokens, 256 order-2 contexts (with 256 tokens, 65,536 contexts to memorize, neither run left the
# uniform loss in 500 steps: nothing to compare). The loss plateaus until the model learns to attend to
# the two previous tokens, then drops to the floor; when that happens varies between runs by hundreds
# of steps (H100: step ~400 for one run, ~650 for the other), so the runs are compared after both
# have dropped (1,500 steps) and the curves are shown every 100 steps.
FULL = Config(vocab=16, context=128, dim=256, depth=4, heads=8, batch=32, lr=2e-3)
# A model the CPU trains in minutes (the FP8 reference numerics: FULL's fp8 step takes about 1 s there)
SMALL = Config(vocab=16, context=128, dim=128, depth=2, heads=4, batch=32, lr=2e-3)
TINY = Config(vocab=64, context=32, dim=64, depth=1, heads=4, batch=8, lr=3e-3)


class MarkovLanguage:
    """Order-2 Markov chain over `vocab` tokens: after (a, b), one of `choices` next tokens, drawn
    with fixed random probabilities. Its entropy per token is the loss floor."""

    def __init__(self, vocab: int, choices: int = 4, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.next_tokens = torch.randint(0, vocab, (vocab, vocab, choices), generator=gen)
        # Dirichlet draws from the global generator: seeded here, so that every run and every rank
        # of a distributed one has the same language
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.probs = torch.distributions.Dirichlet(torch.ones(choices)).sample((vocab, vocab))

    def floor(self) -> float:
        """Mean entropy (nats) of the next token over uniformly drawn contexts: about the floor."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def learned_below(self) -> float:
        """The held-out loss under which a model learned: halfway from the uniform loss to the floor."""
        return (self.floor() + math.log(self.vocab)) / 2

    def description(self) -> str:
        return (f"order-2 Markov chain, 4 next tokens per context; entropy floor ~{self.floor():.3f} nats, "
                f"uniform {math.log(self.vocab):.3f}")

    def batch(self, batch: int, length: int, gen: torch.Generator, held_out: bool = False) -> torch.Tensor:
        """`held_out` batches are new draws of the same chain."""
        tokens = torch.empty(batch, length + 1, dtype=torch.long)
        tokens[:, :2] = torch.randint(0, self.vocab, (batch, 2), generator=gen)
        for t in range(2, length + 1):
            a, b = tokens[:, t - 2], tokens[:, t - 1]
            pick = torch.multinomial(self.probs[a, b], 1, generator=gen).squeeze(1)
            tokens[:, t] = self.next_tokens[a, b, pick]
        return tokens


class PythonDocs:
    """Real text: the help() topics of Python's reference documentation (pydoc_data.topics, shipped
    with Python), each distinct byte a token; batches are random windows of the first nine tenths,
    held-out batches of the last tenth."""

    def __init__(self):
        import pydoc_data.topics
        data = "".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)).encode()
        symbols = sorted(set(data))
        self.vocab = len(symbols)
        index = torch.zeros(256, dtype=torch.long)
        index[symbols] = torch.arange(self.vocab)
        tokens = index[torch.tensor(list(data))]
        split = len(tokens) * 9 // 10
        self.train_tokens, self.held_out_tokens = tokens[:split], tokens[split:]

    def floor(self) -> float | None:
        return None  # unknown

    def learned_below(self) -> float:
        """The held-out loss under which a model uses context: the text's unigram entropy (nats)."""
        counts = torch.bincount(self.train_tokens, minlength=self.vocab).float()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    def description(self) -> str:
        return (f"Python's help() topics (pydoc_data.topics), {self.vocab} distinct bytes as tokens, "
                f"{len(self.train_tokens)} for training, {len(self.held_out_tokens)} held out; unigram "
                f"entropy {self.learned_below():.3f} nats")

    def batch(self, batch: int, length: int, gen: torch.Generator, held_out: bool = False) -> torch.Tensor:
        tokens = self.held_out_tokens if held_out else self.train_tokens
        starts = torch.randint(0, len(tokens) - length - 1, (batch,), generator=gen)
        return torch.stack([tokens[start:start + length + 1] for start in starts.tolist()])


def init_weights(model):
    """GPT-2's initialization (normal, std 0.02; zero biases): the example's defaults give a tied
    head huge initial logits."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)


# The training scripts' recipes: (the linears they convert, the rule); lm_head is kept (the GPT ties
# it to its embedding). {scaling}: the fp8 rules' scaling; {all_gather}: their fp8_all_gather option, or nothing.
TRAINING_RECIPES = {
    "fp8-tensor": ("re:.*", 'op = "fp8"\noptions = {{ training = true, granularity = "tensor", '
                            'scaling = "{scaling}"{all_gather} }}'),
    "fp8-row": ("re:.*", 'op = "fp8"\noptions = {{ training = true, granularity = "row", scaling = "{scaling}"'
                         '{all_gather} }}'),
    "semi-sparse": ("re:.*mlp\\..*", 'op = "semi_sparse"\noptions = {{ training = true, target = "weight", '
                                      'mask = "fixed" }}'),
    # the same on cuSPARSELt's 2:4 GEMMs wherever it can run (a step's speed, not `auto`'s layer alone);
    # transposable: dX through the 2:4 GEMM of W^T too
    "semi-sparse-cusparselt": ("re:.*mlp\\..*", 'op = "semi_sparse"\noptions = {{ training = true, '
                                                 'target = "weight", mask = "fixed", backend = "cusparselt" }}'),
    "semi-sparse-transposable": ("re:.*mlp\\..*", 'op = "semi_sparse"\noptions = {{ training = true, '
                                                   'target = "weight", mask = "fixed", backend = "cusparselt", '
                                                   'transposable = true }}'),
}
# What train_fp8 trains by default: the backends compute the same products
LOSS_RECIPES = ("fp8-tensor", "fp8-row", "semi-sparse")


def training_recipe(name: str, scaling: str = "dynamic", fp8_all_gather: bool = False):
    """TRAINING_RECIPES[name] as a recipe: its rule on its linears, every other linear and lm_head kept;
    `fp8_all_gather`: the fp8 rules' option (FSDP2 all-gathers their weights in e4m3)."""
    modules, rule = TRAINING_RECIPES[name]
    all_gather = ", fp8_all_gather = true" if fp8_all_gather else ""
    return parse_recipe(f"name = \"{name}-training\"\n[[rules]]\nkind = \"linear\"\nmodules = [\"lm_head\"]\n"
                        f"op = \"keep\"\n[[rules]]\nkind = \"linear\"\nmodules = ['{modules}']\n"
                        f"{rule.format(scaling=scaling, all_gather=all_gather)}\n", "scripts/train_fp8.py")


def loss_of(model, tokens, device, autocast):
    tokens = tokens.to(device)
    with autocast():
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model, batches, eval_batches, cfg, device, autocast, log):
    """Loss per step, held-out loss at the end, and the median step time (ms)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses, times = [], []
    model.train()
    for step, tokens in enumerate(batches):
        start = time.perf_counter()
        loss = loss_of(model, tokens, device, autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # syncs: the step time includes the whole step
        times.append((time.perf_counter() - start) * 1e3)
        if step % 50 == 0:
            log(f"step {step}: loss {losses[-1]:.4f}")
    model.eval()
    with torch.no_grad():
        held_out = statistics.mean(loss_of(model, t, device, autocast).item() for t in eval_batches)
    return losses, held_out, statistics.median(times)


def plot(runs: dict, path: Path, floor: float | None, title: str) -> bool:
    """Each run's training loss (a 50-step running mean) against the step, to a png; False where
    matplotlib is not installed (lowconv does not need it)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (losses, _, _) in runs.items():
        window = min(50, len(losses))
        smooth = [statistics.mean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=name, linewidth=1.2)
    if floor is not None:
        ax.axhline(floor, color="grey", linestyle=":", label="entropy floor")
    ax.set(xlabel="step", ylabel="training loss (50-step mean)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def verdict(name: str, relative: float, learned: bool) -> str:
    if not learned:
        return "inconclusive: the baseline did not learn (held-out loss not under the corpus's threshold)"
    if not name.startswith("fp8"):
        return "not held to the target (2:4 pruning changes the model)"
    return "met" if abs(relative) <= TARGET_RELATIVE_LOSS else "NOT met"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--recipes", default=",".join(LOSS_RECIPES),
                        help=f"comma-separated: {', '.join(TRAINING_RECIPES)}")
    parser.add_argument("--scaling", choices=("dynamic", "delayed"), default="dynamic", help="the fp8 recipes' scaling")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' draws (the "
                        "language stays the same)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help=f"dim {SMALL.dim}, depth {SMALL.depth}: a CPU run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 20 steps (plumbing)")
    parser.add_argument("--corpus", choices=("markov", "text"), default="markov",
                        help="a synthetic Markov language with a known floor, or Python's documentation")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    for recipe in recipes:
        if recipe not in TRAINING_RECIPES:
            sys.exit(f"train_fp8: unknown recipe {recipe!r} (choices: {', '.join(TRAINING_RECIPES)})")
    cfg, steps = (TINY, min(args.steps, 20)) if args.tiny else (SMALL if args.small else FULL, args.steps)
    device = torch.device(args.device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext

    def log(text):
        print(text, file=sys.stderr, flush=True)

    if args.corpus == "text":
        language = PythonDocs()
        cfg = replace(cfg, vocab=language.vocab)
    else:
        language = MarkovLanguage(cfg.vocab)
    gen = torch.Generator().manual_seed(1 + args.seed)
    batches = [language.batch(cfg.batch, cfg.context, gen) for _ in range(steps)]
    eval_batches = [language.batch(cfg.batch, cfg.context, gen, held_out=True) for _ in range(EVAL_BATCHES)]

    torch.manual_seed(args.seed)
    baseline = GPT(cfg.vocab, cfg.context, cfg.dim, cfg.depth, cfg.heads).to(device)
    init_weights(baseline)
    models = {"baseline": baseline}
    for recipe in recipes:
        models[recipe] = lowconv.convert(copy.deepcopy(baseline), training_recipe(recipe, args.scaling),
                                         (batches[0][:, :-1].to(device),))
    runs = {}
    for name, model in models.items():
        log(f"training {name}")
        runs[name] = train(model, batches, eval_batches, cfg, device, autocast, log)

    base_eval = runs["baseline"][1]
    relative = {name: (held_out - base_eval) / base_eval for name, (_, held_out, _) in runs.items()}
    learned = base_eval < language.learned_below()  # a comparison means something only if the baseline learned
    tail = max(1, steps // 10)
    rows = [[name, f"{statistics.mean(losses[-tail:]):.4f}", f"{held_out:.4f}", f"{relative[name]:+.2%}",
             "-" if name == "baseline" else verdict(name, relative[name], learned), f"{ms:.1f}"]
            for name, (losses, held_out, ms) in runs.items()]
    baseline_name = "bf16 autocast" if device.type == "cuda" else "fp32"
    args.out.mkdir(parents=True, exist_ok=True)
    plotted = plot(runs, args.out / "train_fp8.png", language.floor(),
                   f"GPT dim {cfg.dim}, depth {cfg.depth}, {steps} steps ({baseline_name} baseline, {device.type})")
    lines = [
        "# Converted training of a small GPT vs the same model unconverted", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
        f"- torch: {torch.__version__}",
        f"- command: python3 {' '.join(shlex.quote(a) for a in sys.argv)}",
        f"- model: GPT vocab {cfg.vocab}, context {cfg.context}, dim {cfg.dim}, depth {cfg.depth}, "
        f"heads {cfg.heads}; AdamW lr {cfg.lr}; batch {cfg.batch}; {steps} steps (the tied head is kept)",
        f"- baseline: {baseline_name}; recipes: {', '.join(recipes)} (fp8 scaling = {args.scaling})",
        f"- data: {language.description()}",
        f"- plot: {'train_fp8.png' if plotted else 'none (matplotlib is not installed)'}", "",
        tabulate(rows, headers=["run", f"train loss (last {tail} steps)", f"held-out loss ({EVAL_BATCHES} batches)",
                                "vs baseline", f"target (fp8: within {TARGET_RELATIVE_LOSS:.0%})", "median step ms"],
                 tablefmt="github"), "",
        "Training loss, mean over each 100 steps:", "",
        tabulate([[f"{start}-{min(start + 100, steps) - 1}",
                   *(f"{statistics.mean(run[0][start:start + 100]):.4f}" for run in runs.values())]
                  for start in range(0, steps, 100)], headers=["steps", *runs], tablefmt="github"), "",
    ]
    (args.out / "train_fp8.md").write_text("\n".join(lines))
    (args.out / "train_fp8.json").write_text(json.dumps(
        {"config": vars(cfg), "steps": steps, "scaling": args.scaling, "corpus": args.corpus, "device": str(device),
         "losses": {name: run[0] for name, run in runs.items()},
         "held_out": {name: run[1] for name, run in runs.items()}, "relative": relative,
         "baseline_learned": learned}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
