"""A KV cache that a causal LM's forward builds (transformers' default use_cache) is built by the
converted graph on every call (passes/built_in_graph.py): the model traces as one region, with no
per-layer copies of the cache recorded, and the converted model returns a cache like the original's."""
import pytest
import torch

import lowconv
from lowconv.passes.trace import find_regions

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


def llama(layers: int = 2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_forward_that_builds_its_cache_traces_whole():
    model = llama()
    trace = find_regions(model, example_inputs={"input_ids": torch.randint(0, 128, (2, 16))})
    assert [r.fqn for r in trace.regions] == [""] and trace.untraced == []


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "keep-all"])
def test_the_converted_model_builds_a_new_cache_each_call_as_the_original(recipe):
    model = llama()
    ids = torch.randint(0, 128, (2, 16))
    converted = lowconv.convert(model, recipe, {"input_ids": ids})
    assert converted.lowconv_plan.regions == [""]
    with torch.no_grad():
        original, first, second = model(input_ids=ids), converted(input_ids=ids), converted(input_ids=ids)
    assert type(first.past_key_values) is type(original.past_key_values)
    assert first.past_key_values is not second.past_key_values
    assert first.past_key_values.get_seq_length() == second.past_key_values.get_seq_length() == 16
    tolerance = 0 if recipe == "keep-all" else 0.3
    assert len(first.past_key_values.layers) == len(original.past_key_values.layers) == 2
    for mine, theirs in zip(first.past_key_values.layers, original.past_key_values.layers):
        assert (mine.keys - theirs.keys).abs().max() <= tolerance
        assert (mine.values - theirs.values).abs().max() <= tolerance
    torch.testing.assert_close(first.logits, second.logits, rtol=0, atol=0)


def test_the_converted_model_with_its_cache_compiles_whole():
    model = llama()
    ids = torch.randint(0, 128, (2, 16))
    converted = lowconv.convert(model, "fp8-dynamic", {"input_ids": ids})
    torch._dynamo.reset()
    compiled = torch.compile(converted, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager, out = converted(input_ids=ids), compiled(input_ids=ids)
    torch.testing.assert_close(out.logits, eager.logits)
    assert out.past_key_values.get_seq_length() == 16


def test_the_classes_are_the_models_own_again_after_tracing():
    model = llama()
    find_regions(model, example_inputs={"input_ids": torch.randint(0, 128, (2, 16))})
    from transformers.models.llama import modeling_llama
    assert modeling_llama.DynamicCache is transformers.DynamicCache
