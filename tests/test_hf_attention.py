"""Attention of transformers models converted through transformers' attention interface
(passes/hf_attention.py): the model keeps its class and config, generate() runs with its KV cache,
and each call (prefill, decoding step, padding, lengths never traced) computes what the original does."""
import types

import pytest
import torch

import lowconv
from lowconv.errors import LowconvError
from lowconv.passes import hf_attention

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")

# The op in float32 (dtype "auto": the dtype q arrives in): the converted model computes what the original does.
EXACT = """
name = "exact-attention"
[[rules]]
kind = "attention"
op = "sparse_attention"
"""


def build(family: str, attention: str):
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attn_implementation=attention)
        return transformers.LlamaForCausalLM(config).eval()
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         attn_implementation=attention)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, attn_implementation=attention)
    return transformers.BertModel(config).eval()


def padded(batch: int, length: int, pad: int):
    ids = torch.randint(1, 128, (batch, length))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # left padding, as generate() takes a batch
    return ids, mask


@pytest.fixture
def exact(tmp_path):
    path = tmp_path / "exact.toml"
    path.write_text(EXACT)
    return path


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_converted_attention_keeps_the_class_and_answers_every_call(family, attention, exact):
    model = build(family, attention)
    ids, mask = padded(2, 12, 3)
    converted = lowconv.convert(model, exact, {"input_ids": ids, "attention_mask": mask})
    attention_sites = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert len(attention_sites) == 2 and all(d.converted for d in attention_sites)
    assert all(d.note.startswith("called through transformers' attention interface") for d in attention_sites)
    implementation = {"sdpa": "lowconv", "eager": "lowconv_eager"}[attention]
    assert type(converted) is type(model) and converted.config._attn_implementation == implementation
    assert model.config._attn_implementation == attention  # the user's model is left as it was
    assert not any(isinstance(m, torch.fx.GraphModule) for m in converted.modules())
    calls = []
    converted.get_submodule(attention_sites[0].fqn).register_forward_hook(lambda *_: calls.append(1))
    ids, mask = padded(3, 7, 2)  # another batch and length, other padding
    with torch.no_grad():
        want, got = model(input_ids=ids, attention_mask=mask), converted(input_ids=ids, attention_mask=mask)
    assert calls == [1]
    key = "last_hidden_state" if family == "bert" else "logits"
    # eager's additive masks give a query row with every key masked (left padding) the mean of v, as
    # eager does: padded positions agree too (a causal LM's loss reads the last one)
    rows = torch.ones_like(mask, dtype=torch.bool) if attention == "eager" else mask.bool()
    torch.testing.assert_close(got[key][rows], want[key][rows], rtol=1e-4, atol=1e-5)
    if family != "bert":  # a prefill over the padded prompt, then decoding steps over the cache
        greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(converted.generate(ids, **greedy), model.generate(ids, **greedy))
        assert len(calls) > 6


def test_a_saved_conversion_loads_with_its_attention_routed_again(exact, tmp_path):
    model = build("llama", "sdpa")
    ids, _ = padded(2, 12, 0)
    converted = lowconv.convert(model, exact, (ids,))
    lowconv.save(converted, tmp_path / "out")
    loaded = lowconv.load(model, tmp_path / "out", (ids,))
    assert type(loaded) is type(model) and loaded.config._attn_implementation == "lowconv"
    prompt = ids[:, :5]  # no padding: the prefill is causal without a mask, each step one query without one
    greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(prompt, **greedy), model.generate(prompt, **greedy))
    report = lowconv.compare(model, loaded, (ids,))
    attention = [row for row in report.sites if row.op == "sparse_attention"]
    assert len(attention) == 2 and all(row.alone.sqnr_db > 100 for row in attention)


def test_a_kept_attention_runs_transformers_sdpa_beside_a_converted_one(exact, tmp_path):
    model = build("llama", "eager")
    recipe = tmp_path / "first.toml"
    recipe.write_text(EXACT + 'modules = ["model.layers.0.self_attn.attention"]\n')
    ids, mask = padded(2, 10, 4)
    converted = lowconv.convert(model, recipe, {"input_ids": ids, "attention_mask": mask})
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["model.layers.0.self_attn.attention"]
    assert not hasattr(converted.model.layers[1].self_attn, hf_attention.OP_NAME)
    with torch.no_grad():
        want, got = model(input_ids=ids, attention_mask=mask), converted(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits[mask.bool()], want.logits[mask.bool()], rtol=1e-4, atol=1e-5)


def test_an_eager_model_asked_for_attention_weights_gets_the_originals(exact):
    model = build("llama", "eager")
    ids, mask = padded(2, 9, 3)
    converted = lowconv.convert(model, exact, (ids,))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = converted(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for mine, theirs in zip(got.attentions, want.attentions):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)


def test_the_converted_model_compiles_whole(exact):
    model = build("llama", "sdpa")
    ids, _ = padded(2, 12, 0)
    converted = lowconv.convert(model, exact, (ids,))
    compiled = torch.compile(converted, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, converted(ids).logits)


