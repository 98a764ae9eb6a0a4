"""Seeded mutations of JSON-like values (dicts, lists, scalars) for the fuzz tests of plans and
recipes (hypothesis is not in the pinned test set)."""
import copy
import random

JUNK = [None, True, -1, 0, 3.5, 1e308, float("nan"), "", "x" * 200, "float8_e4m3fn", "torch.float32", [], {},
        [[[[[]]]]], {"type": "AttentionInfo"}, ["re:(a+)+$"], "../../etc/passwd"]


def paths(value, prefix=()):
    """Every place in a JSON value: (path, value) pairs, depth first."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def mutated(plan: dict, rng: random.Random, junk: list = JUNK) -> dict:
    """A copy of `plan` with one place replaced by junk, deleted or its container swapped (a dict
    for a list, a list for a dict)."""
    plan = copy.deepcopy(plan)
    path, value = rng.choice([p for p in paths(plan) if p[0]])
    parent = plan
    for step in path[:-1]:
        parent = parent[step]
    kind = rng.choice(["junk", "junk", "delete", "swap"])
    if kind == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif kind == "swap" and isinstance(value, (dict, list)) and value:
        parent[path[-1]] = list(value.values()) if isinstance(value, dict) else dict(enumerate(value))
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(junk))
    return plan
