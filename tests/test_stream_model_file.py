"""A model file with weights_path(): lowconv loads those safetensors into what build_model() built
(strictly, by state-dict name, a model built on meta too), and convert --stream streams it as it
streams an hf:DIR model: the in-memory conversion's files and report."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from lowconv.cli import main
from lowconv.errors import LowconvError
from lowconv.model_file import load_model_file
from lowconv.stream import stream_convert
from tests.test_stream import same_conversion

MODEL_FILE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(64, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 64), nn.Linear(64, hidden)
        self.lm_head = nn.Linear(hidden, 64, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((hidden,), 0.5))

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        return self.lm_head(x + self.fc2(torch.relu(self.fc1(x))))


def build_model():
    return Net({hidden})


def example_inputs():
    return (torch.randint(0, 64, (2, 8)),)


def calibration_inputs():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 8), generator=g),) for _ in range(3)]


def weights_path():
    return {weights!r}


LOGITS = True
"""


def model_file(directory: Path, hidden: int = 32, weights: str = "weights/model.safetensors", **drop) -> Path:
    """The model file, and its weights (random, seed 1) saved where weights_path() says."""
    text = MODEL_FILE.format(hidden=hidden, weights=weights)
    for name in drop:
        start = text.index(f"def {name}(")
        text = text[:start] + text[text.index("\n\n\n", start) + 3:]
    path = directory / "net.py"
    path.write_text(text)
    return path


def save_weights(path: Path, model_path: Path, hidden: int = 32) -> None:
    namespace = {}
    exec(compile(MODEL_FILE.format(hidden=hidden, weights=""), str(model_path), "exec"), namespace)
    torch.manual_seed(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    net = namespace["Net"](hidden)
    net.scale.fill_(0.75)  # a persistent buffer the checkpoint holds: loaded, not the built 0.5
    save_model(net, str(path))  # the tied weight stored once


@pytest.fixture
def net(tmp_path) -> Path:
    path = model_file(tmp_path)
    save_weights(tmp_path / "weights" / "model.safetensors", path)
    return path


def test_weights_path_is_loaded_into_the_built_model(net):
    loaded = load_model_file(net)
    state = dict(loaded.model.state_dict())
    assert loaded.model.lm_head.weight is loaded.model.embed.weight  # still tied
    assert torch.equal(state["scale"], torch.full((32,), 0.75))
    from safetensors.torch import load_file
    saved = load_file(net.parent / "weights" / "model.safetensors")
    assert all(torch.equal(state[name], saved[name]) for name in saved)


def test_a_model_built_on_meta_loads_its_weights(net):
    net.write_text(net.read_text().replace("    return Net(32)", "    with torch.device('meta'):\n        return Net(32)"))
    loaded = load_model_file(net)
    assert not any(p.is_meta for p in loaded.model.parameters()) and loaded.model.lm_head.weight is loaded.model.embed.weight
    assert loaded.model.scale.is_meta is False and loaded.model(*loaded.inputs).shape == (2, 8, 64)


@pytest.mark.parametrize("change, says", [
    (dict(hidden=48), r"holds embed.weight with shape \[64, 32\], but build_model\(\)'s model has \[64, 48\]"),
    (dict(weights="nowhere.safetensors"), r"its weights, .*nowhere.safetensors, do not exist"),
])
def test_mismatched_weights_are_refused_by_name(tmp_path, net, change, says):
    other = tmp_path / "other"
    other.mkdir()
    path = model_file(other, **change)
    if "hidden" in change:
        (other / "weights").symlink_to(net.parent / "weights")
    with pytest.raises(LowconvError, match=says):
        load_model_file(path)


def test_a_checkpoint_with_more_or_fewer_tensors_is_refused(tmp_path, net):
    from safetensors.torch import load_file, save_file
    saved = load_file(net.parent / "weights" / "model.safetensors")
    save_file({**saved, "extra": torch.zeros(2)}, net.parent / "weights" / "model.safetensors")
    with pytest.raises(LowconvError, match=r"its checkpoint \(.*weights/model.safetensors\) holds 1 tensors "
                                           r"build_model\(\)'s model lacks: extra"):
        load_model_file(net)
    del saved["fc2.bias"], saved["scale"]  # a persistent buffer is held to it too
    save_file(saved, net.parent / "weights" / "model.safetensors")
    with pytest.raises(LowconvError, match=r"lacks 2 tensors of build_model\(\)'s model: fc2.bias, scale"):
        load_model_file(net)


def test_a_model_built_on_meta_with_nothing_to_fill_it_is_refused(tmp_path, net):
    """Without weights_path(), or with a buffer no state dict holds (not persistent), on meta."""
    on_meta = net.read_text().replace("    return Net(32)", "    with torch.device('meta'):\n        return Net(32)")
    bare = tmp_path / "bare"
    bare.mkdir()
    path = model_file(bare, weights_path=None)
    path.write_text(on_meta[:on_meta.index("def weights_path")] + "LOGITS = True\n")
    with pytest.raises(LowconvError, match=r"build_model\(\) built 7 tensors on the meta device \(no values\) that "
                                           r"nothing fills: embed.weight, .*; define weights_path\(\)"):
        load_model_file(path)
    net.write_text(on_meta.replace('self.register_buffer("scale", torch.full((hidden,), 0.5))',
                                   'self.register_buffer("scale", torch.full((hidden,), 0.5), persistent=False)'))
    from safetensors.torch import load_file, save_file
    saved = load_file(net.parent / "weights" / "model.safetensors")
    del saved["scale"]
    save_file(saved, net.parent / "weights" / "model.safetensors")
    for load in (load_model_file, lambda path: stream_convert(str(path), "fp8-row", tmp_path / "out")):
        with pytest.raises(LowconvError, match=r"built 1 tensors on the meta device \(no values\) that nothing fills: "
                                               r"scale; save them in weights_path\(\)'s checkpoint"):
            load(net)


@pytest.mark.parametrize("recipe, calibration", [("fp8-row", []), ("fp8-static", ["--calibration", "2"])])
def test_a_model_file_streams_to_the_in_memory_conversion(tmp_path, net, recipe, calibration):
    args = [str(net), recipe, "--device", "cpu", *calibration]
    assert main(["convert", *args, "-o", str(tmp_path / "memory")]) == 0
    assert main(["convert", *args, "--stream", "-o", str(tmp_path / "stream")]) == 0
    ours, report = same_conversion(tmp_path / "memory", tmp_path / "stream")
    assert [o["name"] for o in report["outputs"]] == ["output"] and report["outputs"][0]["logits"]  # LOGITS = True
    plan = json.loads((tmp_path / "stream" / "plan.json").read_text())
    if calibration:
        assert plan["model"]["calibration"] == "2 batches of the calibration inputs given"
        assert "fc1.input_scale" in ours


def test_stream_refuses_a_model_file_without_weights_or_calibration_inputs(tmp_path, net, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    path = model_file(bare, weights_path=None)
    with pytest.raises(LowconvError, match=r"--stream reads a model file's weights from the safetensors "
                                           r"weights_path\(\) names, and .*net.py defines no weights_path\(\)"):
        stream_convert(str(path), "fp8-row", tmp_path / "out")
    uncalibrated = tmp_path / "uncalibrated"
    uncalibrated.mkdir()
    (uncalibrated / "weights").symlink_to(net.parent / "weights")
    path = model_file(uncalibrated, calibration_inputs=None)
    capsys.readouterr()
    assert main(["convert", str(path), "fp8-static", "--stream", "--calibration", "2", "-o", str(tmp_path / "out")]) == 2
    assert f"--calibration: {path} defines no calibration_inputs()" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
