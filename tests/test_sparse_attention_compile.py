"""The sparse_attention op compiles whole (fullgraph=True): the block- and window-attention kernels
are the custom ops torch.ops.lowconv.* (opcheck here, their kernels in Triton's interpreter), and a
converted model compiles on the CPU reference path and on the kernel path (simulated CUDA, as in
test_sparse_attention_op), with eager's outputs and gradients. A child process without the
interpreter traces the ops into their kernels as inductor does on the GPU (an H100 as Triton's
target), which the interpreter's ops, kept whole, do not show."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import lowconv
import lowconv.ops.functional_attention as fa
from lowconv.kernels.block_attention import band, block_layout
from tests.compiled import aot_recording, call_targets, compile_recording
from tests.test_sparse_attention_op import CausalBlock, attention_recipe, kernels_on_cpu, spy_on_plans  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def compiled(module):
    """(module compiled with fullgraph=True, dynamo's graphs, AOTAutograd's forward and backward graphs)."""
    torch._dynamo.reset()
    counters.clear()
    aot_graphs = []
    run, dynamo_graphs = compile_recording(module, backend=aot_recording(aot_graphs))
    return run, dynamo_graphs, aot_graphs


def assert_same_outputs_and_grads(module, run, inputs, grad_inputs):
    """run(*inputs) against module(*inputs): outputs, and the gradients of grad_inputs (leaves
    among inputs), both within fp32 rounding."""
    outs = []
    for call in (module, run):
        for t in grad_inputs:
            t.grad = None
        out = call(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        outs.append([out.detach(), *(t.grad.clone() for t in grad_inputs)])
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def small_problem(kv_heads=2, seq_q=20, seq_k=24):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq_q, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, seq_k, 16, generator=gen) for _ in range(2))
    return q, k, v


def test_forward_op_passes_opcheck_with_masks_padding_listed_tiles_and_gqa():
    q, k, v = (t.requires_grad_() for t in small_problem())
    keep = torch.rand(2, 1, 20, 24, generator=torch.Generator().manual_seed(1)) > 0.3
    padding = torch.zeros(2, 24, dtype=torch.bool)
    padding[1, 20:] = True
    blocks = block_layout(20, 24, layout="causal", mask=keep, key_padding_mask=padding)
    lower, upper = band("causal", None, 20, 24)
    torch.library.opcheck(torch.ops.lowconv.block_attention_forward.default,
                          (q, k, v, keep, padding, *blocks, lower, upper, True, 0.25))
    additive = torch.randn(20, 24)
    torch.library.opcheck(torch.ops.lowconv.block_attention_forward.default,
                          (q, k, v, additive, None, None, None, None, None, *band("dense", None, 20, 24), False, 0.25))


def test_backward_op_passes_opcheck():
    q, k, v = small_problem()
    lower, upper = band("local", 5, 20, 24)
    args = (None, None, None, None, None, None, lower, upper, True, 0.25)
    out, stats = torch.ops.lowconv.block_attention_forward(q, k, v, *args)
    torch.library.opcheck(torch.ops.lowconv.block_attention_backward.default,
                          (torch.randn_like(out), q, k, v, out, stats, *args))


@pytest.mark.parametrize("options", ["", 'layout = "local", window = 3', 'dtype = "bfloat16"'])
def test_converted_model_compiles_whole_on_the_reference_path(options):
    torch.manual_seed(0)
    model = CausalBlock().eval()
    x = torch.randn(2, 10, 32, requires_grad=True)
    converted = lowconv.convert(model, attention_recipe(options), (x.detach(),))
    run, dynamo_graphs, aot_graphs = compiled(converted)
    assert_same_outputs_and_grads(converted, run, (x,), [x])
    assert len(dynamo_graphs) == 1 and counters["graph_break"] == {}


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 2, batch_first=True)

    def forward(self, x, padding):
        return self.mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]


@pytest.mark.parametrize("options", ["", 'backend = "triton"'])
def test_converted_multihead_attention_with_padding_compiles_whole(options, kernels_on_cpu):
    """nn.MultiheadAttention's site on the kernels' device: key padding decided per call (SDPA
    under compile), or the kernels with tiles listed inside the graph; two calls, one graph."""
    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    x = torch.randn(3, 70, 32, requires_grad=True)
    converted = lowconv.convert(model, attention_recipe(options), (x.detach(), torch.zeros(3, 70, dtype=torch.bool)))
    run, dynamo_graphs, aot_graphs = compiled(converted)
    for lengths in ([70, 40, 2], [70, 70, 65]):
        padding = torch.arange(70)[None, :] >= torch.tensor(lengths)[:, None]
        assert_same_outputs_and_grads(converted, run, (x, padding), [x])
    assert len(dynamo_graphs) == 1 and counters["graph_break"] == {}
    uses_kernels = "lowconv.block_attention_forward.default" in call_targets(dynamo_graphs + aot_graphs)
    assert uses_kernels == ("triton" in options)


@pytest.mark.parametrize("layout, mask, backend", [("local", None, "auto"), ("auto", None, "triton"),
                                                   ("mask", "keep", "triton"), ("auto", "additive", "triton")])
def test_kernel_path_compiles_whole_with_the_ops_in_its_graphs(kernels_on_cpu, monkeypatch, layout, mask, backend):
    """The forward op in dynamo's graph and the backward op in AOTAutograd's backward graph; the
    kernels' outputs and gradients as eagerly."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 70, 16, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 70, 70, generator=gen) > 0.3
    keep[:, :, :, :64] = False
    keep[..., 0] = True
    masks = {None: (), "keep": (keep,), "additive": (torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),)}
    module = fa.SparseAttention(mask=mask or "none", causal=True, layout=layout, window=5 if layout == "local" else None,
                                backend=backend)
    run, dynamo_graphs, aot_graphs = compiled(module)
    ran = spy_on_plans(monkeypatch)
    assert_same_outputs_and_grads(module, run, (q, k, v, *masks[mask]), [q, k, v])
    assert {backend for backend, _, _ in ran} == {"triton"}
    assert {"lowconv.block_attention_forward.default",
            "lowconv.block_attention_backward.default"} <= call_targets(dynamo_graphs + aot_graphs)
    assert len(dynamo_graphs) == 1 and counters["graph_break"] == {}


