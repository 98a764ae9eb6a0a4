"""Generic predicates and accessors on torch.fx nodes, shared by the site-finding passes: what
op a node calls (`op_is`), its arguments by name (`call_args`), the module a call_module node
calls (`submodule`), and whether it is a float cast, an in-place change, a getitem or slice,
with the op tuples (matmuls, adds, cast methods) these and the passes match against.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from lowconv.passes.trace import Region

MATMULS = (operator.matmul, torch.matmul)
ADDS = (operator.add, torch.add)
SUBS = (operator.sub, torch.sub)
CLAMPS, CLAMP_METHODS = (torch.clamp, torch.clip), ("clamp", "clip")
CAST_METHODS = ("float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous")
INT_CASTS = ("int", "long")


def op_is(node, functions=(), methods=()) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in functions)
        or (node.op == "call_method" and node.target in methods))


def call_args(node: fx.Node, names: tuple[str, ...]) -> dict:
    """The node's arguments by parameter name; `names` names the positional ones in order."""
    return {**dict(zip(names, node.args)), **node.kwargs}


def submodule(region: Region, node: fx.Node) -> nn.Module:
    return region.module.get_submodule(node.target)


def is_cast(node: fx.Node) -> bool:
    """A cast of its first argument to a floating dtype (or `.contiguous()`)."""
    if not op_is(node, (), CAST_METHODS):
        return False
    dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return all(d.is_floating_point for d in dtypes)


def casts(node) -> list[fx.Node]:
    """The chain of integer casts (`.int()`, `.long()`) that node is, outermost first."""
    chain = []
    while op_is(node, (), INT_CASTS):
        chain.append(node)
        node = node.args[0]
    return chain


def uncast(node):
    """node less its integer casts (SpTr passes `index_0_offsets.long()` where its op took it)."""
    chain = casts(node)
    return chain[-1].args[0] if chain else node


def mutates(node: fx.Node) -> bool:
    """Whether `node` changes its first argument in place."""
    return ((node.op == "call_method" and node.target.endswith("_")
             and not node.target.startswith("_"))
            or (node.op == "call_function" and node.target is operator.setitem))


def all_ints(values) -> bool:
    return all(isinstance(v, int) for v in values)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_getitem(node: fx.Node, of: fx.Node, index: int) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and node.args[0] is of and node.args[1] == index)


def is_slice(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_shape_of(node) -> bool:
    """Whether `node` is `x.size()` or `x.shape`."""
    return (op_is(node, (), ("size",)) and len(node.args) == 1
            or op_is(node, (getattr,)) and node.args[1] == "shape")
