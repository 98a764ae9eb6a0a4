"""convert --stream (lowconv/stream.py): a sharded hf:DIR checkpoint converted tensor by tensor
gives the bytes of the in-memory conversion, resumes after an interruption, stays within a memory
bound far below the model's size, and refuses what it cannot do, by name."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lowconv import api, checkpoint  # noqa: E402
from lowconv.cli import main  # noqa: E402
from lowconv.errors import LowconvError  # noqa: E402
from lowconv.model_sources import load_model  # noqa: E402
from lowconv.stream import stream_convert  # noqa: E402
from lowconv.stream_writer import JOURNAL  # noqa: E402

SHARD = 100_000  # output shards of at most 100 kB: several


def llama(directory: Path, tied: bool = False, hidden: int = 64, intermediate: int = 128, layers: int = 2,
          shard: str = "60KB") -> Path:
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size=shard)
    return directory


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    path = llama(tmp_path_factory.mktemp("llama") / "llama")
    assert (path / checkpoint.INDEX_FILE).is_file()  # several input shards
    return path


def plan_files(plan, report=None) -> dict[str, str]:
    return {"plan.json": plan.to_json()}


def in_memory(directory: Path, recipe: str, out: Path) -> None:
    loaded = load_model(f"hf:{directory}", device="cpu")
    converted = api.convert(loaded.model, recipe, loaded.inputs, share_weights=True)
    api.save(converted, out, text_files=plan_files(api.plan_of(converted)), max_shard_bytes=SHARD)


def same_files(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for path in a.iterdir():
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name


def same_conversion(memory: Path, stream: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A conversion written by `lowconv convert` (memory) and by `--stream`: plan.json, the index and
    the files beside byte for byte, the same tensors (the shards' metadata differs only in the
    reports' hashes), the same report but for its scope and times (a stream times nothing). The
    streamed tensors and report."""
    assert sorted(p.name for p in memory.iterdir()) == sorted(p.name for p in stream.iterdir())
    for path in memory.iterdir():  # plan.json, an index, an hf: model's config.json, ...
        if not path.name.endswith(".safetensors") and not path.name.startswith("report."):
            assert path.read_bytes() == (stream / path.name).read_bytes(), path.name
    theirs, their_meta = checkpoint.read_checkpoint(memory)
    ours, our_meta = checkpoint.read_checkpoint(stream)
    assert their_meta == our_meta and theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[n].view(torch.uint8), ours[n].view(torch.uint8)) if theirs[n].dtype.itemsize == 1
               else torch.equal(theirs[n], ours[n]) for n in theirs)
    streamed, compared = (json.loads((d / "report.json").read_text()) for d in (stream, memory))
    assert streamed["scope"].startswith("streamed: the model run module by module") and not compared["scope"]
    assert streamed["perf"] is None
    assert {k: v for k, v in streamed.items() if k not in ("scope", "perf")} == \
        {k: v for k, v in compared.items() if k not in ("scope", "perf")}
    return ours, streamed


@pytest.mark.parametrize("recipe, tied", [("fp8-dynamic", False), ("fp8-row", True), ("fp8-static", False)])
def test_streamed_bytes_are_the_in_memory_conversions(tmp_path, sharded, recipe, tied):
    source = llama(tmp_path / "tied") if tied else sharded
    in_memory(source, recipe, tmp_path / "memory")
    streamed = stream_convert(f"hf:{source}", recipe, tmp_path / "stream", text_files=plan_files,
                              max_shard_bytes=SHARD)
    assert streamed.path.name == checkpoint.INDEX_FILE and len(list((tmp_path / "stream").glob("model-*"))) > 1
    assert streamed.report.gate_min_sqnr_db == 15.0 and streamed.report.passed and streamed.report.outputs
    same_files(tmp_path / "memory", tmp_path / "stream")
    assert not (tmp_path / ".stream.stream").exists()  # the staging directory goes once installed