def test_masked_calls_compile_to_sdpa(kernels_on_cpu):
    """Backend auto with a mask: compiled, the call cannot read the mask, and runs SDPA with it."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 70, 16, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 70, 70, generator=gen) > 0.3
    keep[:, :, :, :64] = False
    keep[..., 0] = True
    module = fa.SparseAttention(mask="keep", causal=True)
    run, dynamo_graphs, aot_graphs = compiled(module)
    assert_same_outputs_and_grads(module, run, (q, k, v, keep), [q, k, v])
    targets = call_targets(dynamo_graphs + aot_graphs)
    assert not any("lowconv" in t for t in targets) and any("scaled_dot_product" in t for t in targets)
    assert len(dynamo_graphs) == 1 and counters["graph_break"] == {}


def test_exported_converted_model_holds_the_op(kernels_on_cpu):
    """torch.export keeps the op whole (no decomposition into its kernels): a converted model's
    exported graph calls torch.ops.lowconv.block_attention_forward, and computes what it does."""
    torch.manual_seed(0)
    model = CausalBlock(dim=64, heads=4).eval()
    x = torch.randn(2, 70, 64)
    converted = lowconv.convert(model, attention_recipe('layout = "local", window = 8'), (x,))
    exported = torch.export.export(converted, (x,))
    assert [str(n.target) for n in exported.graph.nodes if "lowconv" in str(n.target)] == [
        "lowconv.block_attention_forward.default"]
    torch.testing.assert_close(exported.module()(x), converted(x), rtol=0, atol=0)


def window_problem(rel=True):
    """A window-attention problem as the ops take it: q, k, v, the tables, row windows, packed coordinates."""
    from lowconv.kernels.window_attention import pack_coords, row_windows_from_offsets
    from tests.test_window_attention import make_problem
    q, k, v, offsets, coords, tables, _ = make_problem(sizes=[3, 0, 5, 1, 2], seed=6, rel=rel)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    tables = (None,) * 3 if tables is None else tuple(t.float().requires_grad_() for t in tables)
    start, end = (t.int() for t in row_windows_from_offsets(offsets, q.shape[0]))
    return q, k, v, tables, start, end, None if coords is None else pack_coords(coords), offsets


@pytest.mark.parametrize("rel, split", [(True, False), (False, False), (True, True)])
def test_window_ops_pass_opcheck(rel, split):
    q, k, v, tables, start, end, coords, offsets = window_problem(rel)
    split_args = (None, None, -1, 0)
    if split:  # axis 1 from per-point values, buckets 0 to 2G-1: tables of 2G rows
        tables = tuple(torch.cat([t, t[-1:]]).detach().requires_grad_() for t in tables)
        values = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(7))
        split_args = (values, torch.tensor([-0.8, -0.2, 0.0, 0.1, 0.5, 0.9, 1.3]), 1, 0)
    args = (q, k, v, *tables, start, end, coords, *split_args, 0.25)
    torch.library.opcheck(torch.ops.lowconv.window_attention_forward.default, args)
    out, lse = torch.ops.lowconv.window_attention_forward(*args)
    detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:-1])
    torch.library.opcheck(torch.ops.lowconv.window_attention_backward.default,
                          (torch.randn_like(out), *detached, out.detach(), lse, 0.25))
    torch.library.opcheck(torch.ops.lowconv.window_row_windows.default, (offsets.int(), q.shape[0]))


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
def test_converted_window_attention_compiles_whole(kernels, monkeypatch):
    """An SpTr block with relative position, converted: the window op on the reference path, or
    on the kernels (the ops in its forward and backward graphs); feats' gradient and the tables'."""
    import functools

    from lowconv.kernels.window_attention import window_attention
    from lowconv.ops import window_attention as window_op
    from tests.test_window_attention_pass import Block, scene
    if kernels:
        monkeypatch.setattr(window_op, "window_attention", functools.partial(window_attention, backend="triton"))
    model, inputs = Block("contextual").eval(), scene(60)  # small: the kernels run in Triton's interpreter in CI
    converted = lowconv.convert(model, attention_recipe('dtype = "float32"'), inputs)
    feats = inputs[0].clone().requires_grad_()
    tables = [p for name, p in converted.named_parameters() if "relative_pos" in name]
    assert len(tables) == 3
    run, dynamo_graphs, aot_graphs = compiled(converted)
    assert_same_outputs_and_grads(converted, run, (feats, *inputs[1:]), [feats, *tables])
    assert len(dynamo_graphs) == 1 and counters["graph_break"] == {}
    ops = {"lowconv.window_attention_forward.default", "lowconv.window_attention_backward.default"}
    assert (ops <= call_targets(dynamo_graphs + aot_graphs)) == kernels


def test_ops_trace_into_their_kernels_as_inductor_sees_them():
    """Forward and backward of both op families, traced with fake tensors through functionalization
    (what AOTAutograd hands inductor): each a graph of Triton kernel calls whose written outputs
    torch's analysis of the kernels found (no fallback to "every input is written")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.splitlines()[-1])
    assert result["fallbacks"] == []
    assert result["block"] == [["out", "stats"], ["delta", "dq"], ["dk", "dv"]]
    assert result["window"] == [["lse", "out"], ["delta", "dq", "dtq", "dtv"], ["dk", "dtk", "dv"]]
    assert result["row_windows"] == [["end", "start"]]


