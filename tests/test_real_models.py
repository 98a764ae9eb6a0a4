"""Real model libraries on the CPU: Hugging Face Llama, GPT-2 and BERT built from the small configs
in examples/hf/ (random weights), and torch.nn's TransformerEncoder and MultiheadAttention, through
the model sources, the tracer's example-value branches, the passes and the three recipes.
(timm and torchvision: tests/test_real_models_gpu.py.)"""
import re
import sys
import types

import pytest
import torch
from torch import nn

import lowconv
from lowconv.cli import main
from lowconv.errors import LowconvError
from lowconv.model_sources import load_model
from lowconv.inputs import NO_FAST_PATH, evaluating
from lowconv.passes import trace

HF_MODELS = ["hf:examples/hf/llama-tiny", "hf:examples/hf/gpt2-tiny", "hf:examples/hf/bert-tiny"]
RECIPES = ["fp8-dynamic", "semi-sparse", "sparse-attention-bf16"]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


def linear_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def found_linears(plan) -> set[str]:
    return {d.site.info.weight.removesuffix(".weight") for d in plan.decisions if d.site.kind == "linear"}


@pytest.mark.parametrize("spec", HF_MODELS)
def test_hf_models_every_site_found_and_each_recipe_passes_its_gate(transformers, spec):
    loaded = load_model(spec)
    layers = loaded.model.config.num_hidden_layers
    for recipe in RECIPES:
        converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
        plan = converted.lowconv_plan
        assert found_linears(plan) == linear_names(loaded.model)
        attention = [d for d in plan.decisions if d.site.kind == "attention"]
        assert len(attention) == layers and all(d.site.unsupported is None for d in attention)
        report = lowconv.compare(loaded.model, converted, loaded.inputs)
        assert report.passed, lowconv.report.report_to_table(report)
        if recipe == "sparse-attention-bf16":
            assert len(plan.converted()) == layers and report.outputs[0].metrics.sqnr_db > 40
        elif recipe == "fp8-dynamic":  # every linear but an LM head (the recipe keeps it; GPT-2's is tied too)
            kept = {d.fqn: d.reason for d in plan.decisions if d.site.kind == "linear" and not d.converted}
            head = "unsupported: weight is tied" if "gpt2" in spec else "rule 1 says keep"
            assert list(kept) == (["lm_head"] if hasattr(loaded.model, "lm_head") else []), kept
            assert all(reason.startswith(head) for reason in kept.values()), kept
        else:  # semi-sparse: the MLP linears, each of them
            linears = [d for d in plan.decisions if d.site.kind == "linear"]
            mlp = {d.fqn for d in linears if re.search(r"mlp\.|intermediate\.dense|layer\.\d+\.output\.dense", d.fqn)}
            assert {d.fqn for d in plan.converted()} == mlp and len(mlp) == 2 * layers * (1.5 if "llama" in spec else 1)


def test_llama_padding_mask_gqa_and_rotary_trace_whole(transformers):
    """The whole LlamaForCausalLM is one region: HF's mask builders, rotary embedding and SDPA
    attention function are traced with their shape branches decided. Its attention converts
    through transformers' attention interface: the model stays a LlamaForCausalLM and answers
    lengths and branches never traced (one query)."""
    loaded = load_model("hf:examples/hf/llama-tiny")
    converted = lowconv.convert(loaded.model, "sparse-attention-bf16", loaded.inputs)
    plan = converted.lowconv_plan
    assert plan.regions == [""] and plan.untraced == []
    assert plan.constant_args[""] == {"use_cache": False, "logits_to_keep": 0}
    assert any("sdpa_attention.py" in d for d in plan.decided[""])
    info = plan.converted()[0].site.info
    assert (info.form, info.mask, info.causal) == ("sdpa", "keep", True)  # causal=True, and the padding
    assert (info.heads, info.kv_heads) == (4, 2)  # repeat_kv is taken back: the op gets the 2 kv heads
    assert type(converted) is type(loaded.model) and converted.config._attn_implementation == "lowconv"
    assert not any(isinstance(m, torch.fx.GraphModule) for m in converted.modules())
    assert loaded.model.config._attn_implementation == "sdpa"
    inputs = {"input_ids": torch.randint(0, 128, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long),
              "use_cache": False}
    one_query = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": inputs["attention_mask"][:, :1]}
    for call in (inputs, one_query):
        with torch.no_grad():
            out, ref = converted(**call), loaded.model(**call)
        assert type(out) is type(ref)
        assert (out.logits - ref.logits).norm() / ref.logits.norm() < 1e-2


