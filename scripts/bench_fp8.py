#!/usr/bin/env python3
"""FP8 linear (issue 4): lowconv's fp8 op against bf16 and hand-written FP8, in one run.

1. GEMM level, y = x W^T (no bias), bf16 x (M, K) and W (N, K), at the ViT-L MLP shapes, 8192^3,
   a 16-row decode GEMM and the Llama-8B MLP shapes (prefill M = 8192 and decode M = 16).
   Forward peers, each called under no_grad:
     bf16            F.linear (the baseline)
     fp8 GEMM alone  torch._scaled_mm on an x quantized outside the timed call: the floor, not a layer
     eager fp8       what users write by hand: amax, divide, saturating cast of x in torch ops, then
                     torch._scaled_mm (fast accum) with W quantized beforehand
     lowconv tensor  the Fp8Linear that lowconv.convert builds from a one-Linear model with the
     lowconv row     built-in recipes fp8-dynamic, fp8-row and fp8-static (the static scale
     lowconv static  calibrated by convert on the same x); fast_accum on, their default
   Training (forward + the gradients of x and W) at the ViT-L MLP shapes and 8192^3: bf16 F.linear
   against lowconv's fp8 training op (dynamic tensor scaling, e5m2 gradients).
   Before timing, every peer's output (and gradients) is checked against float64 on the same
   inputs: SQNR over the first REFERENCE_ROWS rows of each output (the float64 reference is
   computed once per shape, on those rows only, to bound its time and memory).
2. Activation quantization alone on the ViT-L fc2 and fc1 inputs, (13008, 4096) and (13008, 1024)
   bf16 x -> e4m3: lowconv.kernels.fp8's quantize_tensorwise, quantize_rowwise and
   quantize_with_scale, with the bandwidth they achieve (bytes of x read once plus bytes of x_fp8
   and scales written once, over the median time) next to a device-to-device copy of the same x
   measured in the same run.
3. Weight memory of a ViT-L-sized MLP stack (4 blocks of Linear(1024, 4096), GELU,
   Linear(4096, 1024), bf16) converted with the built-in fp8-dynamic recipe: memory_allocated,
   the bytes of its parameters and buffers, and its lowconv.save checkpoint against the bf16
   model's state dict in safetensors; and lowconv.compare's output SQNR.
4. The issue's targets as a checklist, met / NOT met from this run's numbers.

Times are medians of triton.testing.do_bench (L2 flushed between calls); workspace memory is the
peak allocated during a call beyond the memory before it and the tensors it returns.
Writes DIR/bench_fp8.md and .json, rewritten after every measurement, so a run cut short still
leaves its results; measurements past --budget-s are marked "skipped (time budget)".

    PYTHONPATH=. python3 scripts/bench_fp8.py --out DIR [--quick]
    python3 scripts/bench_fp8.py --out DIR --device cpu --quick --tiny   # plumbing only
"""
import argparse
import gc
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

import lowconv  # noqa: E402
from scripts.bench_common import (BudgetedRun, Shape, add_rounds_argument, add_run_arguments,  # noqa: E402
                                  no_grad_call, run_device, run_header, status_cell, train_call, write_outputs)
from lowconv.kernels.fp8 import (  # noqa: E402
    E4M3, FP8_MAX, dequantize, quantize_rowwise, quantize_tensorwise, quantize_with_scale,
)
from lowconv.ops.fp8 import Fp8Linear  # noqa: E402
from lowconv.recipe import parse_recipe  # noqa: E402
from lowconv.report import tensor_metrics  # noqa: E402


ISSUE_SHAPES = [Shape("ViT-L fc1", 13008, 1024, 4096), Shape("ViT-L fc2", 13008, 4096, 1024),
                Shape("square", 8192, 8192, 8192), Shape("square, decode", 16, 8192, 8192)]
LLAMA_SHAPES = [Shape(f"Llama-8B {name}{suffix}", m, k, n)
                for m, suffix in ((8192, ""), (16, ", decode"))
                for name, k, n in (("gate/up", 4096, 14336), ("down", 14336, 4096),
                                   ("gate+up fused", 4096, 28672))]
