#!/usr/bin/env python3
"""2:4 semi-structured linear (issue 5): dense vs torch's 2:4 vs lowconv, in one run on the GPU.

0. cuSPARSELt checks, each in a child process (a crash there is a result, not the end of the run):
   the header shipped beside libcusparseLt (struct sizes, and the enum values that
   lowconv.kernels.cusparselt hard-codes), and torch._cslt_sparse_mm(transpose_result=True)
   (column-major output: y contiguous instead of y^T), which crashed here before: its error
   vs float64, and its kernel time against transpose_result=False, both replayed in CUDA graphs.
1. Forward (inference, no_grad), fp16 and bf16, y = x W^T, W (N, K) magnitude-pruned 2:4, no bias:
     dense            F.linear(x, W) on the pruned W (cuBLAS)
     torch 2:4        F.linear(x, torch.sparse.to_sparse_semi_structured(W)): torch's cuSPARSELt
                      path, which makes its plan on every call
     graph replay     torch._cslt_sparse_mm captured in a CUDA graph, replayed on fixed buffers:
                      the kernel's floor, not a usable layer
     graph + copies   the same replay with x copied into its input buffer and the output cloned:
                      a per-layer CUDA graph as a layer
     lowconv          the module lowconv.convert makes with backend = "cusparselt" (its plan at
                      the site's shape runs the algorithm lowconv's tuning picked)
     lowconv untuned  lowconv's binding with cuSPARSELt's default algorithm (no tuning)
     lowconv, x^T     the lowconv module on a column-major x (what an earlier lowconv layer hands on)
     lowconv auto     backend = "auto": the module's own choice (in the notes) and its time
   Host time per call (wall clock of back-to-back calls, no sync) of torch 2:4 and lowconv at
   the decode shape, where the calls are host-bound.
   Every output is checked against float64 of the masked product (first REFERENCE_ROWS rows)
   before it is timed.
2. Training step, forward and the gradients of x and W (fixed mask), fp16 and bf16: dense
   F.linear(x, W * mask) vs lowconv's fixed-mask training module with backend = "cusparselt"
   (transposable mask: dX through the 2:4 GEMM of W^T; not transposable: dX dense); dW dense.
3. Prune + compress of one weight: lowconv's magnitude mask (and its transposable variant),
   the bitmask checkpoint format, cuSPARSELt's compression, lowconv's fixed-mask compression
   (the copy of the kept values a training step runs); torch's _cslt_compress and
   _sparse_semi_structured_tile (which ranks by signed value by default) beside them.
4. End to end: ViT-L-sized MLP blocks (LayerNorm, fc1 1024->4096, GELU, fc2, residual) on 13008
   tokens, dense vs lowconv.convert (semi_sparse, backend auto) for inference, and one training
   step (training = true, transposable = true).
5. The issue's targets, met / NOT met from this run's numbers.

Times are medians of triton.testing.do_bench (scripts/bench_common.py); forward and training
take the median of --rounds such medians, the peers of a shape interleaved round by round.
Writes DIR/bench_semi_sparse.md and .json after every measurement, so a run cut short leaves
its results.

    PYTHONPATH=. python3 scripts/bench_semi_sparse.py --out DIR [--quick] [--budget-s 280]
    python3 scripts/bench_semi_sparse.py --out DIR --device cpu --quick --tiny   # plumbing only
"""
import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

import lowconv  # noqa: E402
from lowconv.kernels import cusparselt, cusparselt_library  # noqa: E402
from lowconv.kernels.pack24 import kept_codes, pack_kept_reference  # noqa: E402
from lowconv.kernels.sparse24 import (  # noqa: E402
    compress_bitmask, kept_to_dense, mask_24, mask_24_transposable, prune_24,
)
from lowconv.ops.semi_sparse import CompressedSemiSparseLinear, MaskedSemiSparseLinear  # noqa: E402
from lowconv.recipe import parse_recipe  # noqa: E402
from lowconv.kernels.cuda_timing import captured  # noqa: E402
from scripts.bench_common import (BudgetedRun, Shape, add_rounds_argument, add_run_arguments, first_line,  # noqa: E402
                                  host_ms, measure, no_grad_call, run_device, run_header, status_cell, train_call,
                                  write_outputs)

NAME = "bench_semi_sparse"


ISSUE_SHAPES = [Shape("ViT-L fc1", 13008, 1024, 4096), Shape("ViT-L fc2", 13008, 4096, 1024),
                Shape("square", 8192, 8192, 8192), Shape("decode", 16, 4096, 4096)]
MORE_SHAPES = [Shape("ViT-L fc1, 5x batch", 65536, 1024, 4096),
               Shape("Llama-8B gate/up", 8192, 4096, 14336), Shape("Llama-8B down", 8192, 14336, 4096),
               # bench_training.py's llama-2048 MLP (batch 4 x 1024 tokens)
               Shape("llama-2048 gate/up", 4096, 2048, 8192), Shape("llama-2048 down", 4096, 8192, 2048)]
