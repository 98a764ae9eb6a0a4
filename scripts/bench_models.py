#!/usr/bin/env python3
"""The scoreboard: whole models, converted by each built-in recipe, against the same bf16 model
eager and under torch.compile, in one process per model.

Per model, every variant (the bf16 original and each recipe's conversion of the same random
weights) runs eagerly and compiled. Reported per variant: the median time of interleaved rounds
(each round one triton do_bench median per variant, the variants in a shuffled order) with the
rounds' spread, the ratio to bf16 eager and to bf16 compiled, the bytes of its weights, the
conversion's time, its peak GPU memory above the original model and what it left allocated when
convert returned (beyond the converted model itself, with no gc.collect), the output's SQNR against
the bf16 original's eager output (the compiled model must agree with the same model eager, to
COMPILED_AGREES_DB, or be as close to the original as it, before it is timed), and the compiled graph's
breaks (fullgraph=True is tried first; where it fails the model is compiled with breaks and the
count is given).

Models (random weights, bf16, eval):
  llama-prefill  LlamaForCausalLM from a config at 8B-class width (hidden 4096, 32 / 8 heads,
                 intermediate 14336, 8 layers, vocab 32000), SDPA attention, prefill 8 x 2048
                 tokens, all logits; converted on the same inputs
  llama-decode   the same model, one new token for each of 64 sequences against a static KV cache
                 of 2048 tokens (filled once by the bf16 model); converted on that step (its
                 tokens and cache); compiled with mode="reduce-overhead" (CUDA graphs), as decoding
                 is launch-bound
  vit_b_16       torchvision vit_b_16, batch 64 at 224 x 224
  vit_l_16       torchvision vit_l_16, batch 64
  gpt-16k        examples/gpt.py's causal LM (SDPA, is_causal) at 16384 tokens: dim 512, 8 heads,
                 4 layers (gpt-16k-d256: dim 256, 4 heads, where the causal attention does 5.3
                 times the linears' work instead of 2.7); with the recipe local-256 (attention on a
                 causal window of 256 keys, a change of the model's semantics on purpose), not
                 built in, defined here
The bench's own recipes fp8-row-attention and fp8-semi-sparse-attention are those built-in recipes
with the attention on lowconv's op in the model's dtype too (its exact semantics): what FP8 (and
2:4) weights add where the attention was the bottleneck. The variant torch-fp8-row is no recipe but
the peer issue 22 measured: a torch-native FP8 linear (scripts/torch_fp8_peer.py) in every linear
but lm_head, as fp8-row converts them.

    PYTHONPATH=. python3 scripts/bench_models.py --out DIR [--models llama-prefill,vit_b_16]
        [--recipes fp8-row,fp8-dynamic] [--rounds 5]
    python3 scripts/bench_models.py --out DIR --device cpu --tiny --rounds 1   # plumbing only

Each model runs in a child process (its compiled graphs and memory do not reach the next);
DIR/bench_models.md gets every model's table, DIR/bench_models-<model>.json its data.
"""
import argparse
import datetime
import gc
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv  # noqa: E402
from lowconv.recipe import builtin_recipes, parse_recipe  # noqa: E402
from scripts.bench_common import first_line, kernel_table  # noqa: E402
from scripts.torch_fp8_peer import torch_fp8_row  # noqa: E402

MODELS = ("llama-prefill", "llama-decode", "vit_b_16", "vit_l_16", "gpt-16k", "gpt-16k-d256")
# fp16acc converts fp16 models only; keep-all converts nothing.
RECIPES = ("fp8-row", "fp8-dynamic", "fp8-static", "semi-sparse", "fp8-semi-sparse", "sparse-attention-bf16", "mixed")
BF16 = torch.bfloat16
# The compiled model against its own eager output: bf16 Llama compiled reads 29 dB against eager
# (a chaotic random network; reordered sums), ViT 37 dB; a wrong compiled op reads near 0.
COMPILED_AGREES_DB = 15.0
# Or it is as close to the original as the eager converted model is: two FP8 roundings of one value
# (inductor's fused quantization, the eager kernel's) that differ by one step grow apart in a random
# 8-layer Llama (fp8-row: each 8.9 dB from the original, 12.2 dB from each other, H200).
SQNR_SLACK_DB = 1.0


