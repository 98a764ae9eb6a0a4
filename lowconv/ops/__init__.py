"""Conversion targets. Importing this package registers every op (see registry.py)."""
from lowconv.ops import keep  # noqa: F401
from lowconv.ops.registry import OPS, Op, get_op, register  # noqa: F401