def kernels_written_when_traced():
    """In the child: the outputs each traced kernel call writes (of those an op allocates), per op family."""
    import logging

    import triton
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.backends.compiler import GPUTarget

    class H100:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(H100())
    fallbacks = []

    class Fallbacks(logging.Handler):
        def emit(self, record):
            fallbacks.append(record.getMessage()[:200])
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(Fallbacks())

    def written(fn, *args, allocated):
        graph = make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*args)
        calls = [node for node in graph.graph.nodes if "triton_kernel_wrapper_functional" in str(node.target)]
        return [sorted(set(node.kwargs["tensors_to_clone"]) & allocated) for node in calls]

    q, k, v = (torch.randn(2, heads, 70, 16, requires_grad=True) for heads in (4, 2, 2))
    keep = torch.rand(2, 1, 70, 70) > 0.3
    padding = torch.zeros(2, 70, dtype=torch.bool)
    blocks = block_layout(70, 70, layout="causal", mask=keep, key_padding_mask=padding)

    def block(q, k, v, keep, padding, *blocks):
        out, _ = torch.ops.lowconv.block_attention_forward(q, k, v, keep, padding, *blocks, 0, 70, True, 0.25)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    wq, wk, wv, tables, start, end, coords, offsets = window_problem(True)

    def window(q, k, v, tq, tk, tv, start, end, coords):
        out, _ = torch.ops.lowconv.window_attention_forward(q, k, v, tq, tk, tv, start, end, coords, None, None, -1, 0,
                                                            0.25)
        return torch.autograd.grad(out.square().sum(), (q, k, v, tq, tk, tv))

    return {"block": written(block, q, k, v, keep, padding, *blocks,
                             allocated={"out", "stats", "delta", "dq", "dk", "dv"}),
            "window": written(window, wq, wk, wv, *tables, start, end, coords,
                              allocated={"out", "lse", "delta", "dq", "dk", "dv", "dtq", "dtk", "dtv"}),
            "row_windows": written(lambda o: torch.ops.lowconv.window_row_windows(o, 20), offsets.int(),
                                   allocated={"start", "end"}),
            "fallbacks": fallbacks}


if __name__ == "__main__":
    print(json.dumps(kernels_written_when_traced()))