@pytest.mark.parametrize("spec, mask", [("hf:examples/hf/llama-tiny", "additive"),
                                        ("hf:examples/hf/bert-tiny", "additive")])
def test_eager_attention_is_found_with_its_additive_mask_and_gqa(transformers, spec, mask):
    loaded = load_model(spec)
    model = loaded.model.__class__._from_config(loaded.model.config, attn_implementation="eager").eval()
    converted = lowconv.convert(model, "sparse-attention-bf16", loaded.inputs)
    infos = [d.site.info for d in converted.lowconv_plan.converted()]
    assert len(infos) == 2 and {i.form for i in infos} == {"handwritten"} and {i.mask for i in infos} == {mask}
    if "llama" in spec:  # repeat_kv is taken back: the op gets the 2 kv heads
        assert {(i.heads, i.kv_heads) for i in infos} == {(4, 2)}
    assert lowconv.compare(model, converted, loaded.inputs).outputs[0].metrics.sqnr_db > 40


def test_hf_directory_with_weights_loads_them_and_a_saved_conversion_reloads(transformers, tmp_path):
    made = load_model("hf:examples/hf/gpt2-tiny", seed=3).model
    made.save_pretrained(tmp_path / "gpt2")  # config.json + model.safetensors
    loaded = load_model(f"hf:{tmp_path / 'gpt2'}", seed=0)
    for name, p in made.state_dict().items():
        assert torch.equal(p, loaded.model.state_dict()[name]), name
    converted = lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs)
    lowconv.save(converted, tmp_path / "out")
    again = lowconv.load(loaded.model, tmp_path / "out", example_inputs=loaded.inputs)
    with torch.no_grad():
        assert torch.equal(again(**loaded.inputs).logits, converted(**loaded.inputs).logits)
    without = lowconv.load(loaded.model, tmp_path / "out")  # traced again with stand-ins of the inputs' shapes
    with torch.no_grad():
        assert torch.equal(without(**loaded.inputs).logits, converted(**loaded.inputs).logits)