TRAINING_SHAPE_NAMES = ("ViT-L fc1", "ViT-L fc2", "square")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FORWARD_PEERS = ("dense", "torch 2:4", "graph replay", "graph + copies", "lowconv", "lowconv untuned", "lowconv, x^T",
                 "lowconv auto")
HOST_CALLS = 200
TRAINING_PEERS = ("dense", "lowconv transposable", "lowconv", "dense, graph", "lowconv transposable, graph",
                  "lowconv, graph")
GRADIENTS = ("out", "dx", "dw")
PRUNE_SHAPES = [(4096, 1024), (14336, 4096), (8192, 2048), (2048, 8192)]
MLP_WIDTH, MLP_HIDDEN, MLP_BLOCKS, MLP_BATCH, MLP_TOKENS = 1024, 4096, 4, 16, 813  # 13008 tokens
TINY_DIVISOR = 64
REFERENCE_ROWS = 1024
CHILD_TIMEOUT_S = 120
# fp32 accumulation and one rounding to a 16-bit type: relative error ~1e-3 (fp16), ~8e-3 (bf16)
GATE_RELATIVE_ERROR = {"fp16": 5e-3, "bf16": 2e-2}
SPEED_TARGETS = (  # (section, shape dims, min speedup over dense, "" or ", graph"): issue 5
    ("forward", (13008, 1024, 4096), 1.15, ""), ("forward", (13008, 4096, 1024), 1.15, ""),
    ("forward", (8192, 8192, 8192), 1.4, ""),
    ("training", (13008, 1024, 4096), 1.1, ""), ("training", (13008, 4096, 1024), 1.1, ""),
    ("training", (13008, 1024, 4096), 1.1, ", graph"), ("training", (13008, 4096, 1024), 1.1, ", graph"),
)

ANCHORS_MARKDOWN = """\
| shape (fp16) | dense | `_cslt_sparse_mm` eager | same, CUDA-graph replay | host time per eager call |
|---|---|---|---|---|
| 13008, 1024, 4096 | 0.150 ms | 0.870 ms | 0.134 ms | 0.96 ms |
| 13008, 4096, 1024 | 0.155 ms | 0.907 ms | 0.125 ms | 0.93 ms |
| 16, 4096, 4096 | 0.024 ms | 0.437 ms | 0.035 ms | 0.47 ms |
| 8192, 8192, 8192 | 1.62 ms | 1.11 ms (1.46x) | | |
| 32768, 4096, 14336 | 5.98 ms | 3.97 ms (1.51x, alg search) | | |
"""


@dataclass
class Result:
    section: str  # "forward" | "training" | "prune" | "mlp"
    case: str
    peer: str
    dims: tuple = ()
    dtype: str = ""
    status: str = "ok"  # ok | fails | skipped
    error: str = ""
    ms: float | None = None  # forward and training: the median of rounds_ms
    rounds_ms: list = field(default_factory=list)  # each do_bench median, the peers interleaved by round
    workspace_mb: float | None = None
    first_call_s: float | None = None
    rel_error: dict = field(default_factory=dict)  # output name -> ||got - ref|| / ||ref|| vs float64
    note: str = ""


# ---------------------------------------------------------------------------------------------
# 0. Checks in child processes


def header_check() -> dict:
    """Struct sizes and enum values in the cusparseLt.h (and cusparse.h) beside the library,
    against the constants of lowconv.kernels.cusparselt."""
    lib = cusparselt_library.library()
    found = {"library": lib.path, "version": lib.version(torch.device("cuda"))}
    root = Path(lib.path).resolve().parent.parent
    headers = {name: next(iter(sorted(root.parent.glob(f"*/include/{name}")) + sorted(root.glob(f"include/{name}"))),
                          None) for name in ("cusparseLt.h", "cusparse.h")}
    found["headers"] = {name: str(path) for name, path in headers.items() if path}
    expected = {"CUSPARSE_COMPUTE_32F": cusparselt_library.COMPUTE_32F,
                "CUSPARSELT_MATMUL_BIAS_POINTER": cusparselt_library.MATMUL_BIAS_POINTER,
                "CUSPARSELT_SPARSITY_50_PERCENT": cusparselt_library.SPARSITY_50_PERCENT,
                "CUSPARSELT_MATMUL_ALG_DEFAULT": cusparselt_library.MATMUL_ALG_DEFAULT,
                "CUSPARSELT_MATMUL_ALG_CONFIG_ID": cusparselt_library.ALG_CONFIG_ID,
                "CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID": cusparselt_library.ALG_CONFIG_MAX_ID,
                "CUSPARSELT_MATMUL_SPLIT_K": cusparselt_library.ALG_SPLIT_K,
                "CUSPARSELT_MATMUL_SPLIT_K_MODE": cusparselt_library.ALG_SPLIT_K_MODE,
                "CUSPARSELT_MATMUL_SPLIT_K_BUFFERS": cusparselt_library.ALG_SPLIT_K_BUFFERS,
                "CUSPARSE_ORDER_ROW": cusparselt_library.ORDER_ROW,
                "CUSPARSE_OPERATION_NON_TRANSPOSE": cusparselt_library.OP_NON_TRANSPOSE,
                "CUSPARSE_OPERATION_TRANSPOSE": cusparselt_library.OP_TRANSPOSE}
    values, sizes = {}, {}
    for path in headers.values():
        if path:
            text = path.read_text(errors="replace")
            values.update(enum_values(text))
            sizes.update({name: int(n) for n, name in re.findall(r"uint8_t\s+data\[(\d+)\];\s*}\s*(\w+)\s*;", text)})
    found["struct_bytes"] = sizes
    found["too_small"] = [name for name, n in sizes.items() if n > cusparselt_library.STRUCT_BYTES]
    found["enums"] = {name: values.get(name) for name in expected}
    found["mismatches"] = [f"{name}: header {values[name]}, binding {value}" for name, value in expected.items()
                           if name in values and values[name] != value]
    found["not_in_headers"] = [name for name in expected if name not in values]
    return found