def test_resumes_after_an_interruption(tmp_path, sharded):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("a previous run's")
    steps = []

    def interrupted(message):
        steps.append(message)
        if message.startswith("[12/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream_convert(f"hf:{sharded}", "fp8-dynamic", out, text_files=plan_files, max_shard_bytes=SHARD,
                       progress=interrupted)
    assert [p.name for p in out.iterdir()] == ["kept.txt"]  # out/ as it was
    assert (tmp_path / ".out.stream" / JOURNAL).is_file()
    messages = []
    streamed = stream_convert(f"hf:{sharded}", "fp8-dynamic", out, text_files=plan_files, max_shard_bytes=SHARD,
                              progress=messages.append)
    assert streamed.skipped > 0 and any(m.startswith("resuming: 11 of 21 steps") for m in messages), messages
    assert not any("embed_tokens" in m for m in messages if m.startswith("["))  # written before: not redone
    in_memory(sharded, "fp8-dynamic", tmp_path / "memory")
    (out / "kept.txt").unlink()
    same_files(tmp_path / "memory", out)


def test_cli_stream(tmp_path, sharded, capsys):
    args = [f"hf:{sharded}", "fp8-dynamic", "--device", "cpu", "--max-shard-size", "100KB"]
    assert main(["convert", *args, "-o", str(tmp_path / "memory")]) == 0
    assert main(["convert", *args, "--stream", "-o", str(tmp_path / "stream")]) == 0
    assert "ETA" in capsys.readouterr().err
    memory, stream = tmp_path / "memory", tmp_path / "stream"
    # The same tensors, and the report compare writes: each site alone and in the converted model,
    # the outputs and the gate.
    _, streamed = same_conversion(memory, stream)
    assert len(streamed["sites"]) == 14 and all(s["metrics"] and s["alone"] for s in streamed["sites"])
    assert [o["name"] for o in streamed["outputs"]] == ["output.logits"] and streamed["passed"]
    markdown = (stream / "report.md").read_text()
    assert "Compared: streamed" in markdown and "## Model outputs" in markdown and "PASS (gate: SQNR >= 15" in markdown
    assert "| model.layers.0.self_attn.q_proj | fp8  | " in markdown
    assert main(["compare", f"hf:{sharded}", str(stream), "--device", "cpu"]) == 0


STATIC_MLP = """name = "static-mlp"
[[rules]]
kind = "linear"
modules = ["re:.*mlp[.].*"]
op = "fp8"
options = { scaling = "static", granularity = "tensor" }

[[rules]]
kind = "linear"
modules = ["lm_head"]
op = "keep"

[[rules]]
kind = "linear"
op = "fp8"
options = { granularity = "row" }
"""


def test_cli_stream_calibrates_on_a_text_file_as_in_memory(tmp_path, sharded, capsys):
    """--calibration-text with --stream: the MLPs' static scales calibrated on two batches of the
    text, run through the converted model (its attention projections dynamic FP8) in lockstep with
    the example inputs' run: every file the in-memory conversion writes, byte for byte, and the
    same report of each site alone."""
    from tests.test_hf_output import word_tokenizer
    source = tmp_path / "llama"
    shutil.copytree(sharded, source)
    word_tokenizer(source, 256)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i % 11}" for i in range(600)))
    recipe = tmp_path / "static-mlp.toml"
    recipe.write_text(STATIC_MLP)
    args = [f"hf:{source}", str(recipe), "--device", "cpu", "--max-shard-size", "100KB", "--calibration-text",
            str(text), "--calibration", "2"]
    assert main(["convert", *args, "-o", str(tmp_path / "memory")]) == 0
    capsys.readouterr()
    assert main(["convert", *args, "--stream", "-o", str(tmp_path / "stream")]) == 0
    assert "its scales calibrated on 2 batches of 64-token rows" in capsys.readouterr().err
    plan = json.loads((tmp_path / "stream" / "plan.json").read_text())
    assert plan["model"]["calibration"] == f"2 batches of 64-token rows of {text}, up to 2 a batch"
    assert {d["options"].get("scaling") for d in plan["decisions"] if d["op"] == "fp8"} == {"static", "dynamic"}
    ours, streamed = same_conversion(tmp_path / "memory", tmp_path / "stream")
    assert streamed["calibration"] == plan["model"]["calibration"]
    assert any(n.endswith("mlp.down_proj.input_scale") for n in ours)


