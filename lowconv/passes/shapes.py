"""Shape propagation: a traced region run on its example call, each graph node left with the
shapes and dtypes of what it computed (the tensor metadata the passes read)."""
from __future__ import annotations

import io
from contextlib import redirect_stderr
from typing import TYPE_CHECKING

import torch.utils._pytree as pytree
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from lowconv.errors import first_line
from lowconv.inputs import evaluating, fresh_inputs, is_constant

if TYPE_CHECKING:
    from lowconv.passes.trace import Region


def propagate_shapes(region: Region) -> None:
    """Leave tensor_meta on the region's graph nodes (no-op when its inputs are unknown). The run
    gets fresh clones of example_args, which keep their values."""
    if region.graph is None or region.example_args is None:
        return
    args, _ = fresh_inputs(region.example_args, {})
    try:  # ShapeProp prints the traceback of a node that fails before it raises: the caller says why
        with evaluating(region.graph), redirect_stderr(io.StringIO()):
            ShapeProp(region.graph).propagate(*args)
    except RuntimeError as err:
        cause = err.__cause__ or err
        raise RuntimeError(f"its traced graph does not run its example call: {first_line(cause)}") from err
    for node in region.graph.graph.nodes:  # ShapeProp keeps a result's other objects (a KV cache): metadata only
        if "tensor_meta" in node.meta:
            node.meta["tensor_meta"] = pytree.tree_map(metadata_only, node.meta["tensor_meta"], is_leaf=is_metadata)



def is_metadata(value) -> bool:
    return isinstance(value, TensorMetadata)



def metadata_only(value):
    return value if is_metadata(value) or is_constant(value) else None
