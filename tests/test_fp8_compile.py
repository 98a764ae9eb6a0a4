"""The fp8 op compiles whole (fullgraph=True) on the CPU reference path, in every scaling mode,
for inference and training: the same outputs and gradients as eager, the GEMM kept as the custom
op torch.ops.lowconv.fp8_gemm (but torch._scaled_mm itself where it runs), no recompile from call to call."""
import pytest
import torch
import torch._dynamo

from lowconv.ops.fp8 import Fp8Linear, Fp8Options
from tests import sites
from tests.compiled import compile_recording, lowconv_ops

from_site = Fp8Linear.from_site

MODES = [Fp8Options(scaling=s, granularity=g, training=t) for s, g in
         [("dynamic", "tensor"), ("dynamic", "row"), ("dynamic", "token"), ("static", "tensor"), ("delayed", "row")]
         for t in (False, True)] + [Fp8Options(granularity="block")]  # block: inference only


def fp8_module(options, dtype=torch.float32):
    torch.manual_seed(0)
    site = sites.linear_site(64, 48, True, str(dtype).removeprefix("torch."))
    module = from_site(site, options, {"weight": torch.randn(48, 64, dtype=dtype),
                                       "bias": torch.randn(48, dtype=dtype)})
    if module.needs_calibration:
        module.begin_calibration()
        module(torch.randn(32, 64, dtype=dtype))
        module.end_calibration()
    return module


@pytest.mark.parametrize("options", MODES, ids=lambda o: f"{o.scaling}-{o.granularity}-{'train' if o.training else 'infer'}")
def test_fp8_module_compiles_whole(options):
    torch._dynamo.reset()
    eager, compiled = fp8_module(options), fp8_module(options)
    run, graphs = compile_recording(compiled)
    for step in range(3):  # a second and third call reuse the graph (no recompile on counters, history)
        x = torch.randn(2, 5, 64) * (1 + step)
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_eager, y_compiled = eager(x_eager), run(x_compiled)
        torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
        y_eager.square().sum().backward()
        y_compiled.square().sum().backward()
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    if options.training:
        torch.testing.assert_close(compiled.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.bias.grad, eager.bias.grad, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1
    assert lowconv_ops(graphs) == {"lowconv::fp8_gemm"}
    assert compiled.report_stats() == eager.report_stats()
    if options.scaling == "delayed":
        assert torch.equal(compiled.amax_history, eager.amax_history)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_compiled_graphs_call_scaled_mm_itself_where_it_takes_the_operands(granularity, monkeypatch):
    """Where torch._scaled_mm computes the GEMM (CUDA; here the CPU's, admitted for the test), a
    compiled graph calls it directly, not through the custom op, whose Python ran on every call:
    inductor then calls cuBLASLt from its own code. Eagerly the custom op runs the same GEMM."""
    import lowconv.kernels.fp8 as fp8
    if granularity != "tensor" and not cpu_scaled_mm_takes_row_scales():
        pytest.skip("this torch's CPU torch._scaled_mm takes per-tensor scales alone (torch 2.11 does)")
    module = fp8_module(Fp8Options(granularity=granularity), dtype=torch.bfloat16)
    x = torch.randn(4, 7, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8, "scaled_mm_takes", lambda device, n, k, has_rows, rowwise, out_dtype: has_rows)
    monkeypatch.setattr(fp8, "blockwise_scaled_mm_takes", lambda device, n, k, has_rows, out_dtype: has_rows)
    torch._dynamo.reset()
    run, graphs = compile_recording(module)
    with torch.no_grad():
        got = run(x)
    assert lowconv_ops(graphs) == set()
    assert torch._scaled_mm in call_targets_deep(graphs)
    torch.testing.assert_close(got, module(x), rtol=1e-2, atol=1e-2)  # eager: _scaled_mm through the custom op


def cpu_scaled_mm_takes_row_scales() -> bool:
    a = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def call_targets_deep(graphs) -> set:
    """What the call nodes of the graphs and their subgraphs call."""
    return {node.target for graph in graphs for sub in graph.modules() if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.nodes if node.op == "call_function"}


def test_static_scale_never_set_is_an_error_under_compile():
    uncalibrated = from_site(sites.linear_site(64, 48, True, "float32"), Fp8Options(scaling="static"),
                             {"weight": torch.randn(48, 64), "bias": torch.randn(48)})
    torch._dynamo.reset()
    with pytest.raises((torch._dynamo.exc.Unsupported, RuntimeError), match="input_scale was neither calibrated nor loaded"):
        torch.compile(uncalibrated, fullgraph=True, backend="eager")(torch.randn(3, 64))


def test_loaded_static_scale_is_taken_without_a_check_per_call():
    calibrated = fp8_module(Fp8Options(scaling="static"))
    rebuilt = from_site(sites.linear_site(64, 48, True, "float32"), Fp8Options(scaling="static"),
                        {"weight": torch.randn(48, 64), "bias": torch.randn(48)})
    assert not rebuilt.input_scale_set
    rebuilt.load_state_dict(calibrated.state_dict())
    assert rebuilt.input_scale_set
    x = torch.randn(3, 64)
    torch.testing.assert_close(rebuilt(x), calibrated(x))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [o for o in MODES if o.scaling in ("dynamic", "static")],
                         ids=lambda o: f"{o.scaling}-{o.granularity}-{'train' if o.training else 'infer'}")
def test_fp8_module_under_inductor_and_cuda_graphs_matches_eager(options):
    """On the GPU: inductor (its quantization fused, the GEMM torch._scaled_mm) in CUDA graphs, no graph
    break, and the outputs of eager's Triton quantizers within an fp8 rounding or two (inductor's
    division is not IEEE's: a value on a rounding boundary may land one e4m3 step away)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    module = fp8_module(options, dtype=torch.bfloat16).cuda()
    run = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    x = torch.randn(4, 33, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = module(x)
        for _ in range(3):  # warm-up, record, replay
            got = run(x).clone()
    assert counters["graph_break"] == {}
    error = (got.float() - want.float()).norm() / want.float().norm()
    assert error < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
def test_long_rows_one_layer_reads_go_to_the_row_kernel_under_compile(shared):
    """Rows longer than FUSED_ROWS_MAX that this layer alone quantizes: lowconv's row kernel in the
    compiled graph (the eager layer's own kernel: the same output); a shared x stays inductor's."""
    from lowconv.kernels.fp8 import FUSED_ROWS_MAX
    torch._dynamo.reset()
    k = 2 * FUSED_ROWS_MAX
    site = sites.linear_site(k, 256, True, "bfloat16")
    module = from_site(site, Fp8Options(granularity="row"), {"weight": torch.randn(256, k, dtype=torch.bfloat16),
                                                             "bias": torch.randn(256, dtype=torch.bfloat16)}).cuda()
    module.input_shared = shared
    run, graphs = compile_recording(module)
    x = torch.randn(4, 100, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = run(x), module(x)
    assert ("lowconv::fp8_quantize_rowwise" in lowconv_ops(graphs)) is not shared
    if not shared:  # the eager layer's kernels: the same output
        assert torch.equal(got, want)
