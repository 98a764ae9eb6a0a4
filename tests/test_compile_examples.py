"""Every example converted by every built-in recipe compiles whole (fullgraph=True) on the CPU
reference path and computes what the eager converted model computes; an FP8 conversion keeps its
GEMMs as torch.ops.lowconv.fp8_gemm in the graph. The point-cloud example's own code has
data-dependent shapes (its windows), so neither it nor its conversion compiles whole; on the CPU
the window op's reference adds one such break of its own (it lists the window's (query, key) pairs,
as many as the data says; the Triton path on CUDA takes the windows as they are), so here the
converted model is only held to compile and compute what it computes eagerly."""
import pytest
import torch
import torch._dynamo

import lowconv
from lowconv.model_file import load_model_file
from lowconv.recipe import builtin_recipes
from tests.compiled import compile_recording, lowconv_ops

EXAMPLES = ["examples/vit.py", "examples/gpt.py", "examples/text_classifier.py", "examples/point_transformer.py"]
BREAKING = {"examples/point_transformer.py"}  # the original model itself breaks the graph


def outputs(result):
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


CASES = [(example, recipe) for example in EXAMPLES for recipe in sorted(builtin_recipes())
         if example not in BREAKING or recipe in ("fp8-row", "sparse-attention-bf16")]  # the SpTr model is slow to trace


@pytest.mark.parametrize("example, recipe", CASES)
def test_converted_example_compiles_whole(example, recipe):
    dtype = "float16" if recipe == "fp16acc" else None  # fp16acc converts fp16 models only
    loaded = load_model_file(example, dtype=dtype)
    inputs = loaded.inputs if isinstance(loaded.inputs, tuple) else (loaded.inputs,)
    converted = lowconv.convert(loaded.model, recipe, inputs)
    torch._dynamo.reset()
    compiled, graphs = compile_recording(converted, fullgraph=example not in BREAKING)
    with torch.no_grad():
        eager, again = outputs(converted(*inputs)), outputs(compiled(*inputs))
    assert len(eager) == len(again)
    for e, c in zip(eager, again):  # a few roundings apart: the compiled graph orders some sums otherwise
        tolerance = 1e-4 if e.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(c, e, rtol=tolerance, atol=tolerance)
    if any(d.op == "fp8" for d in converted.lowconv_plan.decisions):
        assert "lowconv::fp8_gemm" in lowconv_ops(graphs)
