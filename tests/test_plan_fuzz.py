"""Crafted plans: a valid plan mutated at random places, seeded (no hypothesis in the pinned test
set), loads into a model or is refused with a LowconvError; never another exception (issue 25)."""
import json
import random

import pytest
import torch
from safetensors import safe_open
from torch import nn

import lowconv
from lowconv.checkpoint import CHECKPOINT_FILE, PLAN_KEY, write_safetensors
from lowconv.errors import LowconvError
from tests.mutation import mutated

MUTATIONS = 400


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 1).eval()
    x = torch.randn(2, 5, 32)
    out = tmp_path_factory.mktemp("out")
    lowconv.save(lowconv.convert(model, "mixed", (x,)), out)
    with safe_open(out / CHECKPOINT_FILE, "pt") as f:
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # not the file's memory map: it is rewritten
        metadata = f.metadata()
    return model, x, out, tensors, metadata


def test_mutated_plans_load_or_are_refused_by_name(saved, tmp_path):
    model, x, out, tensors, metadata = saved
    plan = json.loads(metadata[PLAN_KEY])
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(MUTATIONS):
        crafted = mutated(plan, rng)
        write_safetensors(out / CHECKPOINT_FILE, tensors, {**metadata, PLAN_KEY: json.dumps(crafted)})
        try:
            loaded = lowconv.load(model, out, (x,))
            loaded(x)
            outcomes["loaded"] += 1
        except LowconvError:
            outcomes["refused"] += 1
        except Exception as err:  # noqa: BLE001: any other exception is the defect this test looks for
            pytest.fail(f"mutation {i} ({json.dumps(crafted)[:300]}...): {type(err).__name__}: {err}")
    assert outcomes["loaded"] and outcomes["refused"]
