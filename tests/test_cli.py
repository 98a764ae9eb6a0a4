import json
import re
import sys

import pytest

from lowconv.cli import main


def test_recipes_lists_builtins_with_descriptions(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "fp8-dynamic" in out and "2:4" in out


def test_inspect_lists_sites_and_with_a_recipe_the_decisions(capsys):
    assert main(["inspect", "examples/vit.py", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.attn.qkv" in out and "blocks.1.attn.attention" in out and "4x65x64" in out
    assert main(["inspect", "examples/gpt.py", "mixed", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "h.0.mlp.0" in out and "semi_sparse" in out and "rule 1 says keep" not in out
    assert "tied to wte.weight" in out


def test_convert_then_compare(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", "examples/text_classifier.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    for name in ("model.safetensors", "report.md", "report.json", "plan.json"):
        assert (out / name).is_file()
    captured = capsys.readouterr()
    assert "[1/" in captured.err  # progress
    assert "blocks.0.ff.0" in captured.out and "SQNR" in captured.out.upper()
    assert json.loads((out / "plan.json").read_text())["recipe"] == "fp8-dynamic"
    assert main(["compare", "examples/text_classifier.py", str(out)]) == 0
    capsys.readouterr()
    # Another seed builds other weights: the tensors the conversion kept no longer match.
    assert main(["compare", "examples/text_classifier.py", str(out), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds other values than this model" in err and "converted with --seed 0, this run used --seed 1" in err
    assert main(["convert", "examples/text_classifier.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    assert "(replacing the conversion there)" in capsys.readouterr().err


def test_compare_with_another_seed_is_refused_where_every_parameter_was_converted(tmp_path, capsys):
    """No parameter was kept as it was: the converted weights themselves (quantized, pruned) are
    told from another seed's."""
    model = tmp_path / "m.py"
    model.write_text("import torch\nfrom torch import nn\ndef build_model():\n"
                     "    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()\n"
                     "def example_inputs():\n    return torch.randn(4, 64)\n")
    out = tmp_path / "out"
    assert main(["convert", str(model), "fp8-row", "-o", str(out), "--device", "cpu"]) == 0
    assert main(["compare", str(model), str(out), "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["compare", str(model), str(out), "--device", "cpu", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "holds other values than this model" in err and "(e.g. 0.weight, 2.weight)" in err
    assert "converted with --seed 0, this run used --seed 5" in err


def test_compare_passes_a_model_with_per_build_buffers_and_a_nan_parameter(tmp_path):
    """A buffer that differs on every build (as torch.empty's memory may) and a NaN parameter
    (NaN != NaN) are not 'other weights'."""
    model = tmp_path / "m.py"
    model.write_text("import time, torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self):\n"
                     "        super().__init__(); self.fc = nn.Linear(16, 16); self.norm = nn.LayerNorm(16)\n"
                     "        self.register_buffer('built_at', torch.tensor([float(time.perf_counter_ns())]))\n"
                     "        self.unused = nn.Parameter(torch.tensor([float('nan')]))\n"
                     "    def forward(self, x):\n        return self.norm(self.fc(x))\n"
                     "def build_model():\n    return M().eval()\ndef example_inputs():\n    return torch.randn(4, 16)\n")
    out = tmp_path / "out"
    assert main(["convert", str(model), "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    assert main(["compare", str(model), str(out), "--device", "cpu"]) == 0


def test_gate_failure_exits_1(tmp_path):
    recipe = tmp_path / "strict.toml"
    recipe.write_text('[[rules]]\nop = "fp8"\n[report]\nmin_sqnr_db = 90\n')
    assert main(["convert", "examples/vit.py", str(recipe), "-o", str(tmp_path / "out"), "--device", "cpu"]) == 1
    assert main(["compare", "examples/vit.py", str(tmp_path / "out")]) == 1


def test_bad_recipe_is_exit_2_with_the_file_and_key(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[[rules]]\nop = "fp8"\noptions = { scaling = "lazy" }\n')
    assert main(["convert", "examples/vit.py", str(recipe), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{recipe}: rule 1: options.scaling" in err and "'dynamic'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("body, message", [
    ("def example_inputs():\n    return ()\n", "does not define build_model()"),
    ("import torch\ndef build_model():\n    return torch.nn.Linear(4, 4)\ndef example_inputs():\n    return None\n",
     "example_inputs() returned None"),
    ("import sys\ndef build_model():\n    sys.exit(0)\ndef example_inputs():\n    return ()\n",
     "build_model() called sys.exit(0)"),
    ("import argparse\nargparse.ArgumentParser().parse_args()\n", "importing it called sys.exit(2)"),
    ("import torch\nLOGITS = 'yes'\ndef build_model():\n    return torch.nn.Linear(4, 4)\n"
     "def example_inputs():\n    return torch.randn(2, 4)\n", "LOGITS must be True or False, got 'yes'"),
    ("def build_model():\n    raise ValueError('no weights')\ndef example_inputs():\n    return ()\n",
     "build_model() failed: ValueError: no weights"),
    ("def build_model():\n    return 3\ndef example_inputs():\n    return ()\n", "not a torch.nn.Module"),
    ("import torch\nclass M(torch.nn.Linear):\n    def forward(self, x):\n        raise KeyError('mask')\n"
     "def build_model():\n    return M(4, 4)\ndef example_inputs():\n    return torch.randn(2, 4)\n",
     "the model failed on its example inputs: KeyError: 'mask'"),
])
def test_model_file_mistakes_name_the_file_and_function(tmp_path, capsys, body, message):
    path = tmp_path / "m.py"
    path.write_text(body)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_a_model_file_imports_the_modules_beside_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "sibling_net_of_a_model_file.py").write_text(
        "from torch import nn\nclass Net(nn.Sequential):\n    def __init__(self):\n"
        "        super().__init__(nn.Linear(64, 32))\n")
    model = tmp_path / "model.py"
    model.write_text("import torch\nfrom sibling_net_of_a_model_file import Net\n"
                     "def build_model():\n    return Net().eval()\ndef example_inputs():\n    return torch.randn(4, 64)\n")
    try:
        assert main(["inspect", str(model), "fp8-dynamic"]) == 0
    finally:
        sys.modules.pop("sibling_net_of_a_model_file", None)
    assert "fp8" in capsys.readouterr().out


@pytest.mark.parametrize("inputs, forward", [
    ("(Batch(torch.randn(3, 32), torch.randn(3, 32)),)", "def forward(self, b):\n        return self.fc(b.x) + b.y\n"),
    ("UserDict(x=torch.randn(3, 32), y=torch.randn(3, 32))", "def forward(self, x, y):\n        return self.fc(x) + y\n"),
])
def test_example_inputs_in_named_tuples_and_mappings(tmp_path, capsys, inputs, forward):
    """A named tuple as an argument; a mapping that is not a dict (a tokenizer's BatchEncoding)
    as the keyword arguments."""
    model = tmp_path / "model.py"
    model.write_text("import collections, torch\nfrom collections import UserDict\nfrom torch import nn\n"
                     "Batch = collections.namedtuple('Batch', 'x y')\n"
                     "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     f"        self.fc = nn.Linear(32, 32)\n    {forward}"
                     "def build_model():\n    return Net().eval()\n"
                     f"def example_inputs():\n    return {inputs}\n")
    assert main(["convert", str(model), "fp8-dynamic", "-o", str(tmp_path / "out")]) == 0
    assert main(["compare", str(model), str(tmp_path / "out")]) == 0
    assert "fc" in capsys.readouterr().out


def test_a_directory_as_the_model_file_is_exit_2_and_says_so(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"model file {tmp_path} is a directory" in err and "lowconv compare" in err


def test_a_failed_write_leaves_the_output_directory_as_it_was(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    (out / "plan.json").unlink()
    (out / "plan.json").mkdir()  # the second run cannot write plan.json
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["convert", "examples/vit.py", "fp8-row", "-o", str(out), "--device", "cpu"]) == 2
    assert f"cannot write {out / 'plan.json'}: it is a directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_recipe_that_starts_with_a_byte_order_mark_reads(tmp_path, capsys):
    recipe = tmp_path / "bom.toml"
    recipe.write_bytes('[[rules]]\nop = "fp8"\n'.encode("utf-8-sig"))
    assert main(["inspect", "examples/vit.py", str(recipe)]) == 0
    assert "fp8" in capsys.readouterr().out


def test_recipe_that_is_not_text_is_exit_2(tmp_path, capsys):
    recipe = tmp_path / "bin.toml"
    recipe.write_bytes(b"\xff\xfe name='x'")
    assert main(["inspect", "examples/vit.py", str(recipe)]) == 2
    assert f"{recipe}: not a TOML recipe (not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda plan, meta: plan.update(model=None), "the plan in its metadata is not valid .*model is not a dict"),
    (lambda plan, meta: plan["decisions"][0]["site"].pop("fqn"), "the plan in its metadata is not valid .*decision 1: no site with an fqn"),
    (lambda plan, meta: plan["decisions"][0]["site"]["info"].pop("type"), "not valid .*decision 1: its site's info has no type"),
    (lambda plan, meta: plan.update(gate_min_sqnr_db="x"), r"not valid .*gate_min_sqnr_db is not a float \| None"),
    (lambda plan, meta: meta.update({"lowconv.aliases": "[1, 2]"}), "'lowconv.aliases' is not a JSON object"),
    (lambda plan, meta: plan.update(none_args={"": 5}), r"not valid .*none_args is not a dict\[str, list\[str\]\]"),
    (lambda plan, meta: plan.update(constant_args={"blocks.0": {"x": [1]}}), "not valid .*constant_args of blocks.0 is not"),
    (lambda plan, meta: plan["model"].update(seed="7"), "not valid .*model: seed '7' is not an integer"),
    (lambda plan, meta: plan["model"].update(dtype="float8"), "not valid .*model: dtype 'float8' is not one of: float32"),
    (lambda plan, meta: plan["decisions"][0]["site"]["info"].update(type="Bogus"),
     "not valid: the site blocks.0.attn.qkv: its info's type is not one of LinearInfo, AttentionInfo"),
    (lambda plan, meta: plan["decisions"][0]["site"]["info"].update(width=plan["decisions"][0]["site"]["info"].pop("in_features")),
     r"not valid: the site blocks.0.attn.qkv: its LinearInfo fields are \['bias', .*'width'\], not"),
    (lambda plan, meta: plan["decisions"][0]["site"].pop("region"), "not valid: the site blocks.0.attn.qkv: it has no region"),
    (lambda plan, meta: plan["decisions"][0]["site"]["input"].update(dtype="floaty"),
     "not valid: the site blocks.0.attn.qkv: its input is not a shape of sizes and a torch dtype"),
    (lambda plan, meta: plan["decisions"][0]["site"]["info"].update(dtype="floaty"), "its info's dtype 'floaty' is not a torch dtype"),
    (lambda plan, meta: meta.update(plan_text="[" * 100000 + "]" * 100000), "not valid .nested too deep to read"),
])
def test_a_checkpoint_with_a_corrupt_plan_is_exit_2(tmp_path, capsys, edit, message):
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = tmp_path / "out"
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    path = out / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    plan = json.loads(meta["lowconv.plan"])
    edit(plan, meta)
    meta["lowconv.plan"] = meta.pop("plan_text", None) or json.dumps(plan)
    save_file(tensors, path, metadata=meta)
    capsys.readouterr()
    assert main(["compare", "examples/vit.py", str(out), "--device", "cpu"]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("example", ["examples/vit.py", "examples/point_transformer.py"])
def test_a_plan_that_holds_attention_in_one_record_of_every_form_s_fields_loads(tmp_path, example):
    """Older plans keep every attention site's info as one AttentionInfo record with the fields of
    all forms (nn.MultiheadAttention's, SpTr's)."""
    import dataclasses

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import lowconv
    from lowconv.model_file import load_model_file
    from lowconv.site import MhaInfo, WindowInfo

    out = tmp_path / "out"
    assert main(["convert", example, "sparse-attention-bf16", "-o", str(out), "--device", "cpu"]) == 0
    loaded = load_model_file(example)
    expected = lowconv.load(loaded.model, out)
    path = out / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    plan = json.loads(meta["lowconv.plan"])
    every_field = {f.name: f.default for cls in (MhaInfo, WindowInfo) for f in dataclasses.fields(cls)}
    legacy = 0
    for decision in plan["decisions"]:
        info = decision["site"]["info"]
        if info["type"] in ("AttentionInfo", "MhaInfo", "WindowInfo"):
            decision["site"]["info"] = {**every_field, **info, "type": "AttentionInfo"}
            legacy += 1
    assert legacy
    meta["lowconv.plan"] = json.dumps(plan)
    save_file(tensors, path, metadata=meta)
    model = lowconv.load(loaded.model, out)
    with torch.no_grad():
        torch.testing.assert_close(model(*loaded.inputs), expected(*loaded.inputs), rtol=0, atol=0)


def test_compare_with_another_dtype_or_a_seed_out_of_range_is_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", "examples/vit.py", "fp16acc", "-o", str(out), "--device", "cpu", "--dtype", "float16"]) == 0
    capsys.readouterr()
    assert main(["compare", "examples/vit.py", str(out), "--device", "cpu", "--dtype", "bfloat16"]) == 2
    assert "was converted with --dtype float16" in capsys.readouterr().err
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["compare", "examples/vit.py", str(out), "--device", "cpu", "--dtype", "bfloat16"]) == 2
    assert "was converted without --dtype" in capsys.readouterr().err
    assert main(["inspect", "examples/vit.py", "--seed", str(2 ** 70)]) == 2
    assert "out of range" in capsys.readouterr().err


def test_output_path_that_is_a_file_is_exit_2_and_the_file_is_kept(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("mine")
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(out), "--device", "cpu"]) == 2
    assert str(out) in capsys.readouterr().err and out.read_text() == "mine"


def test_an_output_that_cannot_be_written_fails_before_the_work(tmp_path, monkeypatch, capsys):
    """A full or read-only disk, or a file where a directory must go: said before the model is
    built, not after the conversion and comparison."""
    import errno
    import tempfile

    from lowconv import cli

    def not_reached(*args, **kwargs):
        raise AssertionError("the model was built before the output was checked")
    monkeypatch.setattr(cli, "load_model", not_reached)
    (tmp_path / "a_file").write_text("")
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(tmp_path / "a_file" / "out")]) == 2
    assert f"cannot write in {tmp_path / 'a_file'}" in capsys.readouterr().err

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tempfile, "TemporaryFile", full)
    assert main(["convert", "examples/vit.py", "fp8-dynamic", "-o", str(tmp_path / "new" / "out")]) == 2
    assert f"-o {tmp_path / 'new' / 'out'}: cannot write in {tmp_path}: No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