def enum_values(text: str) -> dict:
    """name -> value of every enumerator in C source text (implicit values counted up)."""
    values = {}
    for body in re.findall(r"typedef\s+enum\s*\w*\s*{([^}]*)}", re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)):
        nxt = 0
        for item in filter(None, (part.strip() for part in body.split(","))):
            name, _, value = (part.strip() for part in item.partition("="))
            try:
                nxt = int(value, 0) if value else nxt
            except ValueError:
                nxt = values.get(value, nxt)
            values[name] = nxt
            nxt += 1
    return values


def transpose_result_check() -> dict:
    """torch._cslt_sparse_mm with transpose_result=True (D column-major: y contiguous) against
    False (D row-major: y^T): error vs float64, then fp16 kernel times at the ViT-L shapes, each
    call replayed in a CUDA graph (torch's eager call would time its per-call plan instead)."""
    import triton.testing
    x, w = random_operands(Shape("", 256, 128, 64), torch.device("cuda"), torch.float16, 0)
    y = torch._cslt_sparse_mm(torch._cslt_compress(w), x.t(), transpose_result=True)
    found = {"relative_error": relative_error(y.reshape(256, 64), x.double() @ w.double().t()), "ms": {}}
    for shape in ISSUE_SHAPES[:2]:
        x, w = random_operands(shape, torch.device("cuda"), torch.float16, 0)
        compressed = torch._cslt_compress(w)
        for transpose in (False, True):
            torch._cslt_sparse_mm(compressed, x.t(), transpose_result=transpose)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch._cslt_sparse_mm(compressed, x.t(), transpose_result=transpose)
            found["ms"][f"{shape.label()} transpose_result={transpose}"] = triton.testing.do_bench(
                graph.replay, warmup=25, rep=100, return_mode="median")
    return found


CHECKS = {"header": header_check, "transpose_result": transpose_result_check}


def run_check_child(name: str) -> None:
    print("RESULT " + json.dumps(CHECKS[name](), default=str))


def isolated_check(name: str) -> dict:
    """CHECKS[name] in a child process: its result, or how it died."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    try:
        child = subprocess.run([sys.executable, __file__, "--check", name, "--out", "."], capture_output=True,
                               text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode == 0 and lines:
        return {"status": "ok", **json.loads(lines[-1][len("RESULT "):])}
    died = f"signal {-child.returncode}" if child.returncode < 0 else f"exit code {child.returncode}"
    return {"status": f"crashed ({died})", "stderr_tail": child.stderr[-1500:]}


# ---------------------------------------------------------------------------------------------
# 1-4. Measurements


def random_operands(shape, device, dtype, seed):
    """x ~ N(0, 1) (M, K) and W (N, K) ~ N(0, 1/K) pruned 2:4 by magnitude."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.m, shape.k, generator=gen, device=device).to(dtype)
    w = (torch.randn(shape.n, shape.k, generator=gen, device=device) * shape.k ** -0.5).to(dtype)
    return x, prune_24(w)


def relative_error(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def semi_sparse_recipe(options):
    return parse_recipe(f'name = "bench"\n[[rules]]\nkind = "linear"\nop = "semi_sparse"\noptions = {{ {options} }}\n',
                        f"{NAME}: semi_sparse {options}")


def lowconv_layer(options, w, x, cls):
    """The op module lowconv.convert makes of a one-Linear model with weight w, bias-free."""
    model = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype))
    with torch.no_grad():
        model[0].weight.copy_(w)
    converted = lowconv.convert(model, semi_sparse_recipe(options), (x,))
    [layer] = [m for m in converted.modules() if isinstance(m, cls)]
    return layer