TRAINING_SHAPE_NAMES = ("ViT-L fc1", "ViT-L fc2", "square")
# The ViT-L fc2 input (106 MB in bf16: more than the H100's 50 MB L2, so the per-tensor quantizer's
# second read of x comes from HBM) and the fc1 input (27 MB: its second read can hit L2).
QUANT_SHAPES = [(13008, 4096), (13008, 1024)]
MLP_WIDTH, MLP_HIDDEN, MLP_BLOCKS = 1024, 4096, 4
MLP_BATCH, MLP_TOKENS = 16, 813  # 13008 tokens, as the ViT-L GEMM shapes
TINY_DIVISOR = 64  # --tiny divides every size by this (multiples of 16, at least 16)
REFERENCE_ROWS = 1024
E4M3_MAX = FP8_MAX[E4M3]
BF16 = torch.bfloat16
LOWCONV_RECIPES = {"lowconv tensor": "fp8-dynamic", "lowconv row": "fp8-row", "lowconv static": "fp8-static"}
FORWARD_PEERS = ("bf16", "fp8 GEMM alone", "eager fp8", *LOWCONV_RECIPES)
TRAINING_RECIPE = parse_recipe("""\
name = "fp8-training"
description = "FP8 training on every linear: dynamic tensor scales, e4m3 forward, e5m2 gradients"

[[rules]]
kind = "linear"
op = "fp8"
options = { scaling = "dynamic", granularity = "tensor", training = true }
""", "bench_fp8.py: fp8-training")
TRAINING_PEERS = ("bf16", "lowconv fp8 training")
GRADIENTS = ("out", "dx", "dw")
QUANT_PEERS = ("copy", "cast alone", "eager quantize", "quantize_tensorwise", "quantize_rowwise",
               "quantize_with_scale")
# A broken FP8 path lands near 0 dB; e4m3 rounding alone gives about 28 dB on random data,
# e5m2 about 22 dB. Below these the timings of lowconv's op mean nothing.
GATE_FORWARD_SQNR_DB = 20.0
GATE_GRADIENT_SQNR_DB = 15.0
GATE_LISTED = 3  # failures named in the report's gate line (the json has them all)
MEMORY_TARGET = 0.52
QUANT_TARGET = 0.75
SPEED_TARGETS = (  # (dims, min speedup over bf16, max ms): issue 4, from the anchors' bf16 times
    ((8192, 8192, 8192), 1.45, 1.15),
    ((13008, 1024, 4096), 1.25, 0.135),
)

# Copied from /work/shared/notes/h100-anchors.md, section "Dense and FP8 GEMMs" (measured there
# 2026-11-22 on an H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0).
ANCHORS_MARKDOWN = """\
| shape | fp16 F.linear | bf16 F.linear | fp8 `_scaled_mm` tensorwise | + fast accum | fp8 rowwise | fp8 with eager dynamic quant of x |
|---|---|---|---|---|---|---|
| 13008, 1024, 4096 | 0.149 ms | 0.169 ms | 0.103 ms | 0.096 ms | 0.099 ms | 0.209 ms |
| 13008, 4096, 1024 | 0.157 ms | 0.160 ms | 0.089 ms | 0.087 ms | 0.086 ms | 0.475 ms |
| 8192, 8192, 8192 | 1.65 ms | 1.67 ms | 0.914 ms | 0.882 ms | 0.912 ms | 1.33 ms |
| 16, 8192, 8192 | | 0.061 ms | 0.036 ms | 0.036 ms | 0.039 ms | 0.081 ms |

- fp8 tensorwise relative error vs float64: 3.75e-2 on N(0,1) data.
"""


@dataclass
class Result:
    """One unit of the run: a peer on a shape (or on the quantization input), measured or not."""
    section: str  # "forward" | "training" | "quantize"
    case: str  # the shape's label, or the quantized tensor's shape
    peer: str
    dims: tuple = ()
    status: str = "ok"  # ok | fails | skipped
    error: str = ""
    ms: float | None = None  # the median of rounds_ms
    rounds_ms: list = field(default_factory=list)  # each do_bench median, the peers interleaved by round
    workspace_mb: float | None = None  # None: not measured (CPU)
    first_call_s: float | None = None
    sqnr_db: dict = field(default_factory=dict)  # output name -> SQNR (dB) vs float64
    bytes_moved: int | None = None  # quantize: bytes read once plus bytes written once


@dataclass
class WeightMemory:
    """Part 3. MB are 1e6 bytes; allocated is None off CUDA."""
    status: str = "not run"
    error: str = ""
    model: str = ""
    bf16_allocated_mb: float | None = None
    fp8_allocated_mb: float | None = None
    bf16_tensor_mb: float | None = None
    fp8_tensor_mb: float | None = None
    bf16_file_mb: float | None = None
    fp8_file_mb: float | None = None
    output_sqnr_db: float | None = None  # lowconv.compare: converted vs the bf16 model
    gate: str = ""
    bf16_forward_ms: float | None = None  # lowconv.compare's timing (CUDA only)
    fp8_forward_ms: float | None = None

    def ratios(self):
        pairs = {"memory_allocated": (self.fp8_allocated_mb, self.bf16_allocated_mb),
                 "parameters + buffers": (self.fp8_tensor_mb, self.bf16_tensor_mb),
                 "checkpoint file": (self.fp8_file_mb, self.bf16_file_mb)}
        return {name: fp8 / bf16 for name, (fp8, bf16) in pairs.items() if fp8 is not None and bf16}


