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
    """The same conversion on CPU and on CUDA gives output SQNRs within 1 dB."""
    sqnr = {}
    for device in ("cpu", "cuda"):
        loaded = load_model_file("examples/vit.py", device=device)
        converted = lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs)
        sqnr[device] = lowconv.compare(loaded.model, converted, loaded.inputs).outputs[0].metrics.sqnr_db
    assert abs(sqnr["cpu"] - sqnr["cuda"]) < 1.0, sqnr
