"""Conversion targets. Importing this package registers every op (see registry.py)."""
from lowconv.ops import dense, fp8, fp8_semi_sparse, fp16acc, keep, semi_sparse, sparse_attention  # noqa: F401
from lowconv.ops.registry import OPS, Op, register_op  # noqa: F401