def forward_builders():
    """Peer -> build(x, w) -> (call, note); w is already pruned."""
    def dense(x, w):
        return (lambda: F.linear(x, w)), ""

    def torch_24(x, w):
        sparse = torch.sparse.to_sparse_semi_structured(w)
        return (lambda: F.linear(x, sparse)), type(sparse).__name__

    def graph(copies):
        def build(x, w):
            compressed = torch._cslt_compress(w)
            static_x = x.clone()
            torch._cslt_sparse_mm(compressed, static_x.t())
            torch.cuda.synchronize()
            replay = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replay):
                static_out = torch._cslt_sparse_mm(compressed, static_x.t())

            def call():
                if copies:
                    static_x.copy_(x)
                replay.replay()
                return static_out.t().clone() if copies else static_out.t()
            return call, ""
        return build

    def lowconv_untuned(x, w):
        weight = cusparselt.SparseWeight(w)
        return (lambda: weight.linear(x, None)), ""

    def lowconv_column_major(x, w):
        layer = lowconv_layer('backend = "cusparselt"', w, x, CompressedSemiSparseLinear)
        x_t = x.t().contiguous().t()
        return (lambda: layer(x_t)), ""

    def lowconv_peer(backend):
        def build(x, w):
            layer = lowconv_layer(f'backend = "{backend}"', w, x, CompressedSemiSparseLinear)
            choice = layer.choice
            note = "" if backend != "auto" else f"{choice.backend}: {choice.reason}" if choice else "not on CUDA"
            return (lambda: layer(x)), note
        return build

    return {"dense": dense, "torch 2:4": torch_24, "graph replay": graph(False), "graph + copies": graph(True),
            "lowconv": lowconv_peer("cusparselt"), "lowconv untuned": lowconv_untuned,
            "lowconv, x^T": lowconv_column_major,
            "lowconv auto": lowconv_peer("auto")}


def training_builders(device):
    """Peer -> build(x, w) -> (layer(x) -> y, weight leaf, mask, to_dense); the weight starts as w,
    to_dense maps the leaf, or its gradient, to the dense (N, K) tensor (lowconv's leaf is the kept
    values). On CUDA each peer also as ", graph": its step captured in a CUDA graph and replayed (GPU
    time alone, where the eager step is host-bound)."""
    def dense(x, w):
        mask = mask_24(w)
        weight = (w * mask).requires_grad_()
        return (lambda t: F.linear(t, weight * mask)), weight, mask, (lambda t: t)

    def lowconv_peer(transposable):
        def build(x, w):
            options = f'backend = "cusparselt", training = true, transposable = {str(transposable).lower()}'
            layer = lowconv_layer(options, w, x, MaskedSemiSparseLinear).train()
            return layer, layer.weight, layer.mask, (lambda t: kept_to_dense(t, layer.mask))
        return build

    builders = {"dense": dense, "lowconv transposable": lowconv_peer(True), "lowconv": lowconv_peer(False)}
    if device.type == "cuda":
        builders.update({f"{peer}, graph": build for peer, build in list(builders.items())})
    return builders


def graphed(call):
    """call() captured in a CUDA graph (lowconv.kernels.cuda_timing.captured): the replay, returning the
    captured outputs."""
    graph, outputs = captured(call)

    def replay():
        graph.replay()
        return outputs
    return replay


def mlp_stack(width, hidden, blocks):
    return nn.Sequential(*(MlpBlock(width, hidden) for _ in range(blocks)))


class MlpBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


MLP_RULE = '[[rules]]\nkind = "linear"\nmodules = ["re:.*fc[12]"]\nop = "semi_sparse"\noptions = {{ {} }}\n'