def test_a_compiled_prefill_without_padding_runs_causal_attention_with_no_mask(exact, monkeypatch):
    """transformers' sdpa_mask makes the full causal mask under torch.compile (torch < 2.14), which
    SDPA computes tile by tile; the converted model's mask function skips it as transformers does
    eagerly, and still makes the mask where a padding mask comes."""
    from lowconv.ops.functional_attention import SparseAttention
    model = build("llama", "sdpa")
    ids, mask = padded(2, 12, 3)
    converted = lowconv.convert(model, exact, (ids,))
    calls, attend = [], SparseAttention.forward

    def spy(self, q, k, v, mask=None, **kwargs):  # (no mask, causal) of each layer's call
        calls.append((mask is None, kwargs["is_causal"]))
        return attend(self, q, k, v, mask, **kwargs)
    monkeypatch.setattr(SparseAttention, "forward", spy)
    # torch before 2.14, where dynamo folds torch.compiler.is_exporting() to True while compiling
    monkeypatch.setattr(transformers.masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling)
    torch._dynamo.reset()  # code compiled by an earlier test would not call the spy
    compiled = torch.compile(converted, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
        assert calls == [(True, True)] * 2
        calls.clear()
        got = compiled(input_ids=ids, attention_mask=mask).logits
        assert calls == [(False, False)] * 2
        torch.testing.assert_close(got[mask.bool()], model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   rtol=1e-4, atol=1e-5)


def test_the_mask_is_made_where_transformers_asks_for_more_than_causality():
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    plain = dict(batch_size=1, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, allow_is_causal_skip=True)
    assert hf_attention.plain_causal(plain, causal_mask_function)
    assert hf_attention.plain_causal({**plain, "q_length": None, "cache_position": torch.arange(4)},
                                     causal_mask_function)
    others = [{"kv_length": 6}, {"q_offset": torch.tensor(0)}, {"q_offset": 2}, {"attention_mask": torch.ones(1, 4)},
              {"allow_is_causal_skip": False}, {"local_size": 2}, {"mask_function": lambda *a: True}]
    for other in others:
        assert not hf_attention.plain_causal({**plain, **other}, causal_mask_function), other
    # eagerly (and while exporting) it is transformers' own function
    torch.testing.assert_close(hf_attention.sdpa_mask_or_causal(**{**plain, "kv_length": 6}),
                               sdpa_mask(**{**plain, "kv_length": 6}))


def test_a_local_window_refuses_a_decoding_step_with_the_reason(tmp_path):
    model = build("llama", "sdpa")
    recipe = tmp_path / "local.toml"
    recipe.write_text(EXACT + 'options = { layout = "local", window = 4 }\n')
    ids, _ = padded(2, 12, 0)
    converted = lowconv.convert(model, recipe, (ids,))
    converted(ids)  # a prefill: as many queries as keys
    with pytest.raises(ValueError, match='layout "local" aligns its window at the first key'):
        converted.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_arguments_the_op_does_not_take_are_refused_by_name():
    module = types.SimpleNamespace(lowconv_attention="attention", attention=lambda *a, **k: None, is_causal=True,
                                   config=types.SimpleNamespace(_attn_implementation="lowconv"))
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(LowconvError, match="does not take position_bias"):
        hf_attention.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(LowconvError, match="does not take softcap"):
        hf_attention.attention_forward(module, q, q, q, None, softcap=30.0)


def test_an_encoder_decoder_whose_cache_does_not_trace_converts_what_does(exact):
    """BART with use_cache left on: the decoder's cross-attention writes into its EncoderDecoderCache
    (`is_updated[i] = True`), which a traced graph cannot, so those regions are left for their
    children as any module that does not trace; the self-attention of the encoder and of the
    decoder (which asks whether the cache passed in is an EncoderDecoderCache: the example's type
    decides, guarded) converts, and generate() answers as the original."""
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=0)
    model = transformers.BartForConditionalGeneration(config).eval()
    ids, mask = padded(2, 12, 0)
    converted = lowconv.convert(model, exact, {"input_ids": ids, "attention_mask": mask,
                                               "decoder_input_ids": ids[:, :6]})
    assert [d.fqn for d in converted.lowconv_plan.converted()] == [
        "model.encoder.layers.0.self_attn.attention", "model.encoder.layers.1.self_attn.attention",
        "model.decoder.layers.0.self_attn.attention", "model.decoder.layers.1.self_attn.attention"]
    assert any(u["fqn"] == "model.decoder.layers.0.encoder_attn" for u in converted.lowconv_plan.untraced)
    greedy = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(converted.generate(ids, **greedy), model.generate(ids, **greedy))


def test_a_converted_model_that_does_not_run_its_example_inputs_fails_convert_with_where():
    """T5's feed-forward casts its input to `self.wo.weight.dtype` behind an isinstance check that a
    traced value fails, so tracing never sees the read; the fp8 weight would make the first call
    fail. convert runs the converted model once and says where, instead."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(3, 128, (2, 8))
    with pytest.raises(LowconvError, match=r"the converted model does not run on the example inputs: .* at "
                                           r"transformers/models/t5/modeling_t5.py:\d+; .*ignore = \[\.\.\.\]"):
        lowconv.convert(model, "fp8-row", {"input_ids": ids, "decoder_input_ids": ids[:, :4], "use_cache": False})


def test_an_eager_attention_model_traces_whole():
    """transformers' eager mask asks torch.finfo of the hidden states' dtype, a traced value: the
    example's dtype decides (guarded), and the model is one region, as with sdpa."""
    model = build("llama", "eager")
    ids = torch.randint(1, 128, (2, 12))
    converted = lowconv.convert(model, "keep-all", {"input_ids": ids})
    assert converted.lowconv_plan.regions == [""] and converted.lowconv_plan.untraced == []
    with torch.no_grad():
        assert torch.equal(converted(input_ids=ids).logits, model(input_ids=ids).logits)
