"""Typed options from a table (a recipe's TOML, a plan's JSON): every key checked against the
Options dataclass's annotation, errors naming where the key is and what it may be, in TOML's words."""
from __future__ import annotations

import dataclasses
import re
import types
import typing

from lowconv.errors import LowconvError


def parse_options(cls: type, raw, where: str):
    """Build an Options dataclass from a table (TOML or JSON), checking every key against its annotation."""
    raw = expect(raw, dict, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown_keys(raw, set(fields), where)
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        allowed = allowed_values(hints[key])
        if not any(fits(value, a) for a in allowed):
            raise LowconvError(f"{where}.{key}: got {value!r}; expected {describe(allowed)}")
    try:
        return cls(**raw)
    except ValueError as err:  # an Options' __post_init__: (message, key)
        message, key = err.args
        raise LowconvError(f"{where}.{key}: {message}") from None


def allowed_values(hint) -> list:
    """A type hint as a flat list of types and literal values."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return [("literal", v) for v in typing.get_args(hint)]
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in allowed_values(arg)]
    return [hint]


def fits(value, allowed) -> bool:
    if isinstance(allowed, tuple):
        return value == allowed[1] and type(value) is type(allowed[1])
    if allowed is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if allowed is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if allowed is type(None):
        return value is None
    return isinstance(value, allowed)


def describe(allowed: list) -> str:
    """The allowed values in TOML's words: None, which TOML cannot write, is leaving the key out."""
    parts = [repr(a[1]) if isinstance(a, tuple) else f"a{'n' if a in (int, list) else ''} {toml_name(a.__name__)}"
             for a in allowed if a is not type(None)]
    text = "one of " + ", ".join(parts) if len(parts) > 1 else parts[0]
    return text + (" (or leave the key out)" if type(None) in allowed else "")


def expect(value, types_, where: str):
    if not isinstance(value, types_) or isinstance(value, bool) and types_ in ((int, float), int):
        names = types_.__name__ if isinstance(types_, type) else " or ".join(t.__name__ for t in types_)
        raise LowconvError(f"{where}: expected {toml_name(names)}, got {value!r}")
    return value


TOML_NAMES = {"dict": "table", "list": "array", "str": "string", "int": "integer", "bool": "boolean"}


def toml_name(python_names: str) -> str:
    """Python type names (e.g. "int or float") in TOML's words ("integer or float")."""
    return re.sub(r"\w+", lambda m: TOML_NAMES.get(m.group(), m.group()), python_names)


def unknown_keys(data: dict, valid: set[str], where: str) -> None:
    for key in data:
        if key not in valid:
            choices = f"valid keys: {', '.join(sorted(valid))}" if valid else "it takes none"
            raise LowconvError(f"{where}: unknown key {key!r} ({choices})")
