#!/usr/bin/env python3
"""Windowed (varlen) attention at the SpTr scale: lowconv's window_attention against its peers.

Two synthetic LiDAR scenes of 268,720 voxels (examples/point_transformer.py: 0.05 m voxels,
0.3 m windows, quant 0.3/24 so G = 24 and tables of L = 47 rows), points sorted by window,
head_dim 16, q pre-scaled by d^-0.5 as SpTr's callers do (so every peer runs with scale 1).
A third scene, "patches", is Point Transformer V3's serialized attention on the dense scene's
voxels: in z-order, cut into windows of 128 points (the last filled up with repeats), what PTv3
hands flash-attn's varlen call (which has no relative position); with relative position, SpTr's
contextual tables on each point's cell within its patch (examples/serialized_attention.py's
contextual=True: patch_coordinates, G = 24 as in the other scenes).
Peers, in one process and run:
  pairs         SpTr's index-pair formulation in torch (lowconv.compat.sptr's ops), rel pos too
  flash-varlen  SDPA over nested jagged tensors (SDPA picks its kernel: flash for fp16/bf16)
  flex          torch.compile'd FlexAttention over the flat sequence with a same-window block mask;
                with rel pos, the query and key tables' terms as a score_mod (per axis, <q_i, tq[r]>
                and <k_j, tk[r]> looked up from (N, L) products): the value table's term has no
                score_mod form, so flex computes less, checked against a reference without it
  lowconv       lowconv.kernels.window_attention (Triton on CUDA), rel pos too
First a precision check at h = 4 against the pair formulation in float64 (fails the run if
lowconv's fp32 relative L2 error exceeds 1e-4), then median times (triton.testing.do_bench)
and workspace memory (peak allocated beyond what the call returns) of forward (no grad) and
forward+backward, within a time budget.
Writes DIR/bench_sparse_attention.md and .json, rewritten after every measurement, so a run
cut short still leaves its results.

    PYTHONPATH=. python3 scripts/bench_sparse_attention.py --out DIR [--quick]
    python3 scripts/bench_sparse_attention.py --out DIR --device cpu --quick --tiny   # plumbing only
"""
import argparse
import functools
import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ is not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from scripts.bench_common import (add_run_arguments, cuda_context_error, first_line, measure,  # noqa: E402
                                  run_device, run_header, write_outputs)
from examples.point_transformer import (DENSE_AZIMUTH_STEPS, KITTI_AZIMUTH_STEPS,  # noqa: E402
                                        QUANT_SIZE, VOXEL_SIZE, WINDOW_SIZE, synthetic_lidar_scene)
from examples.serialized_attention import CONTEXT_GRID, PATCH_SIZE, patch_coordinates, serialize  # noqa: E402
from lowconv.compat import sptr  # noqa: E402
from lowconv.kernels.window_attention import row_windows_from_offsets, window_attention  # noqa: E402

SCENE_AZIMUTH_STEPS = {"dense": DENSE_AZIMUTH_STEPS, "kitti": KITTI_AZIMUTH_STEPS, "patches": DENSE_AZIMUTH_STEPS}
PATCH_SCENES = ("patches",)  # windows of PATCH_SIZE serialized points
FULL_POINTS = 268_720  # the SpTr fork's table size
TINY_POINTS = 5_000
HEAD_DIM = 16
GRID = sptr.grid_length(WINDOW_SIZE, QUANT_SIZE)  # G = 24
TABLE_ROWS = 2 * GRID - 1  # L = 47
assert CONTEXT_GRID == GRID, "the patches scene's coordinates index the same tables"
TABLE_STD = 0.1  # SpTr inits at 0.02; 0.1 makes the relative terms move the logits visibly
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PEERS = ("pairs", "flash-varlen", "flex", "lowconv")  # display order
RUN_ORDER = ("pairs", "lowconv", "flex", "flash-varlen")  # the peer that failed on the notes' run last
REL_POS_PEERS = ("pairs", "lowconv", "flex")
QK_TABLES_ONLY = ("flex",)  # rel pos without the value table's term
MODES = ("fwd", "fwd+bwd")
CHECK_HEADS = 4
GATE_FP32_REL_L2 = 1e-4
REFERENCE_CHUNK_PAIRS = 1 << 21  # float64 pair tensors of at most ~1 GB at h = 4
GRAD_NAMES = ("dq", "dk", "dv", "dtq", "dtk", "dtv")

