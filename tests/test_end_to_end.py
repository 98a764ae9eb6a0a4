"""convert -> save -> load -> compare for every example and every built-in recipe."""
import copy
import inspect
import math

import pytest
import torch

import lowconv
from lowconv.errors import LowconvError
from lowconv.model_file import load_model_file
from lowconv.recipe import builtin_recipes, parse_recipe

EXAMPLES = ["examples/vit.py", "examples/gpt.py", "examples/text_classifier.py"]


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


@pytest.mark.parametrize("recipe", sorted(builtin_recipes()))
@pytest.mark.parametrize("example", EXAMPLES)
def test_convert_save_load_compare(example, recipe, tmp_path):
    dtype = "float16" if recipe == "fp16acc" else None  # fp16acc converts fp16 models only
    loaded = load_model_file(example, dtype=dtype)
    model, inputs = loaded.model, loaded.inputs
    before = copy.deepcopy(model.state_dict())

    converted = lowconv.convert(model, recipe, inputs)
    plan = converted.lowconv_plan
    # the examples' linears are narrower than fp8-block's 128 x 128 tiles: kept, with that reason
    whole_tiles_only = recipe == "fp8-block" and any("divisible by 128" in d.reason for d in plan.decisions)
    if recipe != "keep-all" and not whole_tiles_only:
        assert plan.converted(), f"{recipe} converted nothing in {example}"
    lowconv.save(converted, tmp_path)
    again = lowconv.load(model, tmp_path)
    assert torch.equal(run(again, inputs), run(converted, inputs))

    report = lowconv.compare(model, converted, inputs, logits=True)
    assert {row.fqn for row in report.sites} == {d.fqn for d in plan.converted()}
    assert all(row.metrics is not None for row in report.sites)
    out = report.outputs[0].metrics
    assert out.nan == 0 and out.inf == 0
    if recipe == "keep-all":
        assert math.isinf(out.sqnr_db) and out.max_abs == 0
    assert report.passed, lowconv.report.report_to_table(report)
    # the user's model is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp8_report_numbers_are_real():
    loaded = load_model_file("examples/vit.py")
    converted = lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs)
    report = lowconv.compare(loaded.model, converted, loaded.inputs, logits=True)
    qkv = next(r for r in report.sites if r.fqn == "blocks.0.attn.qkv")
    assert 20 < qkv.metrics.sqnr_db < 40  # fp8 e4m3 per-tensor lands in the high 20s to low 30s dB
    for row in report.sites:  # alone, each site shows its own error, not the accumulated one
        assert 25 < row.alone.sqnr_db < 40 and row.alone.sqnr_db >= row.metrics.sqnr_db - 1, row
    assert report.outputs[0].logits is not None and report.outputs[0].logits.top1 > 0.5


def test_attention_alone_error_fits_its_dtype():
    loaded = load_model_file("examples/gpt.py")
    converted = lowconv.convert(loaded.model, "sparse-attention-bf16", loaded.inputs)
    report = lowconv.compare(loaded.model, converted, loaded.inputs)
    assert [row.op for row in report.sites] == ["sparse_attention"] * 2
    assert all(40 < row.alone.sqnr_db < 70 for row in report.sites)  # bf16: 8 mantissa bits


def test_plan_lists_why_sites_are_kept():
    loaded = load_model_file("examples/gpt.py")
    converted = lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs)
    head = next(d for d in converted.lowconv_plan.decisions if d.fqn == "lm_head")
    assert head.op == "keep" and "tied to wte.weight" in head.reason


def test_load_refuses_a_different_model(tmp_path):
    loaded = load_model_file("examples/vit.py")
    lowconv.save(lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs), tmp_path)
    other = load_model_file("examples/gpt.py").model
    with pytest.raises(LowconvError, match="converted from a different model"):
        lowconv.load(other, tmp_path)


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "semi-sparse", "keep-all"])
def test_a_model_cast_after_conversion_loads_from_the_original(recipe, tmp_path):
    loaded = load_model_file("examples/vit.py")
    converted = lowconv.convert(loaded.model, recipe, loaded.inputs).to(torch.bfloat16)
    lowconv.save(converted, tmp_path)
    again = lowconv.load(loaded.model, tmp_path)  # the float32 original
    inputs = [x.to(torch.bfloat16) for x in loaded.inputs]
    assert {t.dtype for t in again.state_dict().values()} == {t.dtype for t in converted.state_dict().values()}
    assert torch.equal(run(again, inputs), run(converted, inputs))
    with pytest.raises(LowconvError, match="was converted from this model in float32: load it with the model in"):
        lowconv.load(loaded.model.to(torch.bfloat16), tmp_path)


