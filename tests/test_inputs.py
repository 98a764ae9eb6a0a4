"""Example inputs as the plan keeps them (lowconv/inputs.py), and load tracing again without the user's."""
import dataclasses

import pytest
import torch
from torch import nn

import lowconv
from lowconv.api import attach_plan
from lowconv.errors import LowconvError
from lowconv.inputs import MAX_ELEMENTS, describe, stand_ins


def encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2).eval()


def test_a_conversion_whose_branches_the_inputs_decided_loads_without_them(tmp_path):
    """nn.TransformerEncoder's trace decides branches on its inputs' shapes and flags: load traces
    it again with stand-ins of the shapes and dtypes the plan kept."""
    model, x = encoder(), torch.randn(2, 10, 64)
    converted = lowconv.convert(model, "fp8-dynamic", (x,))
    assert converted.lowconv_plan.decided[""] and converted.lowconv_plan.example_inputs == {
        "args": [{"shape": [2, 10, 64], "dtype": "float32"}]}
    lowconv.save(converted, tmp_path)
    loaded = lowconv.load(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x), converted(x))


def test_descriptions_and_their_stand_ins():
    ids, mask = torch.randint(0, 9, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    described = describe({"input_ids": ids, "attention_mask": mask, "use_cache": False, "labels": None})
    made = stand_ins(described, torch.device("cpu"), "plan")
    assert list(made) == ["input_ids", "attention_mask", "use_cache", "labels"]
    assert made["input_ids"].dtype == torch.int64 and made["input_ids"].shape == (2, 5) and made["input_ids"].eq(1).all()
    assert made["attention_mask"].all() and made["use_cache"] is False and made["labels"] is None
    x = stand_ins(describe(torch.randn(3, 4, dtype=torch.float16)), torch.device("cpu"), "plan")
    assert isinstance(x, tuple) and x[0].shape == (3, 4) and x[0].dtype == torch.float16


@pytest.mark.parametrize("example", [({"cache": object()}), ((torch.ones(2), [torch.ones(2)]))],
                         ids=["an object", "a list of tensors"])
def test_inputs_that_are_not_tensors_or_constants_are_not_kept(example):
    assert describe(example) is None


@pytest.mark.parametrize("description, message", [
    ({"args": [{"shape": [2, -1], "dtype": "float32"}]}, "is not a shape and a dtype"),
    ({"args": [{"shape": [2], "dtype": "os.system"}]}, "is not a shape and a dtype"),
    ({"args": [{"value": [1, 2]}]}, "is not a constant"),
    ({"args": [{"shape": [MAX_ELEMENTS + 1], "dtype": "float32"}]}, "more than the"),
    ({"arguments": []}, "KeyError"),
])
def test_a_crafted_description_is_refused_naming_the_file(description, message):
    with pytest.raises(LowconvError, match=rf"out/model.safetensors: the plan's example_inputs are not valid .*{message}"):
        stand_ins(description, torch.device("cpu"), "out/model.safetensors")


def test_without_kept_inputs_load_says_to_pass_them(tmp_path):
    model, x = encoder(), torch.randn(2, 10, 64)
    converted = lowconv.convert(model, "fp8-dynamic", (x,))
    # as for inputs that were neither tensors nor constants (the plan is frozen: a new one)
    attach_plan(converted, dataclasses.replace(converted.lowconv_plan, example_inputs=None))
    lowconv.save(converted, tmp_path)
    with pytest.raises(LowconvError, match="its branches were decided by the example inputs: pass example_inputs"):
        lowconv.load(model, tmp_path)
    assert torch.equal(lowconv.load(model, tmp_path, (x,))(x), converted(x))
