#!/usr/bin/env python3
"""A SphereFormer block at the SpTr scale: what contextual relative position, and SphereFormer's
radial split on top of it, cost in a block converted by lowconv.

The block is examples/sphereformer.py's (level 0: 0.3 m cubic windows on half the heads, 2 x 2
degree x 80 m radial windows on the other half, LayerNorms, an MLP of 4x), in fp16, on a synthetic
LiDAR scene of 268,720 voxels, head_dim 16. Variants, each converted with the sparse_attention op
(its windows on lowconv's fused kernel), on a small scene, then run on the full one:
  no rel pos      plain window attention in both branches
  rel pos         contextual relative position in both, the radial axis not split
  rel pos, split  contextual in both, the radial axis split exponentially (SphereFormer's own)
  original        the unconverted block with split (SpTr's index-pair formulation in torch,
                  lowconv.compat.sptr), where it fits in memory
Forward (no grad) and forward+backward (all parameters and the features), median ms of
interleaved rounds (do_bench per round, the variants in a shuffled order each round), the spread
in brackets; the ratios against "no rel pos" are the target's (<= 1.3x).

    PYTHONPATH=. python3 scripts/bench_sphereformer.py --out DIR [--heads 4,8] [--scene dense] [--rounds 3]
        [--profile]   # and each converted variant's GPU kernels, to DIR/profile-h*-*.txt
    PYTHONPATH=. python3 scripts/bench_sphereformer.py --out DIR --device cpu --tiny   # plumbing only
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv  # noqa: E402
from examples import sphereformer  # noqa: E402
from examples.point_transformer import DENSE_AZIMUTH_STEPS, KITTI_AZIMUTH_STEPS  # noqa: E402
from lowconv.recipe import parse_recipe  # noqa: E402
from scripts.bench_common import interleaved_ms, kernel_table, run_header  # noqa: E402

RECIPE = parse_recipe('[[rules]]\nop = "sparse_attention"')  # computes in the block's dtype
SCENES = {"dense": DENSE_AZIMUTH_STEPS, "kitti": KITTI_AZIMUTH_STEPS}
FULL_POINTS, TINY_POINTS, CONVERT_POINTS = 268_720, 3_000, 3_000
VARIANTS = {"no rel pos": dict(rel_pos=False), "rel pos": dict(radial_split=False), "rel pos, split": {}}
MODES = ("fwd", "fwd+bwd")


def scene(points, azimuth_steps, dim, device, seed=0):
    xyz, batch = sphereformer.synthetic_lidar_scene(points, azimuth_steps, seed=seed)
    feats = torch.randn(points, dim, generator=torch.Generator().manual_seed(seed))
    return feats.to(device, torch.float16), xyz.to(device), batch.to(device)


def block(dim, device, **attention):
    torch.manual_seed(0)  # the same weights in every variant
    return sphereformer.SphereFormerBlock(dim, 0, **attention).to(device, torch.float16)


def calls(model, inputs):
    """The variant's forward (no grad) and forward+backward calls."""
    feats, xyz, batch = inputs
    leaf = feats.detach().requires_grad_()
    grad = torch.randn_like(feats)

    def forward():
        with torch.no_grad():
            return model(feats, xyz, batch)

    def train():
        model.zero_grad(set_to_none=True)
        leaf.grad = None
        model(leaf, xyz, batch).backward(grad)
    return {"fwd": forward, "fwd+bwd": train}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", default="4,8", help="comma list of head counts (dim = 16 x heads)")
    parser.add_argument("--scene", default="dense", choices=sorted(SCENES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--original", action="store_true", help="time the unconverted block too (memory hungry)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"{TINY_POINTS} points (plumbing)")
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--budget-s", type=float, default=0)
    parser.add_argument("--profile", action="store_true", help="write each converted variant's GPU kernels (each "
                                                                  "mode and head count) to DIR/profile-*.txt")
    args = parser.parse_args()
    device = torch.device(args.device)
    points = TINY_POINTS if args.tiny else FULL_POINTS
    rows, data = [], {"header": run_header(args, device, points=points, scene=args.scene), "results": []}
    for heads in map(int, args.heads.split(",")):
        dim = 16 * heads
        full = scene(points, SCENES[args.scene], dim, device)
        small = scene(CONVERT_POINTS, SCENES[args.scene], dim, device, seed=1)
        models = {name: lowconv.convert(block(dim, device, **options), RECIPE, small)
                  for name, options in VARIANTS.items()}
        if args.original:
            models["original"] = block(dim, device)
        timed = {(name, mode): call for name, model in models.items() for mode, call in calls(model, full).items()}
        results = interleaved_ms(timed, device, args.rounds, args.warmup_ms, args.rep_ms)
        for mode in MODES:
            base = statistics.median(results["no rel pos", mode])
            for name in models:
                got = results[name, mode]
                ms = statistics.median(got) if got else None
                rows.append([heads, mode, name, f"{ms:.2f} ({min(got):.2f}-{max(got):.2f})" if got else "out of memory",
                             f"{ms / base:.2f}x" if got else "-"])
                data["results"].append({"heads": heads, "mode": mode, "variant": name, "rounds_ms": got})
        if args.profile and device.type == "cuda":
            args.out.mkdir(parents=True, exist_ok=True)
            for (name, mode), call in timed.items():
                if name in VARIANTS:
                    slug = name.replace(",", "").replace(" ", "_")
                    (args.out / f"profile-h{heads}-{slug}-{mode.replace('+', '_')}.txt").write_text(kernel_table(call))
        del models, timed
        print(tabulate(rows, headers=["h", "mode", "variant", "ms (spread)", "vs no rel pos"]), flush=True)
    header = data["header"]
    text = (f"{header['device']}, torch {header['torch']}, triton {header['triton']}, {header['date']}, "
            f"{points} voxels ({args.scene} scene), fp16, {args.rounds} interleaved rounds\n\n"
            + tabulate(rows, headers=["h", "mode", "variant", "ms (spread)", "vs no rel pos"], tablefmt="github"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sphereformer.md").write_text(text + "\n")
    (args.out / "bench_sphereformer.json").write_text(json.dumps(data, indent=1))
    print(text)


if __name__ == "__main__":
    main()
