"""torch.compile in the tests: fullgraph compiles that keep the FX graphs dynamo captured, the
lowconv ops those graphs call, and the counters that say whether anything fell back."""
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters


def compile_recording(fn, backend=aot_eager, fullgraph=True, **options):
    """(torch.compile(fn, fullgraph=..., backend=...), the FX graphs dynamo hands `backend`, in order)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)
    return torch.compile(fn, fullgraph=fullgraph, backend=record, **options), graphs


def inductor_with_cuda_graphs(gm, example_inputs):
    """Inductor as torch.compile(mode="reduce-overhead") runs it: CUDA graphs (cudagraph trees)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True})


def aot_recording(graphs: list):
    """An aot_autograd backend that appends AOTAutograd's forward and backward graphs to `graphs`
    (what inductor would be given) and runs them as they are."""
    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def call_targets(graphs) -> set[str]:
    """str() of what every call node of the graphs calls ("lowconv.fp8_gemm.default", ...)."""
    return {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}


def lowconv_ops(graphs) -> set[str]:
    """The torch.ops.lowconv.* ops the graphs call ("lowconv::name"), in their subgraphs too (the
    bodies of autograd.Functions dynamo traced)."""
    packets = [node.target if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target.overloadpacket
               for graph in graphs for sub in graph.modules() if isinstance(sub, torch.fx.GraphModule)
               for node in sub.graph.nodes
               if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
    return {p._qualified_op_name for p in packets if p._qualified_op_name.startswith("lowconv::")}


def fallbacks() -> dict:
    """Graph breaks and skipped CUDA graphs counted since counters.clear(), by reason; empty if none."""
    skips = counters["inductor"]["cudagraph_skips"]
    return {**counters["graph_break"], **({"cudagraph_skips": skips} if skips else {})}


def run_with_grads(fn, module, x):
    """(y, dy/dx, the gradients of the module's parameters) of y = fn(x), fn the module or its compiled
    form, under a fixed output gradient; the module's gradients are cleared after."""
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach().clone(), leaf.grad.clone(), grads


def assert_same_run(got, want):
    """Two run_with_grads results: the same output, input gradient and parameter gradients."""
    (y, grad_x, grads), (y_want, grad_x_want, grads_want) = got, want
    assert torch.equal(y, y_want) and torch.equal(grad_x, grad_x_want)
    assert all(torch.equal(g, g_want) for g, g_want in zip(grads, grads_want))