def edit_checkpoint(directory, edit):
    """Rewrite directory's model.safetensors with edit(tensors) applied, its metadata kept but for
    the tensors' checksums (as a file written before them, or crafted: what load checks beyond)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    metadata.pop("lowconv.checksums")
    save_file(tensors, path, metadata=metadata)


def test_load_names_missing_tensors(tmp_path):
    loaded = load_model_file("examples/vit.py")
    lowconv.save(lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs), tmp_path)
    edit_checkpoint(tmp_path, lambda tensors: tensors.pop("blocks.0.attn.qkv.weight_scale"))
    with pytest.raises(LowconvError, match="blocks.0.attn.qkv.weight_scale"):
        lowconv.load(loaded.model, tmp_path)


@pytest.mark.parametrize("name,value", [("input_scale", 0.0), ("input_scale", float("nan")),
                                        ("weight_scale", -1.0)])
def test_load_refuses_scales_that_would_poison_the_outputs(tmp_path, name, value):
    loaded = load_model_file("examples/vit.py")
    lowconv.save(lowconv.convert(loaded.model, "fp8-static", loaded.inputs), tmp_path)
    key = f"blocks.0.attn.qkv.{name}"
    edit_checkpoint(tmp_path, lambda tensors: tensors.update({key: torch.full_like(tensors[key], value)}))
    with pytest.raises(LowconvError, match=rf"model.safetensors: blocks.0.attn.qkv: {name} must be finite and > 0"):
        lowconv.load(loaded.model, tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t["bitmask"].__setitem__((0, 0), 0xFF), r"bitmask must keep 2 of every 4 weights; 2 groups of 4 keep \[4\]"),
    (lambda t: t["bitmask"].__setitem__((0, 0), 0b00010111), r"bitmask must keep 2 of every 4 weights; 2 groups of 4 keep \[1, 3\]"),  # 4 bits still
    (lambda t: t["shape"].__setitem__((1, 0), 8), r"shape must be \[\[\d+\], \[\d+\]\], got"),
])
def test_load_refuses_2to4_tensors_that_are_not_2to4(tmp_path, edit, message):
    """A crafted bitmask (a byte of 0xFF; the same count of bits, no longer 2 of every 4) or shape:
    refused at load, naming the layer, where it crashed at the first call or passed compare."""
    loaded = load_model_file("examples/vit.py")
    lowconv.save(lowconv.convert(loaded.model, "semi-sparse", loaded.inputs), tmp_path)
    layer = "blocks.0.mlp.fc1"

    def edited(tensors):
        edit({"bitmask": tensors[f"{layer}.bitmask"], "shape": tensors[f"{layer}.shape"]})
    edit_checkpoint(tmp_path, edited)
    with pytest.raises(LowconvError, match=rf"model.safetensors: {layer}: {message}"):
        lowconv.load(loaded.model, tmp_path)


def test_load_refuses_a_2to4_training_mask_that_is_not_2to4(tmp_path):
    loaded = load_model_file("examples/vit.py")
    recipe = parse_recipe('[[rules]]\nkind = "linear"\nop = "semi_sparse"\noptions = { training = true }')
    lowconv.save(lowconv.convert(loaded.model, recipe, loaded.inputs), tmp_path)
    layer = "blocks.0.mlp.fc1"
    edit_checkpoint(tmp_path, lambda tensors: tensors[f"{layer}.mask"].__setitem__((0, slice(0, 4)), True))
    with pytest.raises(LowconvError, match=rf"model.safetensors: {layer}.mask: mask must keep 2 of every 4 weights; "
                                           r"1 groups of 4 keep \[4\]"):
        lowconv.load(loaded.model, tmp_path)


def test_corrupt_checkpoint_is_an_error_naming_the_file(tmp_path):
    loaded = load_model_file("examples/vit.py")
    lowconv.save(lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(LowconvError, match="model.safetensors"):
        lowconv.load(loaded.model, tmp_path)


def test_converted_model_trains():
    loaded = load_model_file("examples/vit.py")
    converted = lowconv.convert(loaded.model, "mixed", loaded.inputs)
    converted.train()
    loss = converted(*loaded.inputs).logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in converted.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


class Branchy(torch.nn.Module):
    """Data-dependent control flow at the root: only its children trace."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x):
        if x.mean() > 0:
            x = x.flip(0)
        return self.head(self.body(x))