def test_the_reader_hands_out_each_tensor_in_any_order_within_its_read_ahead(tmp_path, monkeypatch):
    """CheckpointReader: tensors read ahead in the order given, handed out in whatever order they are
    asked for (the same values as safetensors reads), never more than READ_AHEAD bytes held ahead
    (one tensor larger than that alone); a file cut short is named."""
    from safetensors.torch import save_file

    from lowconv import input_checkpoint as checkpoint_reading
    from lowconv.input_checkpoint import CheckpointReader, input_checkpoint
    tensors = {f"t{i}": torch.randn(1000 + i, dtype=torch.bfloat16) for i in range(8)}
    tensors["big"] = torch.arange(6000, dtype=torch.int32).reshape(60, 100)
    save_file(tensors, tmp_path / "model.safetensors")
    source = input_checkpoint(tmp_path, "hf:x")
    monkeypatch.setattr(checkpoint_reading, "READ_AHEAD", 5000)  # two or so bf16 tensors
    held = []
    with CheckpointReader(source, [*tensors, "t3"]) as reader:
        for name in ["t0", "t1", "big", "t5", "t2", "t7", "t3", "t3", "t4", "t6"]:
            held.append(reader.held)
            got = reader.read(name)
            assert got.dtype == tensors[name].dtype and torch.equal(got, tensors[name]), name
    assert max(held) <= 24000 and held.count(0) < len(held)  # "big" (24000 bytes) alone; others 2 KB each
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    last = max(source.spans, key=lambda name: source.spans[name][1])
    with CheckpointReader(source, []) as reader, pytest.raises(LowconvError, match=f"cannot read {last}: the file "
                                                                                   r"ends 10 bytes short of it"):
        reader.read(last)