# Copied from /work/shared/notes/h100-anchors.md, section "Windowed (varlen) attention at the
# SpTr scale" (measured there 2026-11-22 on an H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0).
# Their scenes came from an earlier generator: window counts differ slightly from this run's.
ANCHORS_MARKDOWN = """\
Synthetic LiDAR-like scenes (two scans, 0.05 m voxels, 0.3 m = 6-voxel cubic windows):
"kitti" 96,477 windows, mean 2.8 voxels per window, max 55, M = sum(n_w^2) = 1.85 M pairs;
"dense" 25,708 windows, mean 10.5, max 71, M = 6.12 M pairs.

| dense scene, fp16 | H=1 | H=2 | H=4 | H=8 |
|---|---|---|---|---|
| index-pair attention in torch (the SpTr formulation), fwd | 13.6 ms, 561 MB | 16.0 ms, 1122 MB | 20.4 ms, 2244 MB | 35.7 ms, 4484 MB |
| same, fwd+bwd | 24.8 ms, 1169 MB | 29.0 ms, 2337 MB | 39.0 ms, 4675 MB | 65.8 ms, 9342 MB |
| flash varlen (nested-jagged SDPA), fwd | 6.9 ms, 9 MB | 7.1 ms, 19 MB | 7.8 ms, 37 MB | 9.8 ms, 74 MB |
| same, fwd+bwd | 16.3 ms, 490 MB | 13.1 ms, 980 MB | 17.8 ms, 1961 MB | 24.5 ms, 3921 MB |

- Flash varlen through nested tensors failed outright on the "kitti" scene (96,477 windows:
  CUDA invalid argument), so peers break at the real window counts.

The SpTr fork itself (lh9171338/SparseTransformer, built from source for sm_90 with BF16 on):

| scene, dtype | h=1 fwd / fwd+bwd | h=2 | h=4 | h=8 |
|---|---|---|---|---|
| dense, fp16 | 0.79 / 2.6 ms (111 / 296 MB) | 1.19 / 3.7 ms (170 / 492 MB) | 9.2 / 13.3 ms (340 / 891 MB) | 10.9 / 18.7 ms (674 / 1675 MB) |
| kitti, fp16 | 0.42 / 1.27 ms (36 / 126 MB) | 0.57 / 1.75 ms (56 / 218 MB) | 3.2 / 5.2 ms (109 / 404 MB) | 4.1 / 7.9 ms (216 / 774 MB) |
| dense, fp16, with rel pos | 1.16 ms / **1376 ms** | 1.74 ms / **3730 ms** | 10.4 ms / **3311 ms** | 12.8 ms / **4345 ms** |
| dense, fp32, with rel pos | 1.25 / 14.6 ms | 1.87 / 20.9 ms | 10.2 / 49.4 ms | 12.7 / 109 ms |
"""


class Pairs(NamedTuple):
    """SpTr's pair layout of a sorted scene (see lowconv.compat.sptr), with rel_idx (M, 3)."""
    index_0: torch.Tensor
    index_0_offsets: torch.Tensor
    index_1: torch.Tensor
    index_1_offsets: torch.Tensor
    n_max: int
    rel_idx: torch.Tensor


@dataclass
class Scene:
    name: str
    offsets: torch.Tensor  # (W+1,) int32: window w is sorted points offsets[w]:offsets[w+1]
    row_windows: tuple  # (start, end), each (N,) int32: each sorted point's window
    coords: torch.Tensor  # (N, 3) int32 quantized in-window coordinates in [0, G-1]
    pairs: Pairs
    peers: dict = field(default_factory=dict)  # peer name -> attention function, built once

    @property
    def n(self):
        return self.coords.shape[0]

    def stats(self):
        counts = self.offsets.diff().long()
        return {"scene": self.name, "points": self.n, "windows": len(counts),
                "mean points per window": round(counts.float().mean().item(), 2),
                "max": int(counts.max()), "pairs M": int((counts * counts).sum())}