@dataclass
class Case:
    """A model to time: `run(model)` is one timed call and returns the output compared."""
    model: torch.nn.Module
    convert_inputs: object  # what convert traces and calibrates with
    run: object
    compile_mode: str | None = None
    rewind: object = None  # puts the state convert_inputs hold (a KV cache) back as each call finds it


@dataclass
class Variant:
    name: str
    recipe: str | None
    weight_bytes: int = 0
    convert_s: float | None = None
    convert_peak_bytes: int | None = None
    held_after_bytes: int | None = None
    forward_peak_bytes: int | None = None  # the original's: one eager call's GPU memory above the model and inputs
    sqnr_db: float | None = None
    compiled_sqnr_db: float | None = None
    graph_breaks: int | None = None
    sites: str = ""  # converted / found, and how many were kept as measured slower
    compile_s: float | None = None
    eager_rounds_ms: list = field(default_factory=list)
    compiled_rounds_ms: list = field(default_factory=list)
    error: str | None = None


def llama_config(tiny: bool):
    from transformers import LlamaConfig
    if tiny:
        return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                           num_hidden_layers=2, vocab_size=256, max_position_embeddings=256,
                           attn_implementation="sdpa")
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                       num_hidden_layers=8, vocab_size=32000, max_position_embeddings=4096,
                       attn_implementation="sdpa")


def llama_model(config, device):
    from transformers import LlamaForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def llama_prefill(device, tiny):
    config = llama_config(tiny)
    batch, tokens = (2, 32) if tiny else (8, 2048)
    ids = torch.randint(config.vocab_size, (batch, tokens), device=device)
    # As a user's call runs it: transformers' default use_cache fills a new DynamicCache each call
    return Case(llama_model(config, device), {"input_ids": ids}, lambda m: m(input_ids=ids).logits)


def llama_decode(device, tiny):
    from transformers import StaticCache
    config = llama_config(tiny)
    batch, context = (4, 32) if tiny else (64, 2048)
    model = llama_model(config, device)
    cache = StaticCache(config=config, max_cache_len=context + 1)
    with torch.no_grad():  # the cache's 2048 tokens, written once; every timed call rewrites slot 2048 only
        model(input_ids=torch.randint(config.vocab_size, (batch, context), device=device), past_key_values=cache,
              cache_position=torch.arange(context, device=device), logits_to_keep=1)
    new = torch.randint(config.vocab_size, (batch, 1), device=device)
    position = torch.tensor([context], device=device)

    def rewind():
        for layer in cache.layers:  # the cache counts the tokens it took: back to `context` for each step
            layer.cumulative_length.fill_(context)

    def step(m):
        rewind()
        return m(input_ids=new, past_key_values=cache, cache_position=position).logits
    return Case(model, {"input_ids": new, "past_key_values": cache, "cache_position": position}, step,
                compile_mode="reduce-overhead", rewind=rewind)


def vit(name):
    def build(device, tiny):
        import torchvision
        kwargs = dict(image_size=32, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128) if tiny else {}
        model = (torchvision.models.VisionTransformer(patch_size=16, **kwargs) if tiny
                 else getattr(torchvision.models, name)())
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision zeroes it: outputs all 0
        model = model.to(device, BF16).eval()
        images = torch.randn(2 if tiny else 64, 3, *(2 * [32 if tiny else 224]), device=device, dtype=BF16)
        return Case(model, (images,), lambda m: m(images))
    return build


def gpt_16k(dim: int, heads: int):
    """examples/gpt.py at 16384 tokens, 4 layers, head_dim 64."""
    def build(device, tiny):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        from gpt import GPT
        tokens = 256 if tiny else 16384
        model = GPT(vocab=512, context=tokens, dim=64 if tiny else dim, depth=2 if tiny else 4,
                    heads=4 if tiny else heads)
        model = model.to(device, BF16).eval()
        ids = torch.randint(512, (1, tokens), device=device)
        return Case(model, (ids,), lambda m: m(ids))
    return build