def size(d, tiny):
    """A size as run: divided by TINY_DIVISOR under --tiny (a multiple of 16, at least 16)."""
    return max(16, round(d / TINY_DIVISOR / 16) * 16) if tiny else d


def scaled(shape, tiny):
    return Shape(shape.name, *(size(d, tiny) for d in shape.dims))


def random_operands(shape, device, seed):
    """x ~ N(0, 1) (M, K), W ~ N(0, 1/K) (N, K) and a grad_out ~ N(0, 1) (M, N), all bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*dims, std=1.0):
        return (torch.randn(dims, generator=gen, device=device) * std).to(BF16)

    return randn(shape.m, shape.k), randn(shape.n, shape.k, std=shape.k ** -0.5), randn(shape.m, shape.n)


def eager_quantize(t):
    """The hand-written dynamic quantization: amax, divide, saturating cast; a float32 dequant scale."""
    scale = t.abs().amax().float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def scaled_mm(x_fp8, x_scale, w_fp8, w_scale):
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=BF16,
                            use_fast_accum=True)


def lowconv_layer(recipe, w, x):
    """The op module lowconv.convert makes of a one-Linear model with weight w (bias-free),
    x its example inputs (and calibration data, for static scales)."""
    model = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype))
    with torch.no_grad():
        model[0].weight.copy_(w)
    converted = lowconv.convert(model, recipe, (x,))
    layers = [m for m in converted.modules() if isinstance(m, Fp8Linear)]
    if len(layers) != 1:
        raise RuntimeError(f"lowconv.convert made {len(layers)} Fp8Linear modules of a one-Linear model")
    return layers[0]


def forward_builders():
    """Peer -> build(x, w) -> a call computing y = x W^T its way (W prepared outside the call)."""
    def bf16(x, w):
        return lambda: F.linear(x, w)

    def gemm_alone(x, w):
        (x_fp8, x_scale), (w_fp8, w_scale) = eager_quantize(x), eager_quantize(w)
        return lambda: scaled_mm(x_fp8, x_scale, w_fp8, w_scale)

    def eager(x, w):
        w_fp8, w_scale = eager_quantize(w)
        return lambda: scaled_mm(*eager_quantize(x), w_fp8, w_scale)

    def lowconv_peer(recipe):
        def build(x, w):
            layer = lowconv_layer(recipe, w, x).eval()
            return lambda: layer(x)
        return build

    return {"bf16": bf16, "fp8 GEMM alone": gemm_alone, "eager fp8": eager,
            **{peer: lowconv_peer(recipe) for peer, recipe in LOWCONV_RECIPES.items()}}


def training_builders():
    """Peer -> build(x, w) -> (layer, its weight leaf); the weight starts as a copy of w."""
    def bf16(x, w):
        weight = w.detach().clone().requires_grad_()
        return (lambda t: F.linear(t, weight)), weight

    def fp8(x, w):
        layer = lowconv_layer(TRAINING_RECIPE, w, x).train()
        return layer, layer.weight

    return {"bf16": bf16, "lowconv fp8 training": fp8}


def reference_rows(shape):
    return min(REFERENCE_ROWS, shape.m), min(REFERENCE_ROWS, shape.n)


def forward_reference(x, w, rows):
    return x[:rows].double() @ w.double().t()


def training_reference(x, w, grad_out, rows, w_rows):
    """float64 out and dX on their first `rows` rows, dW on its first `w_rows` rows."""
    x64, w64 = x.double(), w.double()
    g64 = grad_out.double()
    return {"out": x64[:rows] @ w64.t(), "dx": g64[:rows] @ w64, "dw": g64[:, :w_rows].t() @ x64}


def sqnr_db(ref, got):
    return tensor_metrics(ref, got).sqnr_db


def warm_gemm_workspaces(device):
    """Run a bf16 and an FP8 GEMM once: cuBLAS and cuBLASLt keep their workspaces in PyTorch's
    allocator from their first call on, and neither side of the weight comparison should count them."""
    a = torch.ones(32, 32, device=device, dtype=BF16)
    F.linear(a, a)
    if device.type == "cuda":
        one = torch.ones((), device=device)
        torch._scaled_mm(a.to(E4M3), a.to(E4M3).t(), scale_a=one, scale_b=one, out_dtype=BF16)


def tensor_megabytes(model):
    """Bytes (MB) of the model's parameters and buffers, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values()) / 1e6