class Run(BudgetedRun):
    """The results so far, the budget, and whether CUDA still works; rewrites the report."""

    def __init__(self, args, device, header, settings):
        super().__init__(args, device)
        self.header, self.settings = header, settings
        self.results: list[Result] = []
        self.checks: dict = {}

    def unit(self, result, work):
        super().unit(result, work, result_line)

    def write(self, final=False):
        return write_report(self, final)

    def timed(self, fn):
        return measure(fn, self.device, self.args.warmup_ms, self.args.rep_ms)

    def run_checks(self):
        for name in CHECKS:
            if self.device.type != "cuda":
                self.checks[name] = {"status": "skipped (no CUDA)"}
                continue
            self.checks[name] = isolated_check(name)
            self.log(f"check {name}: {json.dumps(self.checks[name], default=str)[:400]}")
            self.write()

    def forward_shape(self, shape, dtype_name):
        dtype = DTYPES[dtype_name]
        x, w = random_operands(shape, self.device, dtype, self.args.seed)
        rows = min(REFERENCE_ROWS, shape.m)
        reference = None if self.blocked() else x[:rows].double() @ w.double().t()
        queued = []
        for peer, build in forward_builders().items():
            result = Result("forward", f"{shape.label()} {dtype_name}", peer, shape.dims, dtype_name)

            def work():
                call, note = build(x, w)
                with torch.no_grad():
                    error = {"out": relative_error(call()[:rows], reference)}
                return {"rel_error": error, "note": note, **self.first_round(no_grad_call(call), result, queued)}
            self.unit(result, work)
        self.interleaved_rounds(queued)

    def training_shape(self, shape, dtype_name):
        dtype = DTYPES[dtype_name]
        x, w = random_operands(shape, self.device, dtype, self.args.seed)
        w = (torch.randn(w.shape, device=w.device) * shape.k ** -0.5).to(dtype)  # dense: each peer prunes its way
        grad_out = torch.randn(shape.m, shape.n, device=self.device).to(dtype)
        rows = min(REFERENCE_ROWS, shape.m)
        queued = []
        for peer, build in training_builders(self.device).items():
            result = Result("training", f"{shape.label()} {dtype_name}", peer, shape.dims, dtype_name)

            def work():
                layer, weight, mask, to_dense = build(x, w)
                call = train_call(layer, weight, x, grad_out)
                if peer.endswith(", graph"):
                    call = graphed(call)
                got = dict(zip(GRADIENTS, call()))
                got["dw"] = to_dense(got["dw"])
                ref = training_reference(x, to_dense(weight.detach()), mask, grad_out, rows)
                error = {"out": relative_error(got["out"][:rows], ref["out"]),
                         "dx": relative_error(got["dx"][:rows], ref["dx"]),
                         "dw": relative_error(got["dw"][:rows], ref["dw"])}
                error["dw off-mask nonzero"] = int((got["dw"][~mask] != 0).sum())
                del got, ref
                return {"rel_error": error, "note": compression_note(layer), **self.first_round(call, result, queued)}
            self.unit(result, work)
        self.interleaved_rounds(queued)

    def host_time(self, shape):
        """Wall-clock ms per call of back-to-back calls without a sync: the host's cost per call
        where the GPU work is short."""
        x, w = random_operands(shape, self.device, torch.float16, self.args.seed)
        builders = forward_builders()
        for peer in ("dense", "torch 2:4", "lowconv"):
            def work():
                return {"ms": host_ms(no_grad_call(builders[peer](x, w)[0]), HOST_CALLS)}
            self.unit(Result("host", f"{shape.label()} fp16", peer, shape.dims, "fp16"), work)

    def prune_shape(self, rows, cols):
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        w = torch.randn(rows, cols, generator=gen, device=self.device).to(torch.float16)
        pruned = prune_24(w)
        calls = {"lowconv mask_24 + prune": lambda: prune_24(w),
                 "lowconv transposable mask": lambda: mask_24_transposable(w),
                 "bitmask format (checkpoint)": lambda: compress_bitmask(pruned)}
        notes = {}
        if self.device.type == "cuda":
            gemm = cusparselt.SparseGemm(rows, cols, torch.float16, self.device)
            transposable = w * mask_24_transposable(w)
            try:
                matches = tile_compression_matches(rows, cols, torch.float16, self.device)
            except RuntimeError as error:
                matches = f"not checked ({first_line(error)})"
            tile = f"torch _sparse_semi_structured_tile {TILE_ALGORITHM}, cuSPARSELt layout (W and W^T)"
            mask = mask_24(w)
            fixed_mask = cusparselt.FixedMaskCompression(gemm, mask)
            kept = pack_kept_reference(w, kept_codes(mask))
            copy = "lowconv fixed-mask compression (a copy of the kept values)"
            if not fixed_mask.gathers:
                notes[copy] = "fell back to cuSPARSELt's compression (unknown layout)"
            calls.update({"lowconv cuSPARSELt compress": lambda: gemm.compress(pruned),
                          copy: lambda: fixed_mask.compress_kept(kept),
                          "torch _cslt_compress": lambda: torch._cslt_compress(pruned),
                          "torch _sparse_semi_structured_tile (default algorithm)":
                              lambda: torch._sparse_semi_structured_tile(w),
                          tile: lambda: torch._sparse_semi_structured_tile(transposable, algorithm=TILE_ALGORITHM,
                                                                           use_cutlass=False)})
            notes[tile] = f"same bytes as cuSPARSELt's compression: {matches}"
        for peer, call in calls.items():
            self.unit(Result("prune", f"{rows}x{cols} fp16", peer, (rows, cols), "fp16"),
                      lambda: {"note": notes.get(peer, ""), **self.timed(call)})

    def mlp(self, width, hidden, blocks, tokens):
        torch.manual_seed(self.args.seed)
        model = mlp_stack(width, hidden, blocks).to(self.device, torch.float16)
        x = torch.randn(*tokens, width, device=self.device, dtype=torch.float16)
        case = f"{blocks} blocks {width}->{hidden}->{width}, {tokens[0]}x{tokens[1]} tokens fp16"
        options = {"inference": 'backend = "auto"', "training": 'backend = "auto", training = true, transposable = true'}
        for mode, option in options.items():
            converted = None

            def work_dense():
                call = mlp_call(model, x, mode)
                return self.timed(call)

            def work_lowconv():
                nonlocal converted
                converted = lowconv.convert(model, parse_recipe(MLP_RULE.format(option), "mlp"), (x,))
                choices = sorted({f"{m.choice.backend}" for m in converted.modules() if getattr(m, "choice", None)})
                reference = lowconv.revert(converted).double()
                with torch.no_grad():
                    error = {"out": relative_error(converted(x), reference(x.double()))}
                return {"rel_error": error, "note": f"backends: {', '.join(choices)}",
                        **self.timed(mlp_call(converted, x, mode))}

            self.unit(Result("mlp", f"{case} {mode}", "dense", (), "fp16"), work_dense)
            self.unit(Result("mlp", f"{case} {mode}", "lowconv", (), "fp16"), work_lowconv)
            del converted