BUILDERS = {"llama-prefill": llama_prefill, "llama-decode": llama_decode, "vit_b_16": vit("vit_b_16"),
            "vit_l_16": vit("vit_l_16"), "gpt-16k": gpt_16k(512, 8), "gpt-16k-d256": gpt_16k(256, 4)}
ATTENTION_RULE = """
[[rules]]
kind = "attention"
op = "sparse_attention"
"""


def with_attention(recipe: str) -> str:
    """A built-in recipe's text, renamed "<recipe>-attention", with the attention on lowconv's op in
    the model's dtype too (its rules come after the recipe's: they match attention sites only)."""
    text = builtin_recipes()[recipe].read_text()
    name = f'name = "{recipe}"'
    if name not in text:
        raise ValueError(f"built-in recipe {recipe} has no line {name}: the bench cannot rename it")
    return text.replace(name, f'name = "{recipe}-attention"', 1) + ATTENTION_RULE


# Recipes the bench defines itself (the rest are lowconv's built-in ones, by name)
BENCH_RECIPES = {"local-256": """name = "local-256"
[[rules]]
kind = "attention"
op = "sparse_attention"
options = { dtype = "bfloat16", layout = "local", window = 256 }
""", **{f"{recipe}-attention": with_attention(recipe) for recipe in ("fp8-row", "fp8-semi-sparse")}}


# Variants that are not lowconv's: what a user could write instead, made from the bf16 model
PEERS = {"torch-fp8-row": torch_fp8_row}


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    noise = (out - ref).pow(2).sum(dtype=torch.float64).item()
    signal = ref.pow(2).sum(dtype=torch.float64).item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise) if math.isfinite(noise) else -math.inf


def allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def convert(case: Case, recipe: str, variant: Variant, device):
    """The converted model, with the conversion's time and GPU memory filled into `variant`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = allocated(device)
    start = time.perf_counter()
    spec = parse_recipe(BENCH_RECIPES[recipe], recipe) if recipe in BENCH_RECIPES else recipe
    if case.rewind:
        case.rewind()
    converted = lowconv.convert(case.model, spec, example_inputs=case.convert_inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
        variant.convert_peak_bytes = torch.cuda.max_memory_allocated() - base
    variant.convert_s = time.perf_counter() - start
    plan = converted.lowconv_plan
    slower = sum(", but kept: " in d.reason for d in plan.decisions)
    variant.sites = f"{len(plan.converted())}/{len(plan.decisions)}" + (f" ({slower} kept: slower)" if slower else "")
    for decision in plan.decisions:
        print(f"  {recipe} {decision.fqn}: {decision.op}; {decision.reason}; {decision.note}")
    variant.weight_bytes = weight_bytes(converted)
    variant.held_after_bytes = allocated(device) - base - variant.weight_bytes
    return converted


def compiled_call(case: Case, model, variant: Variant):
    """A compiled call of `model`: fullgraph=True, else (with the graph breaks counted) without."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.config.cache_size_limit = 64  # one entry per variant of the same model class
    for fullgraph in (True, False):
        counters.clear()
        compiled = torch.compile(model, fullgraph=fullgraph, mode=case.compile_mode)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                case.run(compiled)
                out = case.run(compiled).clone()  # reduce-overhead records on the second call
        except Exception as error:  # noqa: BLE001 - a graph break under fullgraph: retry with breaks
            if not fullgraph:
                raise
            variant.error = f"fullgraph: {first_line(error)}"
            continue
        variant.compile_s = time.perf_counter() - start
        variant.graph_breaks = sum(counters["graph_break"].values())
        return compiled, out
    raise AssertionError("unreachable")


def timed(case: Case, model):
    def call():
        with torch.no_grad():
            return case.run(model)
    return call


