"""The Hugging Face folder lowconv.save writes for a transformers model (lowconv/hf.py): loaded by
transformers with compressed-tensors where the conversion has that form, refused by name elsewhere."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open

import lowconv
from lowconv.cli import main
from lowconv.errors import LowconvError
from lowconv.hf import fp8_scheme, quantization_config
from lowconv.model_sources import load_model

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")
# compressed-tensors is pinned with transformers in the test extras: a missing one fails here, not skips
import compressed_tensors  # noqa: E402,F401


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    want, got = want.double(), got.double()
    return (20 * torch.log10(want.norm() / (want - got).norm())).item()


@pytest.fixture
def llama_dir(tmp_path):
    """examples/hf/llama-tiny with tokenizer and generation files beside its config, and no weights
    (random ones, drawn under the seed)."""
    source = tmp_path / "llama"
    shutil.copytree("examples/hf/llama-tiny", source)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (source / "tokenizer.model").write_bytes(b"\x00\x01binary")
    (source / "generation_config.json").write_text('{"do_sample": false}')
    return source


@pytest.mark.parametrize("recipe", ["fp8-row", "fp8-dynamic", "fp8-static"])
def test_transformers_loads_an_fp8_folder_as_the_converted_model(llama_dir, tmp_path, recipe):
    loaded = load_model(f"hf:{llama_dir}")
    converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
    out = tmp_path / "out"
    lowconv.save(converted, out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    for name in ("tokenizer_config.json", "tokenizer.model", "generation_config.json"):
        assert (out / name).read_bytes() == (llama_dir / name).read_bytes()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    served = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        want, got = converted(**loaded.inputs).logits, served(**loaded.inputs).logits
    assert sqnr_db(want, got) >= 60
    assert sqnr_db(loaded.model(**loaded.inputs).logits, got) < 40  # it is the FP8 model, not the original


def test_the_schemes_written_for_each_fp8_option():
    assert fp8_scheme({"scaling": "dynamic", "granularity": "row"}) == {
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}}
    token = fp8_scheme({"scaling": "dynamic", "granularity": "token"})  # vLLM's dynamic FP8, one weight scale
    assert (token["weights"]["strategy"], token["input_activations"]["strategy"]) == ("tensor", "token")
    block = fp8_scheme({"scaling": "dynamic", "granularity": "block"})  # FP8_BLOCK
    assert block["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                                "dynamic": False, "block_structure": [128, 128]}
    assert block["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                          "dynamic": True, "group_size": 128}
    static = fp8_scheme({"scaling": "static", "granularity": "tensor"})
    assert static["input_activations"]["strategy"] == "tensor" and not static["input_activations"]["dynamic"]
    assert fp8_scheme({"scaling": "delayed", "granularity": "tensor"}) is None
    assert fp8_scheme({"scaling": "dynamic", "granularity": "row", "training": True}) is None


@pytest.mark.parametrize("recipe", ["semi-sparse", "sparse-attention-bf16"])
def test_a_folder_without_a_compressed_tensors_form_is_refused_by_transformers(llama_dir, tmp_path, recipe):
    loaded = load_model(f"hf:{llama_dir}")
    converted = lowconv.convert(loaded.model, recipe, loaded.inputs)
    lowconv.save(converted, tmp_path / "out")
    quantization = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "quant_method" not in quantization and "only lowconv.load reads" in quantization["lowconv_only"]
    with pytest.raises(ValueError, match="quant_method"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    again = lowconv.load(loaded.model, tmp_path / "out", loaded.inputs)  # lowconv reads it
    with torch.no_grad():
        assert torch.equal(again(**loaded.inputs).logits, converted(**loaded.inputs).logits)


def test_nothing_converted_writes_a_plain_config(llama_dir, tmp_path):
    loaded = load_model(f"hf:{llama_dir}")
    lowconv.save(lowconv.convert(loaded.model, "keep-all", loaded.inputs), tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert quantization_config(lowconv.convert(loaded.model, "keep-all", loaded.inputs).lowconv_plan) is None


def test_save_pretrained_of_a_converted_model_points_to_lowconv_save(llama_dir, tmp_path):
    loaded = load_model(f"hf:{llama_dir}")
    converted = lowconv.convert(loaded.model, "fp8-row", loaded.inputs)
    with pytest.raises(LowconvError, match="use lowconv.save"):
        converted.save_pretrained(tmp_path / "trap")
    assert not (tmp_path / "trap").exists()
    lowconv.save(converted, tmp_path / "out")
    with pytest.raises(LowconvError, match="use lowconv.save"):
        lowconv.load(loaded.model, tmp_path / "out", loaded.inputs).save_pretrained(tmp_path / "trap")


def test_models_not_from_transformers_get_no_config(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    lowconv.save(lowconv.convert(model, "fp8-row", (torch.randn(4, 32),)), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_the_cli_writes_the_folder_for_an_hf_source(llama_dir, tmp_path):
    assert main(["convert", f"hf:{llama_dir}", "fp8-row", "-o", str(tmp_path / "out")]) == 0
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "tokenizer.model", "model.safetensors", "plan.json", "report.md"} <= names
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_gpt2_conv1d_sites_are_not_described_as_compressed_tensors(tmp_path):
    """lowconv stores a Conv1D's FP8 weight (out, in) under its (in, out) name: a loader would fail
    on the shapes, or silently transpose a square one, so the folder says lowconv only."""
    loaded = load_model("hf:examples/hf/gpt2-tiny")
    lowconv.save(lowconv.convert(loaded.model, "fp8-row", loaded.inputs), tmp_path)
    reason = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["lowconv_only"]
    assert "Conv1D stored (out, in)" in reason


def test_a_quantized_model_is_refused_with_what_it_is(llama_dir, tmp_path):
    loaded = load_model(f"hf:{llama_dir}")
    lowconv.save(lowconv.convert(loaded.model, "fp8-row", loaded.inputs), tmp_path)
    served = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # llm-compressor's kind of checkpoint
    with pytest.raises(LowconvError, match=r"quantized already: .*quant_method compressed-tensors.*convert the model "
                                           r"it was made from"):
        lowconv.convert(served, "fp8-row", loaded.inputs)
    fp8 = torch.nn.Sequential(torch.nn.Linear(32, 32))
    fp8[0].weight.data = fp8[0].weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(LowconvError, match="0.weight is torch.float8_e4m3fn"):
        lowconv.convert(fp8, "fp8-row", (torch.randn(2, 32),))


def test_a_sharded_folder_loads_in_transformers_and_lowconv(llama_dir, tmp_path):
    loaded = load_model(f"hf:{llama_dir}")
    converted = lowconv.convert(loaded.model, "fp8-row", loaded.inputs)
    lowconv.save(converted, tmp_path, max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1 and not (tmp_path / "model.safetensors").exists()
    served = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    again = lowconv.load(loaded.model, tmp_path, loaded.inputs)
    with torch.no_grad():
        want = converted(**loaded.inputs).logits
        assert torch.equal(again(**loaded.inputs).logits, want)
        assert sqnr_db(want, served(**loaded.inputs).logits) >= 60


def test_config_json_says_the_dtype_the_weights_are_in(llama_dir, tmp_path):
    loaded = load_model(f"hf:{llama_dir}")
    model = loaded.model.to(torch.bfloat16)  # cast after it was built: its config still says float32
    converted = lowconv.convert(model, "fp8-row", loaded.inputs)
    lowconv.save(converted, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).model.norm.weight.dtype == torch.bfloat16


def word_tokenizer(directory, vocab_size: int):
    """A word-level tokenizer of `vocab_size` words (w0, w1, ...) saved in `directory`, as
    transformers loads it (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)