def compression_note(layer):
    gemms = getattr(layer, "gemms", None)
    if gemms is None or gemms.mask is None:
        return ""
    how = "copied under the fixed mask" if all(c is None or c.gathers for c in gemms.compressions(layer.mask)) \
        else "compressed by cuSPARSELt"
    if gemms.backward is None:
        return f"W {how} every step; dX dense"
    return f"W and W^T {how} every step"


# Ranks each 4x4 tile's values by magnitude; torch's default ("") ranks by signed value.
TILE_ALGORITHM = "largest_abs_values_greedy"


def tile_compression_matches(n, k, dtype, device) -> bool:
    """Whether torch._sparse_semi_structured_tile, given a weight already pruned to a transposable
    2:4 mask, writes for W and W^T the bytes cuSPARSELt's own compression writes (its layout comes
    from kernels written for sm_80, xformers'): if so, training could compress with it."""
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=gen, device=device).to(dtype)
    w = w * mask_24_transposable(w)
    packed, _, packed_t, _, _ = torch._sparse_semi_structured_tile(w, algorithm=TILE_ALGORITHM, use_cutlass=False)
    return (same_bytes(packed, cusparselt.SparseGemm(n, k, dtype, device).compress(w))
            and same_bytes(packed_t, cusparselt.SparseGemm(k, n, dtype, device).compress(w.t())))


def same_bytes(packed, compressed) -> bool:
    flat = packed.contiguous().view(-1).view(torch.uint8)
    return flat.numel() >= compressed.numel() and torch.equal(flat[:compressed.numel()], compressed)


def training_reference(x, w_masked, mask, grad_out, rows):
    x64, w64, g64 = x.double(), w_masked.double(), grad_out.double()
    return {"out": x64[:rows] @ w64.t(), "dx": g64[:rows] @ w64, "dw": (g64[:, :rows].t() @ x64) * mask[:rows]}


def mlp_call(model, x, mode):
    if mode == "inference":
        return no_grad_call(lambda: model(x))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        out = model(x)
        return torch.autograd.grad(out.float().square().mean(), params)
    return step


# ---------------------------------------------------------------------------------------------
# The report


def result_line(result):
    if result.status != "ok":
        return f"{result.status}: {result.error}"
    errors = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in result.rel_error.items())
    return f"{result.ms:.4g} ms" + (f", rel. error {errors}" if errors else "") + \
        (f" ({result.note})" if result.note else "")


def find(run, section, peer, dims, dtype):
    return next((r for r in run.results if r.section == section and r.peer == peer and r.dims == dims
                 and r.dtype == dtype), None)


def cell(result, baseline, notes):
    status = status_cell(result, notes)
    if status is not None:
        return status
    if baseline is None or baseline.status != "ok" or baseline is result:
        return f"{result.ms:.4g}"
    return f"{result.ms:.4g} ({baseline.ms / result.ms:.2f}x)"


def error_cell(result, name="out"):
    if result is None or result.status != "ok" or name not in result.rel_error:
        return ""
    return f"{result.rel_error[name]:.1e}"


def gate_failures(run):
    bad = []
    for r in run.results:
        if r.status != "ok" or r.section in ("prune", "host"):
            continue
        for name, value in r.rel_error.items():
            if name == "dw off-mask nonzero":
                if value:
                    bad.append(f"{r.section} {r.case} {r.peer}: {value} off-mask dW entries nonzero")
            elif not value <= GATE_RELATIVE_ERROR.get(r.dtype, 2e-2):
                bad.append(f"{r.section} {r.case} {r.peer} {name}: relative error {value:.2e}")
    return bad