def mlp_stack(width, hidden, blocks):
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                           for _ in range(blocks)))


class Run(BudgetedRun):
    """The results so far, the budget, and whether CUDA still works; rewrites the report."""

    def __init__(self, args, device, header, settings):
        super().__init__(args, device)
        self.header, self.settings = header, settings
        self.results = []
        self.memory = WeightMemory()

    def unit(self, result, work):
        super().unit(result, work, result_line)

    def write(self, final=False):
        return write_report(self, final)

    def forward_shape(self, shape):
        x, w, _ = random_operands(shape, self.device, self.args.seed)
        rows = reference_rows(shape)[0]
        reference = None if self.blocked() else forward_reference(x, w, rows)
        queued = []
        for peer, build in forward_builders().items():
            result = Result("forward", shape.label(), peer, shape.dims)

            def work():
                call = no_grad_call(build(x, w))
                sqnr = {"out": sqnr_db(reference, call()[:rows])}
                return {"sqnr_db": sqnr, **self.first_round(call, result, queued)}
            self.unit(result, work)
        self.interleaved_rounds(queued)

    def training_shape(self, shape):
        x, w, grad_out = random_operands(shape, self.device, self.args.seed)
        rows, w_rows = reference_rows(shape)
        reference = None if self.blocked() else training_reference(x, w, grad_out, rows, w_rows)
        queued = []
        for peer, build in training_builders().items():
            result = Result("training", shape.label(), peer, shape.dims)

            def work():
                call = train_call(*build(x, w), x, grad_out)
                got = dict(zip(GRADIENTS, call()))
                got = {"out": got["out"][:rows], "dx": got["dx"][:rows], "dw": got["dw"][:w_rows]}
                sqnr = {name: sqnr_db(reference[name], got[name]) for name in GRADIENTS}
                del got
                return {"sqnr_db": sqnr, **self.first_round(call, result, queued)}
            self.unit(result, work)
        self.interleaved_rounds(queued)

    def quantization(self, rows, cols):
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        x = torch.randn(rows, cols, generator=gen, device=self.device).to(BF16)
        y = torch.empty_like(x)
        x64 = None if self.blocked() else x.double()
        n, x_bytes = x.numel(), x.numel() * x.element_size()

        static_scale = quantize_tensorwise(x, E4M3)[1]  # a calibrated static scale (it clips nothing)
        clipped = torch.zeros((), dtype=torch.int64, device=self.device)

        def copy():
            y.copy_(x)

        calls = {  # peer -> (call, bytes read once + written once, what the call returns -> x's estimate)
            "copy": (copy, 2 * x_bytes, None),
            "cast alone": (lambda: x.to(E4M3), x_bytes + n, lambda q: q.float()),
            "quantize_tensorwise": (lambda: quantize_tensorwise(x, E4M3), x_bytes + n + 4,
                                    lambda q: dequantize(*q)),
            "quantize_rowwise": (lambda: quantize_rowwise(x, E4M3), x_bytes + n + 4 * rows,
                                 lambda q: dequantize(*q)),
            "quantize_with_scale": (lambda: quantize_with_scale(x, static_scale, E4M3, clipped), x_bytes + n,
                                    lambda q: dequantize(*q)),
            "eager quantize": (lambda: eager_quantize(x), x_bytes + n + 4, lambda q: dequantize(*q)),
        }
        queued = []
        for peer, (call, moved, estimate) in calls.items():
            result = Result("quantize", quant_case((rows, cols)), peer, (rows, cols))

            def work():
                sqnr = {} if estimate is None else {"x": sqnr_db(x64, estimate(call()))}
                return {"sqnr_db": sqnr, "bytes_moved": moved, **self.first_round(call, result, queued)}
            self.unit(result, work)
        self.interleaved_rounds(queued)

    def weight_memory(self, width, hidden, blocks, inputs_shape):
        memory = self.memory
        memory.model = (f"{blocks} blocks of Linear({width}, {hidden}), GELU, Linear({hidden}, {width}), "
                        f"bf16; inputs {tuple(inputs_shape)}")
        blocked = self.blocked()
        if blocked:
            memory.status, memory.error = "skipped", blocked
            self.write()
            return
        try:
            self.measure_weight_memory(width, hidden, blocks, inputs_shape)
            memory.status = "ok"
        except Exception as error:  # noqa: BLE001 - a failure is a result
            memory.status, memory.error = "fails", self.failed(error)
        self.log(f"weight memory: {memory.status} {memory.error} {memory.ratios()}")
        self.write()

    def measure_weight_memory(self, width, hidden, blocks, inputs_shape):
        memory, device, cuda = self.memory, self.device, self.device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(self.args.seed)
        x = torch.randn(inputs_shape, generator=gen, device=device).to(BF16)
        warm_gemm_workspaces(device)
        gc.collect()
        base = torch.cuda.memory_allocated() if cuda else None
        torch.manual_seed(self.args.seed)
        model = mlp_stack(width, hidden, blocks).to(device, BF16)
        if cuda:
            memory.bf16_allocated_mb = (torch.cuda.memory_allocated() - base) / 1e6
        memory.bf16_tensor_mb = tensor_megabytes(model)
        converted = lowconv.convert(model, "fp8-dynamic", (x,))
        report = lowconv.compare(model, converted, (x,))
        (output,) = report.outputs
        memory.output_sqnr_db = output.metrics.sqnr_db
        memory.gate = "passed" if report.passed else "FAILED"
        if report.perf:
            memory.bf16_forward_ms, memory.fp8_forward_ms = report.perf.original_ms, report.perf.converted_ms
        with tempfile.TemporaryDirectory() as tmp:
            bf16_file = Path(tmp) / "bf16.safetensors"
            save_file(model.state_dict(), bf16_file)
            memory.bf16_file_mb = bf16_file.stat().st_size / 1e6
            memory.fp8_file_mb = lowconv.save(converted, Path(tmp) / "fp8").stat().st_size / 1e6
        del model, report
        gc.collect()
        if cuda:
            memory.fp8_allocated_mb = (torch.cuda.memory_allocated() - base) / 1e6
        memory.fp8_tensor_mb = tensor_megabytes(converted)


