#!/usr/bin/env python3
"""A converted model trained under FSDP2 (torch.distributed.fsdp.fully_shard) on the GPUs (or CPU
processes) torchrun starts: scripts/train_fp8.py's small GPT on its synthetic Markov language,
converted for training by a recipe, each transformer block and the whole model sharded, each rank
training on its share of every global batch (the same global batches as one process would). At the
end every rank calls lowconv.save, which gathers the whole tensors and has rank 0 write the
checkpoint that lowconv.load reads. Rank 0 writes DIR/train_distributed.md (the loss every 10
steps, the median step time) and DIR/checkpoint/.

    torchrun --nproc_per_node 2 scripts/train_distributed.py --out DIR [--recipe fp8-row|fp8-tensor|semi-sparse|none]
        [--compile]
    torchrun --nproc_per_node 2 scripts/train_distributed.py --out DIR --device cpu --tiny   # gloo, plumbing

The weights are all-gathered in their training dtype (FP8 all-gather, which halves those bytes, is
not built).
"""
import argparse
import datetime
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import lowconv  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from scripts.train_fp8 import FULL, TINY, TRAINING_RECIPES, MarkovLanguage, init_weights, training_recipe  # noqa: E402

def shard(model: torch.nn.Module, mesh) -> int:
    """fully_shard on each transformer block (h.N), then on the whole model (the embeddings and the
    head it ties); how many blocks."""
    blocks = [module for name, module in model.named_modules() if re.fullmatch(r"h\.\d+", name)]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(blocks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", choices=[*TRAINING_RECIPES, "none"], default="fp8-row")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 10 steps (plumbing)")
    parser.add_argument("--compile", action="store_true", help="compile the model's forward (torch.compile, after "
                                                               "sharding; the backward through AOTAutograd)")
    args = parser.parse_args()
    cfg, steps = (TINY, min(args.steps, 10)) if args.tiny else (FULL, args.steps)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch % world:
        raise SystemExit(f"the global batch ({cfg.batch}) does not split over {world} ranks")

    language = MarkovLanguage(cfg.vocab)
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    batches = [language.batch(cfg.batch, cfg.context, gen) for _ in range(steps)]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(cfg.vocab, cfg.context, cfg.dim, cfg.depth, cfg.heads).to(device)
    init_weights(model)
    if args.recipe != "none":
        model = lowconv.convert(model, training_recipe(args.recipe), (batches[0][:, :-1].to(device),))
    model.train()
    blocks = shard(model, init_device_mesh(device.type, (world,)))
    forward = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, times = [], []
    for step, tokens in enumerate(batches):
        start = time.perf_counter()
        tokens = tokens.chunk(world)[rank].to(device)
        with autocast:
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # the mean of the ranks' losses: the global batch's
        losses.append(whole.item() / world)
        times.append((time.perf_counter() - start) * 1e3)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    checkpoint = lowconv.save(model, args.out / "checkpoint") if args.recipe != "none" else None
    if rank == 0:
        rows = [[step, f"{losses[step]:.4f}"] for step in range(0, steps, 10)] + [[steps - 1, f"{losses[-1]:.4f}"]]
        lines = [
            "# A converted model trained under FSDP2", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- device: {world} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
            f"{torch.__version__}",
            f"- command: torchrun --nproc_per_node {world} {' '.join(sys.argv)}",
            f"- model: GPT vocab {cfg.vocab}, context {cfg.context}, dim {cfg.dim}, depth {cfg.depth} ({blocks} blocks "
            f"sharded), heads {cfg.heads}; AdamW lr {cfg.lr}; global batch {cfg.batch}; {steps} steps; recipe "
            f"{args.recipe}",
            f"- median step: {statistics.median(times):.1f} ms; checkpoint: {checkpoint}", "",
            tabulate(rows, headers=["step", "loss (global batch)"], tablefmt="github"), "",
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_distributed.md").write_text("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