@dataclass
class Inputs:
    q: torch.Tensor  # (N, h, d) leaves that require grad; q pre-scaled by d^-0.5
    k: torch.Tensor
    v: torch.Tensor
    tables: tuple  # (tq, tk, tv), each (L, 3, h, d)
    grad_out: torch.Tensor

    def leaves(self, rel):
        return [self.q, self.k, self.v, *(self.tables if rel else ())]


def build_scene(name, n_points, device):
    """Scene `name` at n_points voxels, sorted by window, with SpTr's pair layout on `device`."""
    xyz, batch = synthetic_lidar_scene(n_points, SCENE_AZIMUTH_STEPS[name], seed=0)
    if name in PATCH_SCENES:
        grid = torch.floor((xyz - xyz.amin(0)) / VOXEL_SIZE).long()
        order, _ = serialize(grid, PATCH_SIZE)
        offsets = torch.arange(0, len(order) + 1, PATCH_SIZE, device=device)
        coords = patch_coordinates(grid[order], PATCH_SIZE).int().to(device)
        row_windows = tuple(t.int() for t in row_windows_from_offsets(offsets, len(coords)))
        return Scene(name, offsets, row_windows, coords, build_pairs(offsets, coords))
    _, sort_idx, offsets = sptr.window_partition(xyz, batch, WINDOW_SIZE)
    coords = sptr.quantized_coordinates(xyz[sort_idx], WINDOW_SIZE, QUANT_SIZE, GRID).int()
    offsets, coords = offsets.to(device), coords.to(device)
    row_windows = tuple(t.int() for t in row_windows_from_offsets(offsets, len(coords)))
    return Scene(name, offsets, row_windows, coords, build_pairs(offsets, coords))


def build_pairs(offsets, coords):
    """Pair layout of sorted points with window offsets (from 0) and quantized coords."""
    counts = offsets.diff()
    n_max = int(counts.max())
    index_0_offsets, index_1_offsets, index_0, index_1 = sptr.precompute_all(
        len(coords), len(counts), n_max, counts)
    # sptr.relative_position_index's formula, from the coords (it would re-quantize from xyz).
    rel_idx = (coords[index_0.long()] - coords[index_1.long()] + GRID - 1).int()
    return Pairs(index_0, index_0_offsets, index_1, index_1_offsets, n_max, rel_idx)


def make_inputs(n, heads, dtype, device, seed):
    """Random inputs, drawn in fp32 from a seed per (seed, heads), so dtypes differ only by rounding."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + heads)

    def randn(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)

    q = randn(n, heads, HEAD_DIM, std=HEAD_DIM ** -0.5)
    k, v = randn(n, heads, HEAD_DIM), randn(n, heads, HEAD_DIM)
    tables = tuple(randn(TABLE_ROWS, 3, heads, HEAD_DIM, std=TABLE_STD) for _ in range(3))
    grad_out = randn(n, heads, HEAD_DIM)
    for t in (q, k, v, *tables):
        t.requires_grad_()
    return Inputs(q, k, v, tables, grad_out)


def pairs_attention(q, k, v, tables, pairs):
    """SpTr's chain of ops (sparse_self_attention without the sort), tables None for no rel pos."""
    p = pairs
    if tables is None:
        attn = sptr.attention_step1(q, k, p.index_0, p.index_0_offsets, p.index_1, p.index_1_offsets,
                                    p.n_max)
    else:
        attn = sptr.dot_prod_with_idx_all(q, p.index_0, p.index_0_offsets, k, p.index_1,
                                          p.index_1_offsets, tables[0], tables[1], p.rel_idx, p.n_max)
    attn = sptr.scatter_softmax_csr(attn, p.index_0_offsets, dim=0)
    if tables is None:
        return sptr.attention_step2(attn, v, p.index_0, p.index_0_offsets, p.index_1,
                                    p.index_1_offsets, p.n_max)
    return sptr.attention_step2_with_rel_pos_value(attn, v, p.index_0, p.index_0_offsets, p.n_max,
                                                   p.index_1, p.index_1_offsets, tables[2], p.rel_idx)