def test_untraceable_model_converts_its_traceable_parts(tmp_path):
    torch.manual_seed(0)
    model, inputs = Branchy().eval(), (torch.randn(8, 32),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    plan = converted.lowconv_plan
    line = inspect.getsourcelines(Branchy.forward)[1] + 1  # the `if` on a traced value
    assert plan.untraced == [{"fqn": "", "error": "TraceError: symbolically traced variables cannot be used "
                                                  f"as inputs to control flow (at tests/test_end_to_end.py:{line})"}]
    assert plan.regions == ["body", "head"]
    assert {d.fqn: d.op for d in plan.decisions} == {"body.0": "fp8", "body.2": "fp8", "head": "fp8"}
    lowconv.save(converted, tmp_path)
    assert torch.equal(run(lowconv.load(model, tmp_path), inputs), run(converted, inputs))
    report = lowconv.compare(model, converted, inputs)
    assert [r.fqn for r in report.sites] == ["body.0", "body.2", "head"] and report.outputs[0].metrics.sqnr_db > 20


class WritesIntoInput(torch.nn.Module):
    """Writes into its input tensor before using it, by item assignment or an in-place method."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, x, scale=None):
        if self.how == "setitem":
            x[:, 0] = x[:, 0] * 2
        else:
            x[:, 0].mul_(2)
        if scale is not None:
            scale.add_(1)  # a tensor in a kwarg too
            x = x * scale
        return self.body(x)


@pytest.mark.parametrize("recipe", ["keep-all", "fp8-dynamic", "fp8-static"])
@pytest.mark.parametrize("how", ["setitem", "inplace"])
def test_model_writing_into_its_inputs(how, recipe, tmp_path):
    """lowconv runs the model several times (first calls, shape propagation, calibration, the
    reference and traced runs of compare): each gets fresh clones, so the user's tensors stay as
    they were and every run sees the same values."""
    torch.manual_seed(0)
    model = WritesIntoInput(how).eval()
    x, scale = torch.randn(8, 32), torch.ones(())
    inputs = {"x": x, "scale": scale}
    x_before, scale_before = x.clone(), scale.clone()
    expected = model(x.clone(), scale=scale.clone())

    converted = lowconv.convert(model, recipe, inputs)
    assert torch.equal(x, x_before) and torch.equal(scale, scale_before)
    if recipe != "keep-all":
        assert {d.fqn for d in converted.lowconv_plan.converted()} == {"body.0", "body.2"}
    report = lowconv.compare(model, converted, inputs)
    assert torch.equal(x, x_before) and torch.equal(scale, scale_before)
    assert report.passed, lowconv.report.report_to_table(report)
    lowconv.save(converted, tmp_path)
    again = lowconv.load(model, tmp_path, example_inputs=inputs)
    assert torch.equal(x, x_before) and torch.equal(scale, scale_before)
    if recipe == "keep-all":
        assert torch.equal(converted(x.clone(), scale=scale.clone()), expected)
    assert torch.equal(again(x.clone(), scale=scale.clone()), converted(x.clone(), scale=scale.clone()))


def test_a_model_that_does_not_repeat_itself_is_named_as_the_cause():
    """A model whose output changes from run to run (here a counter of its calls; spconv's threaded
    CPU convolutions in SphereFormer) is refused as such, not as a tracing problem."""
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.fc(x) + 0.1 * self.calls

    model, x = Noisy().eval(), torch.randn(8, 16)
    converted = lowconv.convert(model, "fp8-dynamic", x)
    assert model.calls == 0  # convert's runs wrote into its copy's buffer, not the model's
    with pytest.raises(LowconvError, match=r"does not compute the same output twice on these inputs \(SQNR [\d.]+ "
                                           r"dB between two runs of the unconverted model\)"):
        lowconv.compare(model, converted, x)