def result_line(result):
    if result.status != "ok":
        return f"{result.status}: {result.error}"
    sqnr = ", ".join(f"{name} {db:.1f} dB" for name, db in result.sqnr_db.items())
    memory = "" if result.workspace_mb is None else f", workspace {result.workspace_mb:.0f} MB"
    return f"{format_ms(result.ms)}{memory}" + (f", SQNR {sqnr}" if sqnr else "")


def format_ms(ms):
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def time_cell(result, baseline, notes):
    cell = status_cell(result, notes)
    if cell is not None:
        return cell
    if baseline is None or baseline.status != "ok" or baseline is result:
        return format_ms(result.ms)
    return f"{format_ms(result.ms)} ({baseline.ms / result.ms:.2f}x)"


def sqnr_cell(result, notes, name="out"):
    cell = status_cell(result, notes)
    return cell if cell is not None else f"{result.sqnr_db[name]:.1f}"


def workspace_cell(result, notes):
    cell = status_cell(result, notes)
    return cell if cell is not None else "n/a" if result.workspace_mb is None else f"{result.workspace_mb:.0f}"


def find(run, section, peer, dims):
    return next((r for r in run.results if r.section == section and r.peer == peer and r.dims == dims), None)


def speed_verdict(run, peer, dims, min_speedup, max_ms):
    label = "x".join(map(str, dims))
    target = f"{peer} ({LOWCONV_RECIPES[peer]}) forward at {label}, quantization of x included: " \
             f">= {min_speedup}x bf16 and <= {max_ms} ms"
    ours, bf16 = find(run, "forward", peer, dims=dims), find(run, "forward", "bf16", dims=dims)
    if ours is None or bf16 is None:
        return target, "", "not measured (shape not in this run)"
    if ours.status != "ok" or bf16.status != "ok":
        return target, "", f"not measured (lowconv {ours.status}, bf16 {bf16.status})"
    speedup = bf16.ms / ours.ms
    measured = f"{format_ms(ours.ms)} vs bf16 {format_ms(bf16.ms)}: {speedup:.2f}x"
    return target, measured, "met" if speedup >= min_speedup and ours.ms <= max_ms else "NOT met"


def quant_verdict(run, peer, dims):
    target = f"{peer} of a {dims} bf16 x: >= {QUANT_TARGET:.0%} of copy bandwidth"
    ours, copy = (find(run, "quantize", p, dims=dims) for p in (peer, "copy"))
    if ours is None or copy is None:
        return target, "", "not measured (shape not in this run)"
    if ours.status != "ok" or copy.status != "ok":
        return target, "", f"not measured ({peer} {ours.status}, copy {copy.status})"
    fraction = bandwidth(ours) / bandwidth(copy)
    measured = f"{bandwidth(ours):.0f} GB/s vs copy {bandwidth(copy):.0f} GB/s: {fraction:.0%}"
    return target, measured, "met" if fraction >= QUANT_TARGET else "NOT met"