def verdicts(run):
    rows = []
    for dtype in DTYPES:
        for section, dims, target, graph in SPEED_TARGETS:
            peer = ("lowconv transposable" if section == "training" else "lowconv") + graph
            label = f"{section}{graph} {'x'.join(map(str, dims))} {dtype}: lowconv >= {target}x dense{graph}"
            ours, dense = find(run, section, peer, dims, dtype), find(run, section, "dense" + graph, dims, dtype)
            if not ours or not dense or ours.status != "ok" or dense.status != "ok":
                rows.append((label, "", "not measured"))
                continue
            speedup = dense.ms / ours.ms
            rows.append((label, f"{ours.ms:.4g} vs {dense.ms:.4g} ms: {speedup:.2f}x",
                         "met" if speedup >= target else "NOT met"))
    slower = [f"{r.case}: auto {r.ms:.4g} ms vs dense {d.ms:.4g} ms"
              for r in run.results if r.section == "forward" and r.peer == "lowconv auto" and r.status == "ok"
              and r.note.startswith("cusparselt") and (d := find(run, "forward", "dense", r.dims, r.dtype))
              and d.status == "ok" and r.ms > d.ms]
    autos = [r for r in run.results if r.peer == "lowconv auto" and r.status == "ok"]
    rows.append(("no shape where auto picked the 2:4 kernel runs slower than dense (forward)",
                 "; ".join(slower) or f"{len(autos)} shapes checked",
                 "not measured" if not autos else "NOT met" if slower else "met"))
    return rows