def test_static_scales_calibrate_on_a_text_file(tmp_path, capsys):
    """convert hf:DIR fp8-static --calibration-text FILE: the text, tokenized by DIR's tokenizer into
    rows (64 tokens: the model's context), calibrates the scales (not those the example's random
    tokens give), and the report says so; mistakes are named."""
    source = tmp_path / "llama"
    shutil.copytree("examples/hf/llama-tiny", source)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    word_tokenizer(source, vocab)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i % 7}" for i in range(3000)))  # 7 words only: scales unlike random tokens'
    args = ["convert", f"hf:{source}", "fp8-static", "-o"]
    assert main([*args, str(tmp_path / "text"), "--calibration-text", str(text), "--calibration", "2"]) == 0
    assert main([*args, str(tmp_path / "example")]) == 0
    plan = json.loads((tmp_path / "text" / "plan.json").read_text())
    assert plan["model"]["calibration"] == f"2 batches of 64-token rows of {text}, up to 2 a batch"
    assert f"Scales calibrated on 2 batches of 64-token rows of {text}" in (tmp_path / "text" / "report.md").read_text()
    with safe_open(tmp_path / "text" / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "example" / "model.safetensors", "pt") as b:
        name = next(k for k in a.keys() if k.endswith("input_scale"))
        assert not torch.equal(a.get_tensor(name), b.get_tensor(name))
    capsys.readouterr()
    assert main([*args, str(tmp_path / "x"), "--calibration-text", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main([*args, str(tmp_path / "x"), "--calibration-text", str(tmp_path / "empty.txt")]) == 2
    assert "holds no text" in capsys.readouterr().err
    assert main(["convert", "examples/vit.py", "fp8-static", "-o", str(tmp_path / "x"),
                 "--calibration-text", str(text)]) == 2
    assert "is for hf:DIR text models" in capsys.readouterr().err
    (source / "tokenizer.json").unlink()
    assert main([*args, str(tmp_path / "x"), "--calibration-text", str(text)]) == 2
    assert "no tokenizer transformers can load" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


FP8_AND_2TO4 = """name = "fp8-and-2to4"
[[rules]]
modules = ['re:.*mlp\\..*']
op = "semi_sparse"
[[rules]]
modules = ['re:.*self_attn\\..*']
op = "fp8"
options = { granularity = "row" }
"""


@pytest.mark.parametrize("recipe", ["semi-sparse", "fp8-and-2to4"])
def test_2to4_layers_written_dense_load_in_transformers(llama_dir, tmp_path, recipe):
    """convert --sparse-format dense: the 2:4 layers as plain weights with their zeros under the
    modules' names (FP8 sites beside them stay compressed-tensors'): transformers loads the folder
    as the converted model, 2:4 zeros and all, and lowconv compare reads it back."""
    out = tmp_path / "out"
    if recipe == "fp8-and-2to4":
        (tmp_path / "recipe.toml").write_text(FP8_AND_2TO4)
        recipe = str(tmp_path / "recipe.toml")
    assert main(["convert", f"hf:{llama_dir}", recipe, "-o", str(out), "--sparse-format", "dense"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    ops = {d["site"]["fqn"]: d["op"] for d in plan["decisions"]}
    assert ops["model.layers.0.mlp.up_proj"] == "dense" and "semi_sparse" not in ops.values()
    config = json.loads((out / "config.json").read_text())
    if recipe != "semi-sparse":
        targets = [t for g in config["quantization_config"]["config_groups"].values() for t in g["targets"]]
        assert "model.layers.0.self_attn.q_proj" in targets and "model.layers.0.mlp.up_proj" not in targets
    else:
        assert "quantization_config" not in config
    served = transformers.AutoModelForCausalLM.from_pretrained(out)
    weight = served.model.layers[0].mlp.up_proj.weight.detach()
    assert (weight.reshape(-1, 4) == 0).sum(-1).min() >= 2  # 2 of every 4 are zero
    loaded = load_model(f"hf:{llama_dir}")
    rebuilt = lowconv.load(loaded.model, out, loaded.inputs)
    with torch.no_grad():
        want, got = rebuilt(**loaded.inputs).logits, served(**loaded.inputs).logits
    assert sqnr_db(want, got) >= 60
    assert main(["compare", f"hf:{llama_dir}", str(out)]) == 0


def test_a_conv1d_site_written_dense_is_lowconv_only(tmp_path):
    """GPT-2's Conv1D stores (in, out); a reverted site is an nn.Linear (out, in) under that name,
    which transformers would read transposed: the folder says lowconv alone reads it."""
    loaded = load_model("hf:examples/hf/gpt2-tiny")
    converted = lowconv.revert(lowconv.convert(loaded.model, "semi-sparse", loaded.inputs), "semi_sparse")
    reason = quantization_config(converted.lowconv_plan)["lowconv_only"]
    assert "a Conv1D stored (out, in)" in reason and "dense" in reason


def test_transformers_loads_an_fp8_block_folder_as_the_converted_model(tmp_path):
    """fp8-block (128 x 128 weight tiles, 128-value activation groups) is compressed-tensors' FP8_BLOCK:
    transformers computes lowconv's model (the same dequantized operands, fp32 sums)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 12))
    converted = lowconv.convert(model, "fp8-block", (ids,))
    assert len(converted.lowconv_plan.converted()) == 14  # every linear but lm_head
    lowconv.save(converted, tmp_path / "out")
    groups = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["weights"]["strategy"] for g in groups.values()] == ["block"]
    served = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        want, got = converted(ids).logits, served(ids).logits
    assert sqnr_db(want, got) >= 60
    assert sqnr_db(model(ids).logits, got) < 40