def memory_verdict(run):
    target = f"weight memory of a ViT-L MLP stack with fp8-dynamic: <= {MEMORY_TARGET}x bf16 (every measure)"
    memory = run.memory
    if memory.status != "ok":
        return target, "", f"not measured ({memory.status}{': ' + memory.error if memory.error else ''})"
    if run.settings["tiny"]:
        return target, "", "not measured (--tiny: not the ViT-L size)"
    ratios = memory.ratios()
    measured = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in ratios.items())
    return target, measured, "met" if all(r <= MEMORY_TARGET for r in ratios.values()) else "NOT met"


def quant_case(dims):
    return f"{dims[0]}x{dims[1]} bf16 -> e4m3"


def bandwidth(result):
    """GB/s (1e9 bytes per second) of the bytes a call must move, over its median time."""
    return result.bytes_moved / (result.ms * 1e-3) / 1e9


def gate_failures(run):
    """lowconv results below the SQNR gates (NaN fails too)."""
    bad = []
    for r in run.results:
        if r.status != "ok" or not r.peer.startswith("lowconv") or r.section == "quantize":
            continue
        for name, db in r.sqnr_db.items():
            gate = GATE_FORWARD_SQNR_DB if name == "out" else GATE_GRADIENT_SQNR_DB
            if not db >= gate:
                bad.append(f"{r.section} {r.case} {r.peer} {name}: SQNR {db:.1f} dB < {gate:g} dB")
    return bad


def gate_line(run):
    checked = [r for r in run.results if r.status == "ok" and r.peer.startswith("lowconv")
               and r.section != "quantize"]
    bad = gate_failures(run)
    if bad:
        return f"FAILED ({len(bad)} results below it): " + "; ".join(bad[:GATE_LISTED]) + \
            ("; ..." if len(bad) > GATE_LISTED else "")
    if not checked:
        return "not decided (no lowconv result yet)"
    return (f"passed ({len(checked)} lowconv results: outputs >= {GATE_FORWARD_SQNR_DB:g} dB, "
            f"gradients >= {GATE_GRADIENT_SQNR_DB:g} dB vs float64)")


