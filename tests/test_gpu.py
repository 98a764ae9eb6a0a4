"""The whole path on CUDA (run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch

import lowconv
from lowconv.model_file import load_model_file
from lowconv.recipe import builtin_recipes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("recipe", sorted(builtin_recipes()))
@pytest.mark.parametrize("example", ["examples/vit.py", "examples/gpt.py", "examples/text_classifier.py"])
def test_convert_save_load_compare_on_cuda(example, recipe, tmp_path):
    dtype = "float16" if recipe == "fp16acc" else None
    loaded = load_model_file(example, device="cuda", dtype=dtype)
    converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
    lowconv.save(converted, tmp_path)
    again = lowconv.load(loaded.model, tmp_path)
    with torch.no_grad():
        assert torch.equal(again(*loaded.inputs), converted(*loaded.inputs))
    report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=True)
    assert report.perf is not None and report.perf.converted_ms > 0
    assert report.passed, lowconv.report.report_to_table(report)


def test_cpu_report_predicts_gpu_accuracy():
    """The same conversion on CPU and on CUDA gives output SQNRs within 1 dB. The rule is forced:
    on CUDA, sites where fp8 measures slower would otherwise be kept (the CPU times nothing)."""
    from lowconv.recipe import parse_recipe

    forced = parse_recipe('[[rules]]\nop = "fp8"\noptions = { scaling = "dynamic", granularity = "tensor" }\nforce = true')
    sqnr = {}
    for device in ("cpu", "cuda"):
        loaded = load_model_file("examples/vit.py", device=device)
        converted = lowconv.convert(loaded.model, forced, loaded.inputs)
        sqnr[device] = lowconv.compare(loaded.model, converted, loaded.inputs).outputs[0].metrics.sqnr_db
    assert abs(sqnr["cpu"] - sqnr["cuda"]) < 1.0, sqnr


def test_window_sites_the_kernel_cannot_run_are_kept_on_cuda():
    """On CUDA the window op runs the Triton kernel: head_dim not a power of two >= 16, or a float64
    compute dtype, keep the site with why; what it can run converts and compares."""
    from lowconv.compat import sptr
    from lowconv.recipe import parse_recipe

    torch.manual_seed(0)
    n = 300
    xyz = torch.rand(n, 3, device="cuda") * torch.tensor([1.5, 1.5, 0.6], device="cuda")
    batch = (torch.arange(n, device="cuda") >= n // 2).long()

    def recipe(dtype):
        return parse_recipe(f'[[rules]]\nop = "sparse_attention"\noptions = {{ dtype = "{dtype}" }}')

    def plan(embed_dim, dtype, option):
        model = sptr.VarLengthMultiheadSA(embed_dim, 2, "w", 0.3, pe_type="contextual", quant_size=0.05)
        model = model.to("cuda", dtype).eval()
        inputs = (torch.randn(n, embed_dim, device="cuda", dtype=dtype), xyz, batch)
        converted = lowconv.convert(model, recipe(option), inputs)
        [decision] = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
        return model, inputs, converted, decision

    _, _, _, decision = plan(48, torch.float32, "auto")
    assert decision.op == "keep" and "head_dim a power of two >= 16 (got 24)" in decision.reason
    _, _, _, decision = plan(32, torch.float64, "auto")
    assert decision.op == "keep" and "not float64" in decision.reason
    for dtype, option in ((torch.float64, "float32"), (torch.float32, "auto")):
        model, inputs, converted, decision = plan(32, dtype, option)
        assert decision.op == "sparse_attention", decision.reason
        report = lowconv.compare(model, converted, inputs)
        assert report.passed and report.sites[0].alone.sqnr_db > 60, lowconv.report.report_to_table(report)


def test_model_writing_into_its_input_is_timed_and_left_alone_on_cuda():
    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            x[:, 0] = x[:, 0] * 2
            return self.lin(x)

    torch.manual_seed(0)
    model = Writes().cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    before = x.clone()
    converted = lowconv.convert(model, "fp8-dynamic", (x,))
    report = lowconv.compare(model, converted, (x,))
    assert torch.equal(x, before)
    assert report.passed and report.perf is not None, lowconv.report.report_to_table(report)