def pairs_peer(scene):
    return functools.partial(pairs_attention, pairs=scene.pairs)


def lowconv_peer(scene):
    def attention(q, k, v, tables):
        coords = None if tables is None else scene.coords
        # As the sparse_attention op calls it: row windows it built, so no check reads them back.
        return window_attention(q, k, v, row_windows=scene.row_windows, scale=1.0, coords=coords,
                                tables=tables, validate=False)
    return attention


def flash_varlen_peer(scene):
    offsets = scene.offsets.long()
    counts = offsets.diff()
    # Given lengths spare the nested tensor a device-to-host sync per call.
    seqlens = {"min_seqlen": int(counts.min()), "max_seqlen": int(counts.max())}

    def jagged(x):  # (N, h, d) -> (windows, h, j, d)
        return torch.nested.nested_tensor_from_jagged(x, offsets, **seqlens).transpose(1, 2)

    def attention(q, k, v, tables):
        out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), scale=1.0)
        return out.transpose(1, 2).values()
    return attention


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    # Enough recompiles for every dtype and grad mode; dynamic shapes: one compile for all
    # scenes and head counts of a dtype, not one per shape (compiles count against the budget).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return torch.compile(flex_attention, dynamic=True)


def flex_peer(scene):
    from torch.nn.attention.flex_attention import create_block_mask
    window_of = torch.repeat_interleave(torch.arange(len(scene.offsets) - 1, device=scene.offsets.device,
                                                     dtype=torch.int32), scene.offsets.diff().long())

    def same_window(b, h, q_idx, kv_idx):
        return window_of[q_idx] == window_of[kv_idx]

    compile_mask = "_compile" in inspect.signature(create_block_mask).parameters
    block_mask = create_block_mask(same_window, None, None, scene.n, scene.n,
                                   device=scene.offsets.device, **({"_compile": True} if compile_mask else {}))
    flex = compiled_flex_attention()

    coords = scene.coords.long()

    def attention(q, k, v, tables):  # (N, h, d) <-> (1, h, N, d) are views
        score_mod = None if tables is None else table_score_mod(q, k, tables, coords)
        out = flex(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask, scale=1.0,
                   score_mod=score_mod)
        return out[0].transpose(0, 1)
    return attention


def table_score_mod(q, k, tables, coords):
    """The query and key tables' terms of SpTr's contextual logits as a FlexAttention score_mod:
    sum over axes a of <q_i, tq[r_a, a]> + <k_j, tk[r_a, a]>, r_a = c_i,a - c_j,a + G - 1, looked up
    from the products of every point with every table row (h, N, L per axis and side), which autograd
    carries back to q, k and the tables."""
    tq, tk, _ = tables
    # One tensor per axis and side: Flex's backward takes one indexing of each captured tensor.
    by_q = [torch.einsum("nhd,lhd->hnl", q, tq[:, axis]) for axis in range(3)]
    by_k = [torch.einsum("nhd,lhd->hnl", k, tk[:, axis]) for axis in range(3)]

    def score_mod(score, b, h, q_idx, kv_idx):
        for axis in range(3):
            r = coords[q_idx, axis] - coords[kv_idx, axis] + GRID - 1
            score = score + by_q[axis][h, q_idx, r] + by_k[axis][h, kv_idx, r]
        return score
    return score_mod


PEER_BUILDERS = {"pairs": pairs_peer, "flash-varlen": flash_varlen_peer, "flex": flex_peer,
                 "lowconv": lowconv_peer}


def forward_call(attention, x, rel):
    """Inference: no graph, inputs that do not require grad."""
    q, k, v, *tables = (t.detach() for t in x.leaves(rel))

    def run():
        with torch.no_grad():
            return attention(q, k, v, tuple(tables) or None)
    return run


def train_call(attention, x, rel, unused=False):
    """Forward and the gradients of (out * grad_out).sum() for q, k, v (and the tables); `unused`:
    None for a table the peer does not read (QK_TABLES_ONLY's value table)."""
    def run():
        out = attention(x.q, x.k, x.v, x.tables if rel else None)
        return out, torch.autograd.grad(out, x.leaves(rel), x.grad_out, allow_unused=unused)
    return run