def test_hf_directory_with_weights_that_do_not_fit_is_refused(transformers, tmp_path):
    from safetensors.torch import save_file
    made = load_model("hf:examples/hf/gpt2-tiny", seed=3).model
    for name, weights in [("foreign", {"foo.bar": torch.randn(3, 3)}), ("resized", None), ("corrupt", None)]:
        made.save_pretrained(tmp_path / name)
        if weights is not None:
            save_file(weights, tmp_path / name / "model.safetensors")
        elif name == "resized":
            state = {k: v.contiguous() for k, v in made.state_dict().items() if k != "lm_head.weight"}
            state["transformer.wte.weight"] = torch.randn(3, 3)
            save_file(state, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        else:
            (tmp_path / name / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(LowconvError, match="none of the weights in .*foreign fit the model .*it holds foo.bar"):
        load_model(f"hf:{tmp_path / 'foreign'}")
    for name in ("resized", "corrupt"):
        with pytest.raises(LowconvError, match=f"hf:{tmp_path / name}'.*transformers cannot build it"):
            load_model(f"hf:{tmp_path / name}")


def test_cli_inspects_converts_and_compares_an_hf_directory(transformers, tmp_path, capsys):
    assert main(["inspect", "hf:examples/hf/bert-tiny", "semi-sparse"]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.intermediate.dense" in out and "semi_sparse" in out
    assert "encoder.layer.0.attention.self.attention" in out
    assert main(["convert", "hf:examples/hf/llama-tiny", "sparse-attention-bf16", "-o", str(tmp_path)]) == 0
    assert main(["compare", "hf:examples/hf/llama-tiny", str(tmp_path)]) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_transformer_encoder_with_padding_mask(recipe):
    loaded = load_model("nn:transformer-encoder")
    converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
    plan = converted.lowconv_plan
    assert sum(d.site.kind == "attention" for d in plan.decisions) == 2
    out_proj = [d for d in plan.decisions if d.fqn.endswith("out_proj")]
    assert len(out_proj) == 2
    if recipe != "fp8-dynamic":  # no rule for the projections: the MHA modules stay, their projections kept
        assert found_linears(plan) == linear_names(loaded.model) and not plan.expanded_mha
        assert all("inside nn.MultiheadAttention" in d.reason for d in out_proj)
    else:  # expanded: in_proj and out_proj are linear sites like the MLP's
        assert plan.expanded_mha == ["layers.0.self_attn", "layers.1.self_attn"]
        assert found_linears(plan) == linear_names(loaded.model) | {f"layers.{i}.self_attn.in_proj" for i in (0, 1)}
        assert all(d.op == "fp8" for d in out_proj)
    report = lowconv.compare(loaded.model, converted, loaded.inputs)
    assert report.passed and len(plan.converted()) == {"fp8-dynamic": 8, "semi-sparse": 4}.get(recipe, 2)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("recipe", ["fp8-dynamic", "semi-sparse"])
def test_transformer_encoder_runs_where_torch_takes_its_fast_path(nested, recipe, tmp_path):
    """In eval mode without grad, torch runs an encoder layer as one fused kernel that reads
    linear1/linear2's weights itself (and, with enable_nested_tensor, hands the layers nested
    tensors): the converted encoder must run its traced plain path instead, before and after a reload.
    Rows of padding are left out: the nested path gives zeros there, the plain path values."""
    model = encoder(nested)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 12:] = True
    inputs = {"src": torch.randn(2, 16, 64), "src_key_padding_mask": padding}
    converted = lowconv.convert(model, recipe, inputs)
    # fp8: linear1, linear2 and the attention's in_proj and out_proj; 2:4: the MLP's
    assert len(converted.lowconv_plan.converted()) == (8 if recipe == "fp8-dynamic" else 4)
    assert torch.backends.mha.get_fastpath_enabled()
    lowconv.save(converted, tmp_path)
    for run in (converted, lowconv.load(model, tmp_path, inputs)):
        fast_path_check(model, run, inputs, recipe, rows=~padding)


def encoder(nested=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


def fast_path_check(model, converted, inputs, recipe, rows=slice(None)):
    """The converted model under no_grad (where torch takes its fused paths) against the original
    (the reverted 2:4 weights for semi-sparse) on `rows`."""
    with torch.no_grad():
        expected = lowconv.revert(converted)(**inputs) if recipe == "semi-sparse" else model(**inputs)
        out = converted(**inputs)
    tolerance = 0.15 if recipe == "fp8-dynamic" else 1e-4
    assert (out - expected)[rows].abs().max() < tolerance


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "semi-sparse"])
def test_transformer_encoder_with_an_attention_mask(recipe):
    """The encoder decides its causality from the mask's values (not traceable: the layers are
    regions); each layer asks F._none_or_dtype for the mask's dtype, which rejects a Proxy."""
    model = encoder()
    inputs = {"src": torch.randn(2, 10, 64), "mask": nn.Transformer.generate_square_subsequent_mask(10)}
    converted = lowconv.convert(model, recipe, inputs)
    assert {u["fqn"] for u in converted.lowconv_plan.untraced} == {""}
    assert type(converted.layers[0]) is not nn.TransformerEncoderLayer  # its traced graph
    fast_path_check(model, converted, inputs, recipe)


def test_an_encoder_layer_that_does_not_trace_leaves_its_fast_path(monkeypatch):
    """Where a layer keeps its class around converted linears, its fused kernel (which would read
    their weights) is off, as is the encoder's nested-tensor path."""
    real = trace.trace_module

    def no_layers(module, *args, **kwargs):
        if isinstance(module, (nn.TransformerEncoder, nn.TransformerEncoderLayer)):
            raise RuntimeError("does not trace")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(trace, "trace_module", no_layers)
    model, inputs = encoder(nested=True), load_model("nn:transformer-encoder").inputs
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    # linear1, linear2 and out_proj: the attention, traced as a region of its own, sees q, k and v as
    # three inputs, so it projects them with slices of in_proj's weight (no linear site)
    assert type(converted.layers[0]) is nn.TransformerEncoderLayer and len(converted.lowconv_plan.converted()) == 6
    assert converted.layers[0].activation_relu_or_gelu == 0 and not converted.use_nested_tensor
    fast_path_check(model, converted, inputs, "fp8-dynamic", rows=~inputs["src_key_padding_mask"])


def test_the_plan_says_what_a_nested_encoder_loses():
    model, inputs = encoder(nested=True), load_model("nn:transformer-encoder").inputs
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    [warning] = [w for w in converted.lowconv_plan.warnings if "enable_nested_tensor" in w]
    assert warning.startswith("(whole model): ") and "rows of padding" in warning
    kept = lowconv.convert(model, "keep-all", inputs)
    assert not any("enable_nested_tensor" in w for w in kept.lowconv_plan.warnings)


def test_an_encoder_with_nothing_converted_keeps_its_fast_paths():
    model, inputs = encoder(nested=True), load_model("nn:transformer-encoder").inputs
    converted = lowconv.convert(model, "keep-all", inputs)
    assert converted.use_nested_tensor and converted.layers[0].activation_relu_or_gelu
    with torch.no_grad():
        assert torch.equal(converted(**inputs), model(**inputs))  # zeros at padding, as the nested path gives


def test_a_converted_encoder_warns_of_its_decided_branches_only():
    """Its graph replaces it, so the plan says which branches the example decided; the eval-only
    src.is_nested check is no reason to say it reads self.training."""
    loaded = load_model("nn:transformer-encoder")
    warnings = lowconv.convert(loaded.model, "fp8-dynamic", loaded.inputs).lowconv_plan.warnings
    assert len(warnings) == 1 and "branches decided by the example" in warnings[0]


@pytest.mark.parametrize("plain_path", [True, False])
def test_evaluating_takes_the_plain_path_unless_timing(plain_path):
    """Example runs take the path tracing records; compare's timing runs leave the user's setting."""
    before = torch.backends.mha.get_fastpath_enabled()
    with evaluating(nn.Linear(2, 2), plain_path=plain_path):
        assert torch.backends.mha.get_fastpath_enabled() == (before and not plain_path)
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_example_runs_switch_the_fast_path_off_until_the_last_one_leaves():
    """Two conversions in two threads: A enters, B enters, A leaves, B leaves; the fast path on
    before them is on again after."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)
    try:
        a, b = NO_FAST_PATH.held(), NO_FAST_PATH.held()
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)
        assert not torch.backends.mha.get_fastpath_enabled()
        b.__exit__(None, None, None)
        assert torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def test_multihead_attention_source_converts():
    loaded = load_model("nn:multihead-attention")
    converted = lowconv.convert(loaded.model, "sparse-attention-bf16", loaded.inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == [""]
    assert lowconv.compare(loaded.model, converted, loaded.inputs).outputs[0].metrics.sqnr_db > 40


@pytest.mark.parametrize("spec, message", [
    ("hf:/nonexistent/model", "/nonexistent/model/config.json does not exist"),
    ("nn:transformer-encodr", "close matches: transformer-encoder"),
    ("tim:vit_base_patch16_224", "unknown source 'tim' (one of: a model file path, hf:DIR, timm:NAME"),
    ("examples/missing.py", "model file examples/missing.py does not exist"),
])
def test_model_source_mistakes_are_exit_2_and_say_what_is_wrong(spec, message, capsys):
    assert main(["inspect", spec]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec, package", [("timm:vit_base_patch16_224", "pip install timm"),
                                           ("torchvision:vit_b_16", "pip install the torchvision release"),
                                           ("hf:examples/hf/bert-tiny", "pip install transformers")])
def test_a_missing_library_names_its_pip_package(spec, package, monkeypatch):
    monkeypatch.setitem(sys.modules, spec.partition(":")[0].replace("hf", "transformers"), None)
    with pytest.raises(LowconvError, match=package):
        load_model(spec)


def test_an_image_config_without_image_size_says_to_write_a_model_file(transformers, tmp_path):
    from lowconv.model_sources import hf_inputs

    config = types.SimpleNamespace(image_size=None)
    model = types.SimpleNamespace(main_input_name="pixel_values", forward=lambda pixel_values: None)
    with pytest.raises(LowconvError, match="config.json has no image_size.*model file"):
        hf_inputs(model, config, "hf:somewhere")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_models_as_users_call_them_convert_and_answer(transformers, family, attention):
    """model(ids) with transformers' defaults (use_cache=True: a DynamicCache made inside forward,
    which each layer appends to): tracing records each layer's arguments as they were at its call
    and runs on copies, so the converted model answers these and other lengths, with a cache of its own."""
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attn_implementation=attention)
        model = transformers.LlamaForCausalLM(config).eval()
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         attn_implementation=attention)
        model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    for recipe, min_db in (("sparse-attention-bf16", 40), ("fp8-row", 20)):
        converted = lowconv.convert(model, recipe, (ids,))
        assert sum(d.converted for d in converted.lowconv_plan.decisions if d.site.kind == "attention") == (
            2 if recipe == "sparse-attention-bf16" else 0)
        for length in (16, 24):
            x = torch.randint(0, 128, (2, length))
            with torch.no_grad():
                want, got = model(x), converted(x)
            assert 20 * torch.log10(want.logits.norm() / (want.logits - got.logits).norm()) > min_db
            assert got.past_key_values.get_seq_length() == length


def test_a_decode_step_over_a_static_cache_converts_its_attention(transformers):
    """A decode step (one new token per sequence over a StaticCache), converted on such a step: the
    attention's is_causal (transformers passes `q_length > 1`, decided by the trace) is the
    constant its guard holds, so the attention converts, no copy of the cache outlives the
    conversion, and the next step answers as the original."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=24)
    with torch.no_grad():
        model(torch.randint(0, 128, (3, 16)), past_key_values=cache, cache_position=torch.arange(16))

    def step(m, position):
        for layer in cache.layers:  # the cache counts the tokens it took: rewind to `position`
            layer.cumulative_length.fill_(position)
        return m(input_ids=ids, past_key_values=cache, cache_position=torch.tensor([position])).logits

    ids = torch.randint(0, 128, (3, 1))
    step(model, 16)  # the cache's slot 16 written: the state convert sees
    converted = lowconv.convert(model, "sparse-attention-bf16",
                                {"input_ids": ids, "past_key_values": cache, "cache_position": torch.tensor([16])})
    attention = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert [d.converted for d in attention] == [True, True], [d.reason for d in attention]
    # the conversion ran on copies of the cache (4.3 GB at the bench's decode); none stays in a graph
    metas = [n.meta.get("tensor_meta") for m in converted.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes]
    assert not [leaf for leaf in torch.utils._pytree.tree_leaves(metas) if isinstance(leaf, transformers.StaticCache)]
    with torch.no_grad():
        want, got = step(model, 17), step(converted, 17)
    assert 20 * torch.log10(want.norm() / (want - got).norm()) > 40