def test_memory_stays_far_below_the_models_size(tmp_path):
    """A 100 MB model streamed in a child process whose peak RSS (ru_maxrss) grows by less than
    40 MB over its state after a warm-up conversion (the code's one-time costs): 27 MB measured; the
    in-memory path, which holds the model and its converted copy, grows it by 160 MB."""
    small = llama(tmp_path / "small")
    big = llama(tmp_path / "big", hidden=512, intermediate=1536, layers=8, shard="10MB")
    model_bytes = sum((big / p).stat().st_size for p in os.listdir(big) if p.endswith(".safetensors"))
    assert model_bytes > 100e6
    child = textwrap.dedent(f"""
        import json, resource
        from lowconv.stream import stream_convert
        def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        stream_convert("hf:{small}", "fp8-dynamic", "{tmp_path / 'warm'}")
        base = peak()
        stream_convert("hf:{big}", "fp8-dynamic", "{tmp_path / 'out'}", max_shard_bytes=10_000_000)
        print(json.dumps({{"grew": peak() - base}}))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    grew = json.loads(done.stdout.strip().splitlines()[-1])["grew"]
    assert grew < 40e6 < model_bytes / 2, f"peak RSS grew by {grew / 1e6:.1f} MB streaming a {model_bytes / 1e6:.0f} MB model"


@pytest.mark.parametrize("recipe, says", [
    ("sparse-attention-bf16", "of kind 'attention', and the stream converts linear sites only"),
    ("semi-sparse", "measures and chooses its kernels as it is built"),
])
def test_refuses_what_it_cannot_stream(tmp_path, sharded, recipe, says):
    with pytest.raises(LowconvError, match=f"--stream cannot carry out recipe '{recipe}', rule \\d") as err:
        stream_convert(f"hf:{sharded}", recipe, tmp_path / "out")
    assert says in str(err.value) and "convert without --stream" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_refuses_other_sources_and_flags(tmp_path, sharded, capsys):
    with pytest.raises(LowconvError, match="--stream converts hf:DIR models"):
        stream_convert("nn:transformer-encoder", "fp8-dynamic", tmp_path / "out")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_bytes((sharded / "config.json").read_bytes())
    with pytest.raises(LowconvError, match="config_only holds neither model.safetensors.index.json nor "
                                           r"model.safetensors \(safetensors weights\)"):
        stream_convert(f"hf:{tmp_path / 'config_only'}", "fp8-dynamic", tmp_path / "out")
    assert main(["convert", f"hf:{sharded}", "fp8-static", "--stream", "--calibration", "4",
                 "-o", str(tmp_path / "out")]) == 2
    assert f"--calibration: hf:{sharded} defines no calibration_inputs()" in capsys.readouterr().err
    assert main(["convert", f"hf:{sharded}", "fp8-dynamic", "--stream", "--sparse-format", "dense",
                 "-o", str(tmp_path / "out")]) == 2
    assert "--stream does not take --sparse-format dense" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_config_without_dtype_streams_in_the_checkpoints_dtype(tmp_path):
    """from_pretrained builds such a model in its first floating tensor's dtype, not in float32."""
    source = llama(tmp_path / "bf16")
    transformers.LlamaForCausalLM.from_pretrained(source).to(torch.bfloat16).save_pretrained(source, max_shard_size="60KB")
    config = json.loads((source / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps(config))
    in_memory(source, "fp8-dynamic", tmp_path / "memory")
    stream_convert(f"hf:{source}", "fp8-dynamic", tmp_path / "stream", text_files=plan_files, max_shard_bytes=SHARD)
    same_files(tmp_path / "memory", tmp_path / "stream")
    assert checkpoint.read_checkpoint(tmp_path / "stream")[0]["model.norm.weight"].dtype == torch.bfloat16


def test_a_resumed_run_on_changed_weights_starts_over(tmp_path):
    source, out = llama(tmp_path / "llama"), tmp_path / "out"

    def interrupted(message):
        if message.startswith("[12/"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        stream_convert(f"hf:{source}", "fp8-dynamic", out, text_files=plan_files, max_shard_bytes=SHARD,
                       progress=interrupted)
    (tmp_path / ".out.stream" / "left").mkdir()  # whatever else is in the staging directory goes too
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(source, max_shard_size="60KB")  # the same shapes, other weights
    messages = []
    streamed = stream_convert(f"hf:{source}", "fp8-dynamic", out, text_files=plan_files, max_shard_bytes=SHARD,
                              progress=messages.append)
    assert streamed.skipped == 0 and not any(m.startswith("resuming") for m in messages)
    assert any(m.endswith("tensors of a run on other inputs, another recipe or other shards: starting over")
               for m in messages), messages
    in_memory(source, "fp8-dynamic", tmp_path / "memory")
    same_files(tmp_path / "memory", out)


def test_refuses_broken_or_mismatched_inputs_before_writing(tmp_path, sharded):
    single = tmp_path / "single"
    transformers.LlamaForCausalLM.from_pretrained(sharded).save_pretrained(single)  # one model.safetensors
    weights = (single / checkpoint.CHECKPOINT_FILE).read_bytes()
    (single / checkpoint.CHECKPOINT_FILE).write_bytes(weights[:len(weights) // 2])
    with pytest.raises(LowconvError, match="model.safetensors is not a readable safetensors file"):
        stream_convert(f"hf:{single}", "fp8-dynamic", tmp_path / "out")
    (single / checkpoint.CHECKPOINT_FILE).write_bytes(weights)
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(LowconvError, match=r"model.safetensors holds model.layers.0.mlp.down_proj.weight with shape "
                                           r"\[64, 128\], but config.json's model has \[64, 96\]: the model and"):
        stream_convert(f"hf:{single}", "fp8-dynamic", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["single"]  # no output, no staging directory


def test_cli_says_interrupted(tmp_path, sharded, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("lowconv.cli.stream_convert", interrupt)
    assert main(["convert", f"hf:{sharded}", "fp8-dynamic", "--stream", "-o", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip().endswith("lowconv: interrupted")


class ReadsAParameterOutsideItsModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.head(self.fc(x)) + torch.nn.functional.linear(x, self.fc.weight)


def test_a_model_that_cannot_run_module_by_module_is_converted_but_not_measured(tmp_path):
    """Its code computes with fc.weight outside fc (the plan keeps fc for it): the run stops there,
    and the report says so rather than measure on stand-ins; the site is converted all the same,
    and the model is left with its own parameters."""
    from lowconv.analysis import plan_conversion
    from lowconv.ops import OPS
    from lowconv.passes.rewrite import linear_site_params
    from lowconv.stream_pass import streamed_pass

    model = ReadsAParameterOutsideItsModule()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(4, 64)
    analysis, plan = plan_conversion(model, "fp8-dynamic", (x,))
    sites = {s.fqn: s for s in analysis.sites}
    built, loaded = [], []

    def build(site, read):
        decision = next(d for d in plan.converted() if d.fqn == site.fqn)
        op = OPS[decision.op]
        built.append(site.fqn)
        return op.from_site(site, decision.options, linear_site_params(site, read))
    params = dict(model.named_parameters())
    report = streamed_pass(model, plan, sites, (x,), weights.__getitem__, build, lambda site, op: None,
                           lambda s, t: loaded.append(s))
    assert [row.fqn for row in report.sites] == ["head"] and all(row.alone is None for row in report.sites)
    assert report.sites[0].note == ("not measured: the model does not run module by module (linear computed with "
                                    "fc.weight while the module that owns it was not running)")
    assert dict(model.named_parameters()) == params  # its own parameters are back
    assert built == ["head"] and len(loaded) == 4  # both modules ran before the outside read


def test_a_failed_write_keeps_what_was_written_and_resumes(tmp_path, sharded, monkeypatch):
    """A disk error on the writing thread (here the 10th write: a full disk) stops the stream with
    the error, out/ untouched; the same command then resumes."""
    import errno
    pwrite, calls = os.pwrite, []

    def failing(descriptor, data, offset):
        calls.append(descriptor)
        if len(calls) == 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(descriptor, data, offset)
    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(LowconvError, match=r"No space left on device; the \d+ of 21 steps written are kept in "
                                           r".*\.out\.stream, where the same command resumes"):
        stream_convert(f"hf:{sharded}", "fp8-dynamic", tmp_path / "out", text_files=plan_files, max_shard_bytes=SHARD)
    assert not (tmp_path / "out").exists()
    streamed = stream_convert(f"hf:{sharded}", "fp8-dynamic", tmp_path / "out", text_files=plan_files,
                              max_shard_bytes=SHARD)
    assert streamed.skipped >= 9
    in_memory(sharded, "fp8-dynamic", tmp_path / "memory")
    same_files(tmp_path / "memory", tmp_path / "out")


def test_gpt2_conv1d_sites_are_measured_as_in_memory(tmp_path):
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2", max_shard_size="100KB")
    loaded = load_model(f"hf:{tmp_path / 'gpt2'}", device="cpu")
    converted = api.convert(loaded.model, "fp8-row", loaded.inputs, share_weights=True)
    from lowconv.compare import compare
    compared = compare(loaded.model, converted, loaded.inputs)
    streamed = stream_convert(f"hf:{tmp_path / 'gpt2'}", "fp8-row", tmp_path / "out").report
    assert streamed.sites == compared.sites and streamed.outputs == compared.outputs
    assert len(streamed.sites) == 8 and all(s.alone and s.metrics for s in streamed.sites)


def test_extra_checkpoint_tensors_are_named_and_an_output_into_the_input_is_refused(tmp_path, sharded, capsys):
    source = tmp_path / "one_layer"
    source.mkdir()
    for path in sharded.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    messages = []
    stream_convert(f"hf:{source}", "fp8-dynamic", tmp_path / "out", progress=messages.append)
    warning = next(m for m in messages if m.startswith("warning:"))
    assert "holds 9 tensors config.json's model does not have, not written: model.layers.1." in warning
    assert main(["convert", f"hf:{source}", "fp8-dynamic", "--stream", "-o", str(source)]) == 2
    assert "is the model's own directory" in capsys.readouterr().err


def test_a_stream_that_waited_for_another_into_the_same_output_converts(tmp_path, sharded, monkeypatch):
    """The stream it waited for removed the staging directory as it finished."""
    locked = checkpoint.locked

    @contextlib.contextmanager
    def after_another(directory):
        with locked(directory):
            shutil.rmtree(directory)
            yield
    monkeypatch.setattr(checkpoint, "locked", after_another)
    streamed = stream_convert(f"hf:{sharded}", "fp8-dynamic", tmp_path / "out", text_files=plan_files,
                              max_shard_bytes=SHARD)
    assert streamed.written == 35


def test_a_checkpoint_transformers_renames_as_it_loads_streams(tmp_path):
    """GPT-NeoX's checkpoints hold lm_head as embed_out.weight (transformers' conversion mapping
    renames it on load): the stream reads it under that name, and writes what the in-memory path does."""
    config = transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox", max_shard_size="100KB")
    with open(tmp_path / "neox" / checkpoint.INDEX_FILE) as f:
        assert "embed_out.weight" in json.load(f)["weight_map"]
    in_memory(tmp_path / "neox", "fp8-row", tmp_path / "memory")
    stream_convert(f"hf:{tmp_path / 'neox'}", "fp8-row", tmp_path / "stream", text_files=plan_files,
                   max_shard_bytes=SHARD)
    same_files(tmp_path / "memory", tmp_path / "stream")
