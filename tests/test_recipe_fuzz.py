"""Crafted recipes: every built-in recipe mutated at random places (its TOML data, then at times
its text), seeded, is either refused with a LowconvError that names the file or converts a model
that runs; never another exception (issue 25)."""
import json
import math
import random
import tomllib
from collections import Counter

import pytest
import torch
from torch import nn

import lowconv
from lowconv.errors import LowconvError
from lowconv.recipe import builtin_recipes, parse_recipe
from tests.mutation import JUNK, mutated

MUTATIONS = 300
RECIPE_JUNK = JUNK + ["fp8", "keep", "semi_sparse", "sparse_attention", "linear", "attention", "re:(a|b)*",
                      "re:[", "re:.*", {"granularity": "block"}, {"scaling": "static", "granularity": "token"},
                      {"dtype": "float8_e4m3fn"}, {"backend": "cusparselt", "training": True}, -1e9, 2 ** 70,
                      float("inf"), {"layout": "local", "window": -3}]
TEXT_JUNK = ["[[rules]]", "[report]", "kind = 3", 'modules = ["re:(a+)+$"]', "op =", "{", 'name = """',
             "rules = 5", "[[rules.options]]", "x" * 300 + " = 1", "options = { granularity = { a = [[[1]]] } }"]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"


def to_toml(data: dict) -> str:
    """TOML for a recipe's data: scalars, then [[rules]] tables (where rules is a list of tables),
    then [report]; None (TOML has none) leaves the key out."""
    tables = {key: value for key, value in data.items()
              if isinstance(value, dict) or (key == "rules" and isinstance(value, list)
                                             and value and all(isinstance(r, dict) for r in value))}
    lines = [f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in data.items() if k not in tables and v is not None]
    for key, value in tables.items():
        for table in (value if isinstance(value, list) else [value]):
            lines.append(f"[[{key}]]" if isinstance(value, list) else f"[{key}]")
            lines += [f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def edited_text(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    where = rng.randrange(len(lines) + 1)
    if rng.random() < 0.5 and lines:
        del lines[min(where, len(lines) - 1)]
    else:
        lines.insert(where, rng.choice(TEXT_JUNK))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def model_and_input():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 1).eval()
    return model, torch.randn(2, 5, 32)


def test_the_writer_gives_each_built_in_recipe_back():
    for path in builtin_recipes().values():
        data = tomllib.loads(path.read_text())
        assert tomllib.loads(to_toml(data)) == data


def outcome(text: str, model: nn.Module, x: torch.Tensor) -> str:
    """"converted" (and the converted model ran), or "refused: MESSAGE" from parse_recipe or
    "refused at convert"; any other exception is the defect the fuzz test looks for."""
    try:
        recipe = parse_recipe(text, "fuzz.toml")
    except LowconvError as err:
        return f"refused: {err}"
    try:
        lowconv.convert(model, recipe, (x,))(x)
    except LowconvError:
        return "refused at convert"
    return "converted"


def test_mutated_recipes_convert_or_are_refused_by_name(model_and_input):
    model, x = model_and_input
    originals = [tomllib.loads(path.read_text()) for path in builtin_recipes().values()]
    rng = random.Random(0)
    outcomes = Counter()
    for i in range(MUTATIONS):
        text = to_toml(mutated(rng.choice(originals), rng, RECIPE_JUNK))
        if rng.random() < 0.3:
            text = edited_text(text, rng)
        try:
            result = outcome(text, model, x)
        except Exception as err:  # noqa: BLE001: any other exception is the defect this test looks for
            pytest.fail(f"mutation {i}:\n{text[:600]}\n{type(err).__name__}: {err}")
        kind, _, message = result.partition(": ")
        assert kind != "refused" or "fuzz.toml" in message, f"mutation {i}: the error does not name the file: {message}"
        outcomes[kind] += 1
    assert outcomes["converted"] and outcomes["refused"], outcomes
