#!/usr/bin/env python3
"""A converted model trained under FSDP2 (torch.distributed.fsdp.fully_shard) on the GPUs (or CPU
processes) torchrun starts: scripts/train_fp8.py's small GPT on its synthetic Markov language,
converted for training by a recipe, each transformer block and the whole model sharded, each rank
training on its share of every global batch (the same global batches as one process would). At the
end every rank calls lowconv.save, which gathers the whole tensors and has rank 0 write the
checkpoint that lowconv.load reads. Rank 0 writes DIR/train_distributed.md (the loss every 10
steps, the median step time, the bytes FSDP2 all-gathers per step) and DIR/checkpoint/.

    torchrun --nproc_per_node 2 scripts/train_distributed.py --out DIR [--recipe fp8-row|fp8-tensor|semi-sparse|none]
        [--compile] [--no-fp8-all-gather] [--param-dtype bfloat16]
    torchrun --nproc_per_node 2 scripts/train_distributed.py --out DIR --device cpu --tiny   # gloo, plumbing

The fp8 recipes' weights are all-gathered in e4m3 (the fp8 op's fp8_all_gather: 1 byte per weight
element), or with --no-fp8-all-gather in their param dtype, as every other parameter: the master
weights' (float32), or --param-dtype's (FSDP2's MixedPrecisionPolicy). The all-gather bytes are
measured per step and per rank (what FSDP2's all-gathers write on each rank), for the transformer
blocks (their linears' weights and biases, their norms) and for the rest (embeddings, the last norm).
"""
import argparse
import datetime
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import lowconv  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from lowconv.kernels.fp8_all_gather import all_gather_into  # noqa: E402
from scripts.bench_common import kernel_table  # noqa: E402
from scripts.train_fp8 import (FULL, TINY, TRAINING_RECIPES, Config, MarkovLanguage, init_weights,  # noqa: E402
                               training_recipe)

# Where the GEMMs, not the host, set the step's time: a 0.4B-parameter GPT (timing runs, not loss parity)
LARGE = Config(vocab=16, context=1024, dim=2048, depth=8, heads=16, batch=16, lr=2e-4)

class CountingAllGather:
    """FSDP2's all-gather (FSDPModule.set_custom_all_gather's protocol) counting the bytes it
    gathers: its outputs', what each rank receives."""

    def __init__(self):
        self.bytes = self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes += output_tensor.nbytes
        self.calls += 1
        return all_gather_into(output_tensor, input_tensor, group=group, async_op=async_op)


@dataclass
class Sharded:
    blocks: list[torch.nn.Module]  # the transformer blocks, each sharded on its own
    blocks_all_gather: CountingAllGather  # theirs
    rest_all_gather: CountingAllGather  # the whole model's own parameters': embeddings, the last norm

    def all_gather_line(self, steps: int) -> str:
        """The bytes all-gathered per step, and per parameter element for the blocks."""
        elements = sum(p.numel() for p in self.blocks[0].parameters())  # DTensors: the whole parameters'
        blocks, rest = self.blocks_all_gather, self.rest_all_gather
        if not blocks.calls:  # one rank: FSDP2 gathers nothing
            return "all-gathered per step: nothing (one rank)"
        return (f"all-gathered per step, on each rank: blocks {blocks.bytes / steps / 1e6:.3f} MB "
                f"({blocks.calls // steps} all-gathers, {blocks.bytes / (blocks.calls * elements):.2f} bytes per "
                f"parameter element), the rest {rest.bytes / steps / 1e6:.3f} MB")