def measure_round(calls, device, args, round_index):
    """One round: each (rounds list, call) timed once, in a shuffled order (seeded by the round)."""
    import triton.testing
    for target, call in random.Random(round_index).sample(calls, len(calls)):
        if device.type == "cuda":
            target.append(triton.testing.do_bench(call, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
        else:
            start = time.perf_counter()
            call()
            target.append((time.perf_counter() - start) * 1e3)


def bench_model(name: str, args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    case = BUILDERS[name](device, args.tiny)
    original = Variant("bf16", None, weight_bytes=weight_bytes(case.model))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = allocated(device)
    with torch.no_grad():
        reference = case.run(case.model).clone()
    if device.type == "cuda":
        original.forward_peak_bytes = torch.cuda.max_memory_allocated() - base
    variants, calls, profiled = [original], [], {}
    models = {"bf16": case.model}
    for recipe in args.recipes:
        variant = Variant(recipe, recipe)
        variants.append(variant)
        try:
            if recipe in PEERS:
                models[recipe] = PEERS[recipe](case.model)
                variant.weight_bytes = weight_bytes(models[recipe])
            else:
                models[recipe] = convert(case, recipe, variant, device)
        except Exception as error:  # noqa: BLE001 - a recipe that fails is a row of the table
            variant.error = f"convert: {first_line(error)}"
            del error  # its traceback holds the conversion's tensors
            gc.collect()
        made = "made" if variant.convert_s is None else f"converted in {variant.convert_s:.1f} s"
        print(f"[{name}] {recipe}: {variant.error or made}", flush=True)
    for variant in variants:
        model = models.get(variant.name)
        if model is None:
            continue
        try:
            with torch.no_grad():
                eager = case.run(model).clone()
            variant.sqnr_db = sqnr_db(reference, eager)
            calls.append((variant.eager_rounds_ms, timed(case, model)))
            compiled, out = compiled_call(case, model, variant)
            variant.compiled_sqnr_db = sqnr_db(reference, out)
            agreement = sqnr_db(eager, out)
            if agreement < COMPILED_AGREES_DB and variant.compiled_sqnr_db < variant.sqnr_db - SQNR_SLACK_DB:
                raise AssertionError(f"compiled output is {agreement:.1f} dB from the eager converted model's")
            calls.append((variant.compiled_rounds_ms, timed(case, compiled)))
            profiled[variant.name] = timed(case, compiled)
        except Exception as error:  # noqa: BLE001
            variant.error = f"{variant.error + '; ' if variant.error else ''}{first_line(error)}"
        print(f"[{name}] {variant.name}: sqnr {variant.sqnr_db} / compiled {variant.compiled_sqnr_db}, "
              f"breaks {variant.graph_breaks}, compile {variant.compile_s}, {variant.error or 'ok'}", flush=True)
    time_and_profile(calls, profiled, name, args, device)
    return {"model": name, **run_header(args, device), "variants": [asdict(v) for v in variants]}


def time_and_profile(calls, profiled: dict, model: str, args, device):
    """args.rounds interleaved rounds of `calls` (measure_round), then the GPU kernels of each
    call in `profiled` (variant -> call) that --profile names, to DIR/profile-MODEL-VARIANT.txt."""
    for round_index in range(args.rounds):
        measure_round(calls, device, args, round_index)
    for variant in args.profile:
        if variant in profiled and device.type == "cuda":
            (Path(args.out) / f"profile-{model}-{variant}.txt").write_text(kernel_table(profiled[variant]))


def run_header(args, device) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "command": "python3 " + " ".join(map(shlex.quote, sys.argv)),
            "rounds": args.rounds, "do_bench": f"warmup {args.warmup_ms:g} ms, rep {args.rep_ms:g} ms"}


def median_cell(rounds_ms: list) -> str:
    if not rounds_ms:
        return "-"
    return f"{statistics.median(rounds_ms):.2f} ({min(rounds_ms):.2f}-{max(rounds_ms):.2f})"


def ratio(base: list, rounds_ms: list) -> str:
    if not base or not rounds_ms:
        return "-"
    return f"{statistics.median(base) / statistics.median(rounds_ms):.2f}x"


def table(data: dict) -> str:
    variants = data["variants"]
    bf16 = variants[0]
    eager, compiled = bf16["eager_rounds_ms"], bf16["compiled_rounds_ms"]
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"  # noqa: E731
    db = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    rows = [[v["name"], median_cell(v["eager_rounds_ms"]), median_cell(v["compiled_rounds_ms"]),
             ratio(eager, v["eager_rounds_ms"]), ratio(eager, v["compiled_rounds_ms"]),
             ratio(compiled, v["compiled_rounds_ms"]), gb(v["weight_bytes"]),
             "-" if v["convert_s"] is None else f"{v['convert_s']:.1f}", gb(v["convert_peak_bytes"]),
             gb(v["held_after_bytes"]), db(v["sqnr_db"]), db(v["compiled_sqnr_db"]),
             "-" if v["graph_breaks"] is None else v["graph_breaks"], v["sites"], v["error"] or ""]
            for v in variants]
    headers = ["variant", "eager ms (spread)", "compiled ms (spread)", "eager vs bf16 eager",
               "compiled vs bf16 eager", "compiled vs bf16 compiled", "weights GB", "convert s",
               "convert peak GB", "held after GB", "SQNR dB", "compiled SQNR dB", "graph breaks", "sites converted",
               "notes"]
    return (f"### {data['model']}\n\n{data['device']}, torch {data['torch']}, {data['date']}, "
            f"{data['rounds']} interleaved rounds ({data['do_bench']})\n\n"
            + tabulate(rows, headers, tablefmt="github") + "\n" + conversion_bound(variants))


def conversion_bound(variants: list[dict]) -> str:
    """The line under a table that holds each conversion's peak to issue 22's bound: twice the
    original's weights plus one eager forward's peak (both above the model and its inputs)."""
    bf16 = variants[0]
    peaks = [v["convert_peak_bytes"] for v in variants[1:] if v["convert_peak_bytes"] is not None]
    if bf16["forward_peak_bytes"] is None or not peaks:
        return ""
    bound = 2 * bf16["weight_bytes"] + bf16["forward_peak_bytes"]
    return (f"\nConversion bound: 2 x {bf16['weight_bytes'] / 1e9:.2f} GB of weights + {bf16['forward_peak_bytes'] / 1e9:.2f} GB, "
            f"one eager forward's peak = {bound / 1e9:.2f} GB; {sum(p <= bound for p in peaks)} of {len(peaks)} "
            f"conversions within it.\n")


def model_bench_parser(doc: str, models, recipes, recipes_help: str, rounds: int, warmup_ms: float, rep_ms: float,
                       profiled: str) -> argparse.ArgumentParser:
    """The options of a whole-model bench (this one, bench_training.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(models), help=f"comma-separated: {', '.join(models)}")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # a child process: this one model
    parser.add_argument("--recipes", default=",".join(recipes), help=recipes_help)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup-ms", type=float, default=warmup_ms)
    parser.add_argument("--rep-ms", type=float, default=rep_ms)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (plumbing test, e.g. with --device cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="", help=f"comma-separated variants (bf16 or recipes) whose compiled "
                                                      f"{profiled}'s GPU kernels are written to "
                                                      "DIR/profile-MODEL-VARIANT.txt")
    return parser


def run_models(args, bench: str, script: str, models, bench_model, table):
    """As a child (--model): bench that model into DIR/<bench>-<model>.json. Otherwise run `script`
    once per model of --models in a child process (its compiled graphs and memory do not reach the
    next), then write every model's table to DIR/<bench>.md; exits with the children's status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        data = bench_model(args.model, args)
        (out / f"{bench}-{args.model}.json").write_text(json.dumps(data, indent=1))
        print(table(data))
        return
    status, tables = 0, []
    for name in args.models.split(","):
        if name not in models:
            sys.exit(f"{bench}: unknown model {name!r} (choices: {', '.join(models)})")
        status |= subprocess.run([sys.executable, script, "--model", name, *sys.argv[1:]]).returncode
        result = out / f"{bench}-{name}.json"
        if result.exists():
            tables.append(table(json.loads(result.read_text())))
    (out / f"{bench}.md").write_text("\n".join(tables))
    print("\n".join(tables))
    sys.exit(status)


def main():
    parser = model_bench_parser(__doc__, MODELS, RECIPES, f"comma-separated built-in recipes, or the bench's own: "
                                f"{', '.join(BENCH_RECIPES)}; or the peer {', '.join(PEERS)}", rounds=5, warmup_ms=50,
                                rep_ms=300, profiled="call")
    args = parser.parse_args()
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.profile = [v for v in args.profile.split(",") if v]
    run_models(args, "bench_models", __file__, MODELS, bench_model, table)


if __name__ == "__main__":
    main()
