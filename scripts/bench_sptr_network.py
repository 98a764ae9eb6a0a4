#!/usr/bin/env python3
"""The whole SphereFormer-like network (examples/sphereformer.py: five levels, 10 window-attention
chains with contextual relative position, the radial axis split) on SpTr's own CUDA ops against
the same network converted by lowconv, in float32, on a synthetic LiDAR scene.

Variants, the same weights:
  SpTr             unconverted, its attention on SpTr's CUDA ops (dvlab-research/SparseTransformer,
                   as SphereFormer vendors it, built from source: --sptr DIR holds the package and
                   its built sptr_cuda extension; never part of this repository)
  compat           unconverted, on lowconv.compat.sptr (SpTr's algorithm in torch), where it fits
  lowconv fp32     converted by the sparse_attention op in the network's dtype (the fused window kernel)
  lowconv bf16     converted by the built-in recipe sparse-attention-bf16
Forward (no grad) and forward+backward (the parameters' gradients), medians of interleaved
rounds (do_bench per round, the variants shuffled each round), the spread in brackets; each
output's SQNR against SpTr's (against compat's where SpTr is not there).

SpTr imports torch_scatter, torch_geometric and timm. This script stands in for torch_geometric's
voxel_grid (as torch_geometric 2.0 computed it, whose signature SpTr calls: newer ones take other
arguments and need pyg-lib), and, where they are not installed, for torch_scatter's segment_csr and
gather_csr (on torch.segment_reduce) and timm's DropPath and trunc_normal_ (which SpTr's attention
path does not call).

    PYTHONPATH=. python3 scripts/bench_sptr_network.py --out DIR --sptr DIR [--points 120000] [--rounds 3]
        [--profile]   # and each variant's GPU kernels per forward, to DIR/profile-*.txt
    PYTHONPATH=. python3 scripts/bench_sptr_network.py --out DIR --device cpu --points 2000   # plumbing only
"""
import argparse
import importlib
import json
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv  # noqa: E402
from examples import sphereformer  # noqa: E402
from examples.point_transformer import KITTI_AZIMUTH_STEPS  # noqa: E402
from lowconv.compat import sptr as compat_sptr  # noqa: E402
from lowconv.recipe import parse_recipe  # noqa: E402
from scripts.bench_common import interleaved_ms, kernel_table, run_header  # noqa: E402

IN_NETWORK_DTYPE = parse_recipe('[[rules]]\nop = "sparse_attention"')
CONVERT_POINTS = 3_000
MODES = ("fwd", "fwd+bwd")


def segment_csr(src, indptr, reduce="sum"):
    return torch.segment_reduce(src, reduce, lengths=indptr.diff(), axis=0, unsafe=True)


def gather_csr(src, indptr):
    return src.repeat_interleave(indptr.diff(), dim=0, output_size=int(indptr[-1]))


def voxel_grid(pos, batch, size, start=None, end=None):
    """torch_geometric's voxel_grid (torch_cluster's grid_cluster over (pos, batch))."""
    dims = pos.shape[1]
    pos = torch.cat([pos, batch[:, None].to(pos.dtype)], 1)
    size = torch.cat([torch.as_tensor(size, dtype=pos.dtype, device=pos.device).reshape(-1).expand(dims),
                      pos.new_ones(1)])
    start = pos.min(0).values if start is None else torch.cat([torch.as_tensor(start, dtype=pos.dtype,
                                                                               device=pos.device), pos.new_zeros(1)])
    end = pos.max(0).values
    cell = ((pos - start) / size).long()
    voxels = torch.cat([pos.new_ones(1, dtype=torch.long), (((end - start) / size).long() + 1).cumprod(0)[:-1]])
    return (cell * voxels).sum(1)


def stand_in_missing_packages():
    """sys.modules entries for what SpTr imports (the module doc)."""
    def missing(name):
        try:
            importlib.import_module(name)
            return False
        except ImportError:
            return True

    if missing("torch_scatter"):
        sys.modules["torch_scatter"] = types.SimpleNamespace(segment_csr=segment_csr, gather_csr=gather_csr)
    sys.modules["torch_geometric"] = types.ModuleType("torch_geometric")
    sys.modules["torch_geometric.nn"] = types.SimpleNamespace(voxel_grid=voxel_grid)
    if missing("timm"):
        layers = types.SimpleNamespace(DropPath=torch.nn.Identity, trunc_normal_=torch.nn.init.trunc_normal_)
        sys.modules["timm"] = types.ModuleType("timm")
        sys.modules["timm.models"] = types.SimpleNamespace(layers=layers)
        sys.modules["timm.models.layers"] = layers