def shard(model: torch.nn.Module, mesh, param_dtype: torch.dtype) -> Sharded:
    """fully_shard on each transformer block (h.N), then on the whole model (the embeddings and the
    head it ties), parameters all-gathered in param_dtype (fp8 weights with fp8_all_gather in e4m3)."""
    blocks = [module for name, module in model.named_modules() if re.fullmatch(r"h\.\d+", name)]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    sharded = Sharded(blocks, CountingAllGather(), CountingAllGather())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
        block.set_custom_all_gather(sharded.blocks_all_gather)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.set_custom_all_gather(sharded.rest_all_gather)
    return sharded


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", choices=[*TRAINING_RECIPES, "none"], default="fp8-row")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 10 steps (plumbing)")
    parser.add_argument("--large", action="store_true", help="a GPT of dim 2048, depth 8, context 1024, global "
                                                             "batch 16 (step times)")
    parser.add_argument("--profile", action="store_true", help="after training, the GPU kernels and the host's "
                                                                  "ops of 3 more steps (rank 0's) to DIR/profile-rank0.txt")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                        help="save the trained model with lowconv.save (default)")
    parser.add_argument("--compile", action="store_true", help="compile each transformer block's forward "
                                                               "(torch.compile, after sharding, FSDP2's hooks left "
                                                               "eager; the backward through AOTAutograd)")
    parser.add_argument("--fp8-all-gather", action=argparse.BooleanOptionalAction, default=True,
                        help="the fp8 recipes' weights all-gathered in e4m3 (default), or in the param dtype")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the dtype FSDP2 all-gathers parameters in (its MixedPrecisionPolicy; the master "
                             "weights stay float32)")
    args = parser.parse_args()
    if args.profile and args.device != "cuda":
        parser.error("--profile times GPU kernels: it needs --device cuda")
    cfg, steps = (TINY, min(args.steps, 10)) if args.tiny else (LARGE if args.large else FULL, args.steps)
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
        recipe = training_recipe(args.recipe, fp8_all_gather=args.fp8_all_gather)
        model = lowconv.convert(model, recipe, (batches[0][:, :-1].to(device),))
    model.train()
    sharded = shard(model, init_device_mesh(device.type, (world,)), getattr(torch, args.param_dtype))
    if args.compile:  # as torchtitan does: each block, its hooks (FSDP2's all-gather and reshard) outside the graph
        for block in sharded.blocks:
            block.forward = torch.compile(block.forward, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        """One step on this rank's share of a global batch; its loss."""
        tokens = tokens.chunk(world)[rank].to(device)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    losses, times = [], []
    for step, tokens in enumerate(batches):
        start = time.perf_counter()
        loss = train_step(tokens)
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # the mean of the ranks' losses: the global batch's
        losses.append(whole.item() / world)
        times.append((time.perf_counter() - start) * 1e3)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    all_gathered = sharded.all_gather_line(steps)
    if args.profile:  # every rank steps (the steps are collectives); rank 0 writes its kernels
        kernels = kernel_table(lambda: train_step(batches[-1]), host=True)
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile-rank0.txt").write_text(kernels)
    checkpoint = lowconv.save(model, args.out / "checkpoint") if args.recipe != "none" and args.save else None
    if rank == 0:
        print(all_gathered, file=sys.stderr)
        fp8_all_gather = " (fp8 weights all-gathered in e4m3)" if args.fp8_all_gather and "fp8" in args.recipe else ""
        rows = [[step, f"{losses[step]:.4f}"] for step in range(0, steps, 10)] + [[steps - 1, f"{losses[-1]:.4f}"]]
        lines = [
            "# A converted model trained under FSDP2", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- device: {world} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
            f"{torch.__version__}",
            f"- command: torchrun --nproc_per_node {world} {' '.join(sys.argv)}",
            f"- model: GPT vocab {cfg.vocab}, context {cfg.context}, dim {cfg.dim}, depth {cfg.depth} "
            f"({len(sharded.blocks)} blocks sharded), heads {cfg.heads}; AdamW lr {cfg.lr}; global batch {cfg.batch}; "
            f"{steps} steps; recipe {args.recipe}{fp8_all_gather}; FSDP2 param dtype {args.param_dtype}",
            f"- {all_gathered}",
            f"- median step: {statistics.median(times):.1f} ms; checkpoint: {checkpoint}", "",
            tabulate(rows, headers=["step", "loss (global batch)"], tablefmt="github"), "",
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_distributed.md").write_text("\n".join(lines))
    # Every rank done before any tears its group down: gloo's teardown while another rank still
    # works aborted a CPU run ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
