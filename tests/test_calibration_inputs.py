"""A model file's calibration_inputs(): what `lowconv convert` calibrates static scales on."""
import json

import pytest
from safetensors import safe_open

from lowconv.cli import main

MODEL = """import torch
from torch import nn
CALLS = []
def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32)).eval()
def example_inputs():
    return torch.randn(4, 32)
def calibration_inputs():
{body}
"""


def model_file(tmp_path, body: str):
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(body=body))
    return path


def input_scale(out) -> float:
    with safe_open(out / "model.safetensors", "pt") as f:
        return f.get_tensor("0.input_scale").item()


def test_static_scales_come_from_the_batches_asked_for(tmp_path):
    # batch i has amax about 10 * (i + 1): N batches give a scale of about 10 * N / 448
    path = model_file(tmp_path, "    for i in range(10):\n        x = torch.zeros(4, 32)\n"
                                "        x[0, 0] = 10.0 * (i + 1)\n        yield x")
    assert main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "three"), "--calibration", "3"]) == 0
    assert input_scale(tmp_path / "three") == pytest.approx(30 / 448, rel=1e-3)
    plan = json.loads((tmp_path / "three" / "plan.json").read_text())
    assert plan["model"]["calibration"] == "3 batches of the calibration inputs given"
    assert "Scales calibrated on 3 batches" in (tmp_path / "three" / "report.md").read_text()
    assert main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "all")]) == 0  # default: every batch
    assert input_scale(tmp_path / "all") == pytest.approx(100 / 448, rel=1e-3)


def test_calibration_inputs_are_not_asked_for_without_static_scales(tmp_path):
    path = model_file(tmp_path, "    raise RuntimeError('asked for')")
    assert main(["convert", str(path), "fp8-row", "-o", str(tmp_path / "out")]) == 0
    assert "calibration" not in json.loads((tmp_path / "out" / "plan.json").read_text())["model"]


def test_the_example_inputs_calibrate_where_the_file_has_no_calibration_inputs(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL.split("def calibration_inputs")[0])
    assert main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "out")]) == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["model"]["calibration"] == "the example inputs (1 batch)"


def test_calibration_mistakes_name_what_is_wrong(tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(MODEL.split("def calibration_inputs")[0])
    assert main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "out"), "--calibration", "2"]) == 2
    assert "defines no calibration_inputs()" in capsys.readouterr().err
    path = model_file(tmp_path, "    return 3")
    assert main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "out")]) == 2
    assert "calibration_inputs() returned int, not an iterable" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", str(path), "fp8-static", "-o", str(tmp_path / "out"), "--calibration", "0"])
    assert "1 or more" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