def float64_reference(scene, x, rel):
    """Output and gradients of the pair formulation in float64 on x's values, over chunks of
    whole windows (pair tensors stay ~1 GB at any scene size; windows are independent)."""
    offsets = scene.offsets.long().cpu()
    counts = offsets.diff()
    pair_end = (counts * counts).cumsum(0)
    targets = torch.arange(1, int(pair_end[-1]) // REFERENCE_CHUNK_PAIRS + 1) * REFERENCE_CHUNK_PAIRS
    cuts = torch.searchsorted(pair_end, targets, right=True)
    bounds = sorted({0, *cuts.tolist(), len(counts)})
    q, k, v, grad_out = (t.detach().double() for t in (x.q, x.k, x.v, x.grad_out))
    tables = tuple(t.detach().double().requires_grad_() for t in x.tables) if rel else None
    out, grads = torch.empty_like(q), [torch.zeros_like(q) for _ in range(3)]
    table_grads = [torch.zeros_like(t) for t in tables] if rel else []
    for w0, w1 in zip(bounds[:-1], bounds[1:]):
        p0, p1 = int(offsets[w0]), int(offsets[w1])
        pairs = build_pairs(scene.offsets[w0:w1 + 1] - scene.offsets[w0], scene.coords[p0:p1])
        leaves = [t[p0:p1].detach().requires_grad_() for t in (q, k, v)]
        chunk_out = pairs_attention(*leaves, tables, pairs)
        chunk_grads = torch.autograd.grad(chunk_out, leaves + list(tables or ()), grad_out[p0:p1])
        out[p0:p1] = chunk_out.detach()
        for full, part in zip(grads, chunk_grads[:3]):
            full[p0:p1] = part
        for full, part in zip(table_grads, chunk_grads[3:]):
            full += part
    return out, grads + table_grads


def without_value_table(x):
    """x with a value table of zeros: what a peer computes that has no form for its term."""
    tq, tk, tv = x.tables
    return Inputs(x.q, x.k, x.v, (tq, tk, torch.zeros_like(tv)), x.grad_out)


def error_stats(got, want):
    diff = got.double() - want
    return {"rel_l2": (diff.norm() / want.norm()).item(), "max_abs": diff.abs().max().item()}


class Run:
    """The results so far, the budget, and what failed (so it is not retried)."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.start = time.perf_counter()
        self.scenes, self.precision, self.timings = [], [], []
        self.gate = {"passed": None, "detail": "not run yet"}
        self.known_failures = {}  # (peer, scene, dtype, rel, mode) -> message; OOM excluded
        self.context_lost = None  # first line of the error after which CUDA stopped working

    def elapsed(self):
        return time.perf_counter() - self.start

    def log(self, text):
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def peer(self, name, scene):
        if name not in scene.peers:
            scene.peers[name] = PEER_BUILDERS[name](scene)
        return scene.peers[name]

    def failed(self, key, error):
        """Record a failure; find out whether CUDA still works after it."""
        message = first_line(error)
        if not isinstance(error, torch.OutOfMemoryError):
            self.known_failures[key] = message
        self.context_lost = self.context_lost or cuda_context_error(self.device)
        return message

    def not_runnable(self, key, budget=True):
        """Why the unit `key` is not run, or None."""
        if self.context_lost:
            return "skipped", f"CUDA context lost ({self.context_lost})"
        if key in self.known_failures:
            return "fails", self.known_failures[key]
        if budget and self.elapsed() > self.args.budget_s:
            return "skipped", "time budget"
        return None

    def check_precision(self, scene, dtype_name, peers):
        """Errors vs float64 of each peer's output and gradients at h = CHECK_HEADS."""
        x = make_inputs(scene.n, CHECK_HEADS, DTYPES[dtype_name], self.device, self.args.seed)
        for rel in (False, True):
            want_out, want_grads = float64_reference(scene, x, rel)
            if rel and any(p in QK_TABLES_ONLY for p in peers):
                qk_only = float64_reference(scene, without_value_table(x), rel)
            for peer in peers:
                if rel and peer not in REL_POS_PEERS:
                    continue
                row = {"scene": scene.name, "dtype": dtype_name, "heads": CHECK_HEADS, "rel_pos": rel,
                       "peer": peer}
                key = (peer, scene.name, dtype_name, rel, "fwd+bwd")
                blocked = self.not_runnable(key, budget=False)  # the check is the gate: always run
                if blocked:
                    row.update(status=blocked[0], error=blocked[1])
                else:
                    try:
                        out, grads = train_call(self.peer(peer, scene), x, rel, peer in QK_TABLES_ONLY)()
                        row["status"] = "ok"
                        want = qk_only if rel and peer in QK_TABLES_ONLY else (want_out, want_grads)
                        row["errors"] = {name: error_stats(got, expected) for name, got, expected in
                                         zip(("out",) + GRAD_NAMES, (out, *grads), (want[0], *want[1]))
                                         if got is not None}
                        del out, grads
                    except Exception as error:  # noqa: BLE001 - a peer's failure is a result
                        row.update(status="fails", error=self.failed(key, error))
                self.precision.append(row)
                self.log(f"check {scene.name} {dtype_name} rel={'on' if rel else 'off'} {peer}: "
                         + (f"ok{max_rel_error(row)}" if row["status"] == "ok"
                            else f"{row['status']}: {row['error']}"))
            del want_out, want_grads
        del x

    def decide_gate(self):
        rows = [r for r in self.precision if r["peer"] == "lowconv" and r["dtype"] == "fp32"]
        if not rows:
            self.gate = {"passed": None, "detail": "lowconv is not among --peers"}
            return
        bad = []
        for r in rows:
            over = [f"{name} relative L2 {e['rel_l2']:.1e}" for name, e in r.get("errors", {}).items()
                    if not e["rel_l2"] <= GATE_FP32_REL_L2]  # NaN fails too
            if r["status"] != "ok" or over:
                bad.append(f"{r['scene']} rel_pos={r['rel_pos']}: {r.get('error') or ', '.join(over)}")
        self.gate = {"passed": not bad, "detail": "; ".join(bad) or
                     f"lowconv fp32 relative L2 <= {GATE_FP32_REL_L2:g} for the output and every gradient"}

    def time_unit(self, scene, dtype_name, heads, rel, peer, mode, x):
        record = {"scene": scene.name, "dtype": dtype_name, "heads": heads, "rel_pos": rel,
                  "peer": peer, "mode": mode}
        key = (peer, scene.name, dtype_name, rel, mode)
        blocked = self.not_runnable(key)
        if blocked:
            record.update(status=blocked[0], error=blocked[1])
        else:
            try:
                attention = self.peer(peer, scene)
                call = forward_call(attention, x, rel) if mode == "fwd" else \
                    train_call(attention, x, rel, peer in QK_TABLES_ONLY)
                record.update(measure(call, self.device, self.args.warmup_ms, self.args.rep_ms),
                              status="ok")
            except Exception as error:  # noqa: BLE001 - a peer's failure is a result
                record.update(status="fails", error=self.failed(key, error))
        self.timings.append(record)
        self.log(f"{scene.name} {dtype_name} h={heads} rel={'on' if rel else 'off'} {peer} {mode}: "
                 + (timing_cell(record, {}) if record["status"] == "ok"
                    else f"{record['status']}: {record['error']}"))


def max_rel_error(row):
    worst = max((e["rel_l2"] for e in row["errors"].values()), key=lambda e: (math.isnan(e), e))
    return f" (max rel L2 {worst:.1e})"


def timing_cell(record, notes):
    """'12.3 ms, 456 MB', or 'fails [n]' with the message in notes, or the skip reason."""
    if record is None:
        return ""
    if record["status"] == "ok":
        memory = "" if record["workspace_mb"] is None else f", {record['workspace_mb']:.0f} MB"
        ms = record["ms"]
        return f"{ms:.0f} ms{memory}" if ms >= 100 else f"{ms:.3g} ms{memory}"
    if record["status"] == "fails":
        return f"fails [{notes.setdefault(record['error'], len(notes) + 1)}]"
    return f"skipped ({record['error']})"


def precision_cells(row, notes):
    names = ("out",) + GRAD_NAMES
    if row["status"] != "ok":
        return [timing_cell(row, notes)] + [""] * (len(names) - 1)
    return [f"{row['errors'][n]['rel_l2']:.1e} ({row['errors'][n]['max_abs']:.1e})" if n in row["errors"]
            else "—" for n in names]


def planned_configs(settings):
    return [(scene, dtype, heads, rel) for scene in settings["scenes"] for dtype in settings["dtypes"]
            for heads in settings["heads"] for rel in (False, True)]


def markdown_report(run, header, settings):
    notes = {}
    lines = ["# Windowed attention at the SpTr scale: lowconv vs peers", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    gate = run.gate
    lines += [f"- fp32 gate: {'PASSED' if gate['passed'] else 'FAILED' if gate['passed'] is False else 'not decided'}"
              f" ({gate['detail']})", ""]
    lines += ["## Scenes", "", tabulate(run.scenes, headers="keys", tablefmt="github"), ""]

    lines += [f"## Precision vs float64 (h = {CHECK_HEADS}, head_dim {HEAD_DIM})", "",
              "Relative L2 (max abs error) of the output and of each gradient, against SpTr's pair "
              "formulation in float64 on the same (rounded) inputs; tables std "
              f"{TABLE_STD}, q pre-scaled by d^-0.5.", ""]
    rows = [[r["scene"], r["dtype"], r["peer"], "on" if r["rel_pos"] else "off", *precision_cells(r, notes)]
            for r in run.precision]
    lines += [tabulate(rows, headers=["scene", "dtype", "peer", "rel pos", "out", *GRAD_NAMES],
                       tablefmt="github"), ""]

    peers = [p for p in PEERS if p in settings["peers"]]
    by_key = {(t["scene"], t["dtype"], t["heads"], t["rel_pos"], t["peer"], t["mode"]): t for t in run.timings}
    headers = ["scene", "dtype", "h", "rel pos"] + [f"{p} {m}" for p in peers for m in MODES]
    speedup = "pairs" in peers and "lowconv" in peers
    if speedup:
        headers += [f"lowconv vs pairs {m}" for m in MODES]
    rows = []
    for config in planned_configs(settings):
        row = [*config[:3], "on" if config[3] else "off"]
        for peer in peers:
            for mode in MODES:
                supported = not config[3] or peer in REL_POS_PEERS
                row.append(timing_cell(by_key.get((*config, peer, mode)), notes) if supported else "—")
        if speedup:
            for mode in MODES:
                pairs, ours = by_key.get((*config, "pairs", mode)), by_key.get((*config, "lowconv", mode))
                ok = pairs and ours and pairs["status"] == ours["status"] == "ok"
                row.append(f"{pairs['ms'] / ours['ms']:.1f}x" if ok else "")
        rows.append(row)
    lines += ["## Time (median) and workspace memory", "",
              "fwd runs under no_grad; fwd+bwd is the forward and the gradients of (out * grad_out).sum() "
              "for q, k, v (and the three tables with rel pos). Workspace memory is "
              "max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before "
              "the call, minus the bytes of the tensors the call returns (the output, and the gradients "
              "in fwd+bwd) (MB = 1e6 bytes). Index tensors, block masks, offsets and lowconv's row "
              "windows are built once per scene, outside the timed call; lowconv is called as the "
              "sparse_attention op calls it (validate=False: no check reads the windows back). "
              "flash-varlen has no relative position (—); flex's computes the query and key tables' "
              "terms only (less than the others).", "",
              tabulate(rows, headers=headers, tablefmt="github"), ""]
    if notes:
        lines += ["Failures:", ""] + [f"[{n}] {message}" for message, n in notes.items()] + [""]
    lines += ["## Bars from /work/shared/notes/h100-anchors.md (an earlier run, not this one)", "",
              ANCHORS_MARKDOWN]
    return "\n".join(lines)


def write_report(run, header, settings, final=False):
    header = {**header, "elapsed": f"{run.elapsed():.0f} s" + ("" if final else " (still running)")}
    text = markdown_report(run, header, settings)
    data = {"header": header, "settings": settings, "gate": run.gate, "scenes": run.scenes,
            "precision": run.precision, "timings": run.timings, "anchors_markdown": ANCHORS_MARKDOWN}
    write_outputs(run.args.out, "bench_sparse_attention", text, data)
    return text


def parse_args():
    parser = argparse.ArgumentParser(
        description="Time windowed attention at the SpTr scale (268,720 voxels, head_dim 16): "
                    "SpTr's index pairs in torch, flash-varlen SDPA over nested tensors, "
                    "FlexAttention, and lowconv's window_attention; after a float64 precision check.")
    add_run_arguments(parser, name="bench_sparse_attention", quick_help="dense scene, fp16, h in {1, 4} only",
                      tiny_help=f"scenes of {TINY_POINTS} points", cpu_help="lowconv's torch reference",
                      budget_s=420.0, warmup_ms=10.0, rep_ms=40.0)
    parser.add_argument("--scenes", help="comma list of dense,kitti (default both; --quick: dense)")
    parser.add_argument("--dtypes", help="comma list of fp16,bf16,fp32 (default all; --quick: fp16)")
    parser.add_argument("--heads", help="comma list of head counts (default 1,2,4,8; --quick: 1,4)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {','.join(PEERS)}")
    return parser.parse_args()


def comma_list(text, default, allowed=None, convert=str):
    values = [convert(v) for v in (text.split(",") if text else default)]
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad or not values:
        sys.exit(f"bench_sparse_attention: {bad or 'an empty list'} not among {list(allowed or [])}")
    return values


def resolve_settings(args):
    quick = args.quick
    return {
        "scenes": comma_list(args.scenes, ["dense"] if quick else ["dense", "kitti"], SCENE_AZIMUTH_STEPS),
        "dtypes": comma_list(args.dtypes, ["fp16"] if quick else list(DTYPES), DTYPES),
        "heads": comma_list(args.heads, [1, 4] if quick else [1, 2, 4, 8], convert=int),
        "peers": comma_list(args.peers, PEERS, PEERS),
        "points": TINY_POINTS if args.tiny else FULL_POINTS,
    }


def main():
    args = parse_args()
    device = run_device(args, "bench_sparse_attention")
    settings = resolve_settings(args)
    header = run_header(args, device)
    run = Run(args, device)

    scenes = []
    for name in settings["scenes"]:
        scenes.append(build_scene(name, settings["points"], device))
        run.scenes.append(scenes[-1].stats())
        run.log(f"scene {run.scenes[-1]}")

    # The check covers the timed dtypes, and fp32 for lowconv whatever they are: it is the gate.
    check_dtypes = settings["dtypes"] + ([] if "fp32" in settings["dtypes"] else ["fp32"])
    for scene in scenes:
        for dtype_name in check_dtypes:
            peers = [p for p in RUN_ORDER if p in settings["peers"]
                     and (dtype_name in settings["dtypes"] or p == "lowconv")]
            if peers:
                run.check_precision(scene, dtype_name, peers)
            write_report(run, header, settings)
    run.decide_gate()
    if run.gate["passed"] is False:
        print(f"LOWCONV FP32 PRECISION GATE FAILED: {run.gate['detail']}", file=sys.stderr, flush=True)

    # dtype outermost: if the budget runs out, what is left is the less-watched dtypes.
    for dtype_name in settings["dtypes"]:
        for scene in scenes:
            for heads in settings["heads"]:
                x = make_inputs(scene.n, heads, DTYPES[dtype_name], device, args.seed)
                for rel in (False, True):
                    for peer in RUN_ORDER:
                        if peer in settings["peers"] and (not rel or peer in REL_POS_PEERS):
                            for mode in MODES:
                                run.time_unit(scene, dtype_name, heads, rel, peer, mode, x)
                                write_report(run, header, settings)
                del x

    print(write_report(run, header, settings, final=True))
    if run.gate["passed"] is False:
        sys.exit(f"LOWCONV FP32 PRECISION GATE FAILED: {run.gate['detail']}")


if __name__ == "__main__":
    main()