def markdown_report(run, header):
    notes = {}
    lines = ["# 2:4 semi-structured linear (issue 5): dense vs torch's 2:4 vs lowconv", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    bad = gate_failures(run)
    lines += [f"- float64 gate (relative error <= {GATE_RELATIVE_ERROR}): "
              + (f"FAILED: {'; '.join(bad[:4])}" if bad else "passed"), ""]
    lines += ["## Targets (issue 5)", "",
              tabulate([[f"[{'x' if v == 'met' else ' '}] {t}", m, v] for t, m, v in verdicts(run)],
                       headers=["target", "measured", "verdict"], tablefmt="github"), ""]
    lines += ["## 0. cuSPARSELt checks (each in a child process)", ""]
    lines += [f"- {name}: `{json.dumps(result, default=str)[:1200]}`" for name, result in run.checks.items()] + [""]

    for dtype in DTYPES:
        rows, errors = [], []
        for shape in run.settings["forward_shapes"]:
            dense = find(run, "forward", "dense", shape.dims, dtype)
            results = [find(run, "forward", peer, shape.dims, dtype) for peer in FORWARD_PEERS]
            rows.append([shape.name, shape.m, shape.k, shape.n, *(cell(r, dense, notes) for r in results)])
            errors.append([shape.name, *(error_cell(r) for r in results)])
        lines += [f"## 1. Forward, {dtype}: median ms (speedup vs dense)", "",
                  tabulate(rows, headers=["shape", "M", "K", "N", *FORWARD_PEERS], tablefmt="github"), "",
                  f"Relative error vs float64 of the masked product (first {REFERENCE_ROWS} rows):", "",
                  tabulate(errors, headers=["shape", *FORWARD_PEERS], tablefmt="github"), ""]
    autos = [r for r in run.results if r.peer == "lowconv auto" and r.status == "ok"]
    if autos:
        lines += ["lowconv auto's choices:", ""] + [f"- {r.case}: {r.note}" for r in autos] + [""]

    rows = []
    for dtype in DTYPES:
        for shape in run.settings["training_shapes"]:
            dense = {graph: find(run, "training", "dense" + graph, shape.dims, dtype) for graph in ("", ", graph")}
            results = [find(run, "training", peer, shape.dims, dtype) for peer in TRAINING_PEERS]
            rows.append([f"{shape.label()} {dtype}",
                         *(cell(r, dense[", graph" if p.endswith(", graph") else ""], notes)
                           for p, r in zip(TRAINING_PEERS, results)),
                         *(" / ".join(error_cell(r, g) for g in GRADIENTS) for r in results)])
    lines += ["## 2. Training step: forward + dX + dW, median ms (speedup vs dense)", "",
              "dense: F.linear(x, W * mask) under autograd. lowconv transposable / lowconv: MaskedSemiSparseLinear "
              "(training = true, backend = cusparselt) with and without a transposable mask; the forward on the 2:4 "
              "GEMM (weight compressed every step), dX on the 2:4 GEMM of W^T when transposable, dW dense. "
              "\", graph\": the same step captured in a CUDA graph and replayed, speedup vs dense's graph "
              "(GPU time without the host's).", "",
              tabulate(rows, headers=["case", *TRAINING_PEERS, *(f"{p} err out/dx/dw" for p in TRAINING_PEERS)],
                       tablefmt="github"), ""]
    compression = sorted({f"{r.peer}: {r.note}" for r in run.results if r.section == "training" and r.note})
    lines += [f"- {note}" for note in compression] + ([""] if compression else [])

    rows = [[r.case, r.peer, cell(r, None, notes)] for r in run.results if r.section == "host"]
    lines += [f"## 1b. Host time per call (wall clock of {HOST_CALLS} back-to-back calls, no sync), ms", "",
              tabulate(rows, headers=["case", "peer", "host ms per call"], tablefmt="github"), ""]
    rows = [[r.case, r.peer, cell(r, None, notes), r.note] for r in run.results if r.section == "prune"]
    lines += ["## 3. Prune + compress of one weight: median ms", "",
              tabulate(rows, headers=["weight", "step", "ms", "note"], tablefmt="github"), ""]

    rows = []
    for r in run.results:
        if r.section == "mlp" and r.peer == "lowconv":
            dense = next((d for d in run.results if d.section == "mlp" and d.case == r.case and d.peer == "dense"), None)
            rows.append([r.case, cell(dense, None, notes), cell(r, dense, notes), error_cell(r), r.note])
    lines += ["## 4. End to end: MLP blocks (LayerNorm, fc1, GELU, fc2, residual)", "",
              "lowconv: lowconv.convert with semi_sparse (backend auto) on fc1/fc2; inference under no_grad, "
              "training = forward + gradients of every parameter (training = true, transposable = true). "
              "Error: the converted model vs its lowconv.revert in float64.", "",
              tabulate(rows, headers=["case", "dense ms", "lowconv ms", "rel. error", "note"], tablefmt="github"), ""]
    if notes:
        lines += ["Failures:", ""] + [f"[{n}] {message}" for message, n in notes.items()] + [""]
    lines += ["## Bars from /work/shared/notes/h100-anchors.md (an earlier run, not this one)", "", ANCHORS_MARKDOWN]
    return "\n".join(lines)


def write_report(run, final=False):
    header = {**run.header, "elapsed": f"{run.elapsed():.0f} s" + ("" if final else " (still running)")}
    text = markdown_report(run, header)
    settings = {name: [asdict(s) for s in value] if name.endswith("_shapes") else value
                for name, value in run.settings.items()}
    data = {"header": header, "settings": settings, "checks": run.checks, "gate_failures": gate_failures(run),
            "results": [asdict(r) for r in run.results]}
    write_outputs(run.args.out, NAME, text, data)
    return text


def parse_args():
    parser = argparse.ArgumentParser(
        description="Time 2:4 semi-structured linears (issue 5): dense F.linear, torch's 2:4 and lowconv's "
                    "semi_sparse op, forward and training, after a float64 check of every output.")
    add_run_arguments(parser, name=NAME, quick_help="the issue's four GEMM shapes only, fp16 first",
                      tiny_help=f"every size divided by {TINY_DIVISOR}", cpu_help="the masked-dense reference",
                      budget_s=280.0, warmup_ms=25.0, rep_ms=100.0)
    parser.add_argument("--check", choices=sorted(CHECKS), help=argparse.SUPPRESS)  # a child's one check
    parser.add_argument("--parts", default="checks,forward,training,prune,mlp",
                        help="comma-separated parts to run (default: all)")
    add_rounds_argument(parser, "forward and training")
    return parser.parse_args()


def size(d, tiny):
    return max(32, round(d / TINY_DIVISOR / 32) * 32) if tiny else d


def resolve_settings(args):
    shapes = [Shape(s.name, *(size(d, args.tiny) for d in s.dims))
              for s in ISSUE_SHAPES + ([] if args.quick else MORE_SHAPES)]
    return {
        "tiny": args.tiny,
        "parts": args.parts.split(","),
        "forward_shapes": shapes,
        "training_shapes": [s for s in shapes if s.name in TRAINING_SHAPE_NAMES],
        "prune": [tuple(size(d, args.tiny) for d in p) for p in PRUNE_SHAPES],
        "mlp": (size(MLP_WIDTH, args.tiny), size(MLP_HIDDEN, args.tiny), MLP_BLOCKS,
                (2 if args.tiny else MLP_BATCH, size(MLP_TOKENS, args.tiny) if args.tiny else MLP_TOKENS)),
    }


def main():
    args = parse_args()
    if args.check:
        run_check_child(args.check)
        return
    device = run_device(args, NAME)
    settings = resolve_settings(args)
    version = cusparselt_library.library().version(device) if device.type == "cuda" else "n/a"
    run = Run(args, device, run_header(args, device, lowconv=lowconv.__version__, cusparselt=version), settings)
    parts = settings["parts"]
    if "checks" in parts:
        run.run_checks()
    # The targets' shapes first, then the rest, then the long tail of shapes.
    shapes = settings["forward_shapes"]
    if "forward" in parts:
        for shape in shapes[:len(ISSUE_SHAPES)]:
            for dtype in DTYPES:
                run.forward_shape(shape, dtype)
        if device.type == "cuda":
            run.host_time(next(s for s in shapes if s.name == "decode"))
    if "training" in parts:
        for shape in settings["training_shapes"]:
            for dtype in DTYPES:
                run.training_shape(shape, dtype)
    if "mlp" in parts:
        run.mlp(*settings["mlp"])
    if "prune" in parts:
        for rows, cols in settings["prune"]:
            run.prune_shape(rows, cols)
    if "forward" in parts:
        for shape in shapes[len(ISSUE_SHAPES):]:
            for dtype in DTYPES:
                run.forward_shape(shape, dtype)
    print(run.write(final=True))
    if gate_failures(run):
        sys.exit(f"{NAME}: FLOAT64 GATE FAILED: {'; '.join(gate_failures(run)[:4])}")


if __name__ == "__main__":
    main()