def load_sptr(directory: Path | None):
    """SpTr's package from `directory` (with its built extension), or None."""
    if directory is None:
        return None
    stand_in_missing_packages()
    sys.path.insert(0, str(directory))
    return importlib.import_module("sptr")


def scene(points, device, seed=0):
    xyz, batch = sphereformer.synthetic_lidar_scene(points, KITTI_AZIMUTH_STEPS, seed=seed)
    intensity = torch.rand(points, 1, generator=torch.Generator().manual_seed(seed))
    return torch.cat([xyz, intensity], 1).to(device), xyz.to(device), batch.to(device)


def network(device):
    torch.manual_seed(0)  # the same weights in every variant
    return sphereformer.SphereFormerNet().to(device)


class OnSptr(torch.nn.Module):
    """The network with its attention calls on `ops` (SpTr's package, or compat) while it runs."""

    def __init__(self, model, ops):
        super().__init__()
        self.model, self.ops = model, ops

    def forward(self, *inputs):
        saved, sphereformer.sptr = sphereformer.sptr, self.ops
        try:
            return self.model(*inputs)
        finally:
            sphereformer.sptr = saved


def calls(model, inputs):
    def forward():
        with torch.no_grad():
            return model(*inputs)

    def train():
        model.zero_grad(set_to_none=True)
        model(*inputs).square().mean().backward()
    return {"fwd": forward, "fwd+bwd": train}


def sqnr_db(got, want):
    return (10 * torch.log10(want.double().square().sum() / (got.double() - want.double()).square().sum())).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sptr", type=Path, help="a directory holding SpTr's built package (sptr/, sptr_cuda)")
    parser.add_argument("--points", type=int, default=120_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--profile", action="store_true", help="write each variant's GPU kernels of a forward to "
                                                                  "DIR/profile-*.txt")
    args = parser.parse_args()
    device = torch.device(args.device)
    real = load_sptr(args.sptr)
    full, small = scene(args.points, device), scene(CONVERT_POINTS, device, seed=1)
    models = {}
    if real is not None:
        models["SpTr"] = OnSptr(network(device), real)
    models["compat"] = OnSptr(network(device), compat_sptr)
    models["lowconv fp32"] = lowconv.convert(network(device), IN_NETWORK_DTYPE, small)
    models["lowconv bf16"] = lowconv.convert(network(device), "sparse-attention-bf16", small)
    converted = {name: len(m.lowconv_plan.converted()) for name, m in models.items() if hasattr(m, "lowconv_plan")}
    reference = "SpTr" if real is not None else "compat"
    outputs = {}
    for name, model in models.items():
        try:
            with torch.no_grad():
                outputs[name] = model(*full)
        except torch.OutOfMemoryError:
            outputs[name] = None
            torch.cuda.empty_cache()
    timed = {(name, mode): call for name, model in models.items() if outputs[name] is not None
             for mode, call in calls(model, full).items()}
    results = interleaved_ms(timed, device, args.rounds, args.warmup_ms, args.rep_ms)
    rows, data = [], {"header": run_header(args, device, points=args.points), "converted_sites": converted,
                      "results": []}
    base = {mode: statistics.median(results[reference, mode]) for mode in MODES if results.get((reference, mode))}
    for name in models:
        want = outputs[reference]
        sqnr = sqnr_db(outputs[name], want) if outputs[name] is not None and want is not None else None
        for mode in MODES:
            got = results.get((name, mode))
            ms = statistics.median(got) if got else None
            rows.append([name, mode, f"{ms:.2f} ({min(got):.2f}-{max(got):.2f})" if got else "out of memory",
                         f"{base[mode] / ms:.1f}x" if got and mode in base else "-",
                         "-" if name == reference or sqnr is None else f"{sqnr:.1f}"])
            data["results"].append({"variant": name, "mode": mode, "rounds_ms": got, "sqnr_db": sqnr})
    header = data["header"]
    headers = ["variant", "mode", "ms (spread)", f"speed vs {reference}", f"output SQNR dB vs {reference}"]
    text = (f"{header['device']}, torch {header['torch']}, triton {header['triton']}, {header['date']}, "
            f"{args.points} voxels (kitti scene), float32 network, {args.rounds} interleaved rounds; "
            f"sites converted: {converted}\n\n" + tabulate(rows, headers=headers, tablefmt="github"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile and device.type == "cuda":
        for (name, mode), call in timed.items():
            if mode == "fwd":
                (args.out / f"profile-{name.replace(' ', '_')}.txt").write_text(kernel_table(call))
    (args.out / "bench_sptr_network.md").write_text(text + "\n")
    (args.out / "bench_sptr_network.json").write_text(json.dumps(data, indent=1))
    print(text)


if __name__ == "__main__":
    main()