def markdown_report(run, header):
    notes = {}
    settings = run.settings
    lines = ["# FP8 linear (issue 4): lowconv vs bf16 and hand-written FP8", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    lines += [f"- lowconv SQNR gate: {gate_line(run)}", ""]

    verdicts = [speed_verdict(run, peer, *t) for t in SPEED_TARGETS for peer in ("lowconv tensor", "lowconv row")]
    verdicts += [quant_verdict(run, p, dims) for dims in settings["quant"]
                 for p in ("quantize_tensorwise", "quantize_rowwise", "quantize_with_scale")]
    verdicts += [memory_verdict(run)]
    lines += ["## Targets (issue 4)", "",
              tabulate([[f"[{'x' if v == 'met' else ' '}] {t}", m, v] for t, m, v in verdicts],
                       headers=["target", "measured", "verdict"], tablefmt="github"), ""]
    if settings["tiny"] or run.device.type != "cuda":
        lines += ["The targets are H100 numbers at the issue's shapes; this run "
                  f"({'--tiny, ' if settings['tiny'] else ''}{run.device.type}) tests the plumbing only.", ""]

    shapes = settings["forward_shapes"]
    by_key = {(r.section, r.case, r.peer): r for r in run.results}
    fwd = [[s.name, s.m, s.k, s.n] for s in shapes]
    sqnr, workspace = [list(row) for row in fwd], [list(row) for row in fwd]
    for shape, t_row, s_row, w_row in zip(shapes, fwd, sqnr, workspace):
        baseline = by_key.get(("forward", shape.label(), "bf16"))
        for peer in FORWARD_PEERS:
            result = by_key.get(("forward", shape.label(), peer))
            t_row.append(time_cell(result, baseline, notes))
            s_row.append(sqnr_cell(result, notes))
            w_row.append(workspace_cell(result, notes))
    headers = ["shape", "M", "K", "N", *FORWARD_PEERS]
    lines += ["## 1. Linear forward (inference, no_grad), bf16 x and W, no bias", "",
              "- bf16: F.linear. fp8 GEMM alone: torch._scaled_mm (tensorwise, fast accum) on an x "
              "quantized before the timed call (the floor, not a usable layer). eager fp8: x's amax, "
              "divide and saturating cast in torch ops, then the same _scaled_mm, W quantized beforehand.",
              "- lowconv tensor / row / static: the Fp8Linear that lowconv.convert builds from a "
              "one-Linear model with the built-in recipes fp8-dynamic / fp8-row / fp8-static "
              "(static: calibrated by convert on this same x, so its scale equals dynamic tensor's), "
              "fast_accum on (the default), called directly. Its x quantization is inside the timed call.",
              f"- SQNR (dB) against float64 on the same bf16 inputs, over the first {REFERENCE_ROWS} rows "
              "of the output (all rows when M is smaller): the float64 reference is computed on those "
              "rows only.", "",
              "### Median time (speedup vs bf16)", "", tabulate(fwd, headers=headers, tablefmt="github"), "",
              "### SQNR vs float64 (dB)", "", tabulate(sqnr, headers=headers, tablefmt="github"), ""]
    if run.device.type == "cuda":
        lines += ["### Workspace memory (MB, 1e6 bytes: peak allocated during the call beyond the "
                  "memory before it and its output)", "", tabulate(workspace, headers=headers, tablefmt="github"), ""]
    else:
        lines += ["Times on the CPU are wall-clock medians of a few calls; workspace memory is not measured.", ""]

    rows = []
    for shape in settings["training_shapes"]:
        results = [by_key.get(("training", shape.label(), peer)) for peer in TRAINING_PEERS]
        row = [shape.name, shape.m, shape.k, shape.n]
        row += [time_cell(r, results[0], notes) for r in results]
        row += [sqnr_cell(r, notes, name) for r in results for name in GRADIENTS]
        if run.device.type == "cuda":
            row += [workspace_cell(r, notes) for r in results]
        rows.append(row)
    headers = ["shape", "M", "K", "N", *(f"{p} ms" for p in TRAINING_PEERS),
               *(f"{p} {name} dB" for p in TRAINING_PEERS for name in GRADIENTS)]
    if run.device.type == "cuda":
        headers += [f"{p} workspace MB" for p in TRAINING_PEERS]
    lines += ["## 1b. Training: forward + backward", "",
              "The forward and the gradients of (out * grad_out).sum() for x and W (no bias). lowconv fp8 "
              "training: the Fp8Linear of lowconv.convert with options scaling=dynamic, granularity=tensor, "
              "training=true (bf16 master weight; e4m3 x and W forward, e5m2 gradients, FP8 GEMMs for dX "
              f"and dW). Times with the speedup over bf16 in parentheses; SQNR vs float64 over the first "
              f"{REFERENCE_ROWS} rows of out, dX and dW.", "",
              tabulate(rows, headers=headers, tablefmt="github"), ""]

    rows = []
    for dims in settings["quant"]:
        copy = find(run, "quantize", "copy", dims)
        for peer in QUANT_PEERS:
            result = find(run, "quantize", peer, dims)
            cell = status_cell(result, notes)
            if cell is not None:
                rows.append([quant_case(dims), peer, cell, "", "", "", "", ""])
                continue
            share = f"{bandwidth(result) / bandwidth(copy):.0%}" if copy and copy.status == "ok" else ""
            rows.append([quant_case(dims), peer, format_ms(result.ms), f"{result.bytes_moved / 1e6:.3g}",
                         f"{bandwidth(result):.0f}", share, workspace_cell(result, notes),
                         f"{result.sqnr_db['x']:.1f}" if "x" in result.sqnr_db else "exact"])
    lines += ["## 2. Activation quantization alone", "",
              "copy: y.copy_(x) into a preallocated bf16 y. cast alone: x.to(float8_e4m3fn) without a "
              "scale (one elementwise torch kernel; a reference point, not a quantizer). "
              "eager quantize: amax, divide, saturating cast in torch ops. quantize_tensorwise / quantize_rowwise / "
              "quantize_with_scale (static scale, counting clipped values): lowconv.kernels.fp8's, as the fp8 op "
              "calls them (Triton kernels on an FP8 GPU; per tensor reads x twice, the others once). "
              "Bytes: x read once plus the e4m3 output and its scales written once (copy: read and write "
              "x's bytes); the bandwidth is those bytes over the median time, whatever the kernels "
              "really move. SQNR: the dequantized x vs x in float64.", "",
              tabulate(rows, headers=["x", "call", "median", "MB moved", "GB/s", "of copy", "workspace MB",
                                      "SQNR dB"], tablefmt="github"), ""]

    memory = run.memory
    lines += [f"## 3. Weight memory: {memory.model}", ""]
    if memory.status != "ok":
        note = f" [{notes.setdefault(memory.error, len(notes) + 1)}]" if memory.status == "fails" else \
            (f" ({memory.error})" if memory.error else "")
        lines += [f"{memory.status}{note}", ""]
    else:
        ratios = memory.ratios()

        def mb(value):
            return "n/a" if value is None else f"{value:.4g}"

        rows = [[name, mb(bf16), mb(fp8), f"{ratios[name]:.3f}x" if name in ratios else "n/a"]
                for name, bf16, fp8 in (
                    ("memory_allocated", memory.bf16_allocated_mb, memory.fp8_allocated_mb),
                    ("parameters + buffers", memory.bf16_tensor_mb, memory.fp8_tensor_mb),
                    ("checkpoint file", memory.bf16_file_mb, memory.fp8_file_mb))]
        lines += ["memory_allocated: its change from before the bf16 model was built (inputs allocated "
                  "and the GEMM libraries' workspaces warmed earlier) with the bf16 model, then with the "
                  "converted model alone (the original deleted). Checkpoint: the bf16 state dict through safetensors' save_file vs "
                  "lowconv.save (its metadata holds the recipe and plan). MB = 1e6 bytes.", "",
                  tabulate(rows, headers=["measure", "bf16 MB", "fp8-dynamic MB", "ratio"], tablefmt="github"),
                  "", f"- lowconv.compare, output vs the bf16 model: SQNR {memory.output_sqnr_db:.1f} dB, "
                  f"recipe gate {memory.gate}"]
        if memory.fp8_forward_ms is not None:
            lines += [f"- forward of the stack (lowconv.compare's timing): bf16 {format_ms(memory.bf16_forward_ms)}, "
                      f"fp8-dynamic {format_ms(memory.fp8_forward_ms)} "
                      f"({memory.bf16_forward_ms / memory.fp8_forward_ms:.2f}x)"]
        lines += [""]

    if notes:
        lines += ["Failures:", ""] + [f"[{n}] {message}" for message, n in notes.items()] + [""]
    lines += ["## Bars from /work/shared/notes/h100-anchors.md (an earlier run, not this one)", "",
              ANCHORS_MARKDOWN]
    return "\n".join(lines)


def write_report(run, final=False):
    header = {**run.header, "elapsed": f"{run.elapsed():.0f} s" + ("" if final else " (still running)")}
    text = markdown_report(run, header)
    settings = {name: [asdict(s) for s in value] if name.endswith("_shapes") else value
                for name, value in run.settings.items()}
    data = {"header": header, "settings": settings, "gate_failures": gate_failures(run),
            "results": [asdict(r) for r in run.results], "weight_memory": asdict(run.memory),
            "anchors_markdown": ANCHORS_MARKDOWN}
    write_outputs(run.args.out, "bench_fp8", text, data)
    return text


def parse_args():
    parser = argparse.ArgumentParser(
        description="Time FP8 linear layers (issue 4): bf16 F.linear, hand-written FP8 and lowconv's fp8 op "
                    "(inference and training), activation quantization against a copy, and the weight memory "
                    "of an fp8-dynamic conversion; after a float64 check of every output.")
    add_run_arguments(parser, name="bench_fp8", quick_help="the issue's four GEMM shapes only (no Llama-8B shapes)",
                      tiny_help=f"every size divided by {TINY_DIVISOR}", cpu_help="torch._scaled_mm's CPU path",
                      budget_s=300.0, warmup_ms=25.0, rep_ms=100.0)
    add_rounds_argument(parser, "forward, training and quantization")
    return parser.parse_args()


def resolve_settings(args):
    tiny = args.tiny
    shapes = [scaled(s, tiny) for s in ISSUE_SHAPES + ([] if args.quick else LLAMA_SHAPES)]
    width = size(MLP_WIDTH, tiny)
    return {
        "tiny": tiny,
        "forward_shapes": shapes,
        "training_shapes": [s for s in shapes if s.name in TRAINING_SHAPE_NAMES],
        "quant": [(size(rows, tiny), size(cols, tiny)) for rows, cols in QUANT_SHAPES],
        "mlp": (width, size(MLP_HIDDEN, tiny), MLP_BLOCKS,
                (2 if tiny else MLP_BATCH, size(MLP_TOKENS, tiny), width)),
    }


def main():
    args = parse_args()
    device = run_device(args, "bench_fp8")
    settings = resolve_settings(args)
    run = Run(args, device, run_header(args, device, lowconv=lowconv.__version__), settings)
    # Cheapest first, and the parts the targets need before the long tail of shapes.
    for rows, cols in settings["quant"]:
        run.quantization(rows, cols)
    run.weight_memory(*settings["mlp"])
    for shape in settings["forward_shapes"]:
        run.forward_shape(shape)
    for shape in settings["training_shapes"]:
        run.training_shape(shape)

    print(run.write(final=True))
    if gate_failures(run):
        sys.exit(f"LOWCONV FP8 SQNR GATE {gate_line(run)}")


if __name__ == "__main__":
    main()
