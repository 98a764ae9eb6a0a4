import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowconv import checkpoint
from lowconv.checkpoint import (
    ALIASES_KEY,
    CHECKPOINT_FILE,
    check_tensors,
    model_signature,
    read_checkpoint,
    save_checkpoint,
    write_safetensors,
)
from lowconv.errors import LowconvError

ROOT = Path(__file__).resolve().parents[1]
METADATA = {
    "lowconv.version": "0.1.0",
    "lowconv.plan": json.dumps([{"fqn": "fc", "op": "fp8"}]),
    "lowconv.model": "0123456789abcdef",
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality for any dtype (float8 has no CPU `==`, and NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g)
    return {
        "fc.weight": (w * 10).to(torch.float8_e4m3fn),
        "fc.weight_scale": torch.tensor([0.0123], dtype=torch.bfloat16),
        "grad_like": (w * 1000).to(torch.float8_e5m2),
        "sparse.bitmask": torch.randint(0, 256, (32, 2), dtype=torch.uint8, generator=g),
        "sparse.shape": torch.tensor([32, 16], dtype=torch.int64),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
        "half": torch.randn(3, 5, generator=g).half(),
        "double": torch.randn(7, generator=g, dtype=torch.float64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def test_roundtrip_mixed_dtypes(tmp_path):
    tensors = mixed_tensors()
    path = save_checkpoint(tmp_path / "out", tensors, METADATA)
    assert path == tmp_path / "out" / CHECKPOINT_FILE
    loaded, metadata = read_checkpoint(tmp_path / "out")
    assert metadata == METADATA
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name


def test_tied_tensors_are_stored_once_and_restored(tmp_path):
    embedding = torch.randn(10, 8)
    tensors = {"embed.weight": embedding, "head.weight": embedding, "other": torch.randn(8)}
    save_checkpoint(tmp_path, tensors, METADATA)
    with safe_open(tmp_path / CHECKPOINT_FILE, framework="pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "other"]
        assert json.loads(f.metadata()[ALIASES_KEY]) == {"head.weight": "embed.weight"}
    loaded, metadata = read_checkpoint(tmp_path)
    assert ALIASES_KEY not in metadata
    assert torch.equal(loaded["head.weight"], embedding)
    assert loaded["head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()


def test_overlapping_and_non_contiguous_views_are_saved_as_copies(tmp_path):
    base = torch.randn(6, 4)
    tensors = {"base": base, "rows": base[2:], "transposed": base.t()}
    save_checkpoint(tmp_path, tensors, METADATA)
    loaded, _ = read_checkpoint(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
        assert loaded[name].is_contiguous()


def test_same_storage_with_another_dtype_is_not_an_alias(tmp_path):
    packed = torch.arange(8, dtype=torch.uint8)
    tensors = {"packed": packed, "as_fp8": packed.view(torch.float8_e4m3fn)}
    save_checkpoint(tmp_path, tensors, METADATA)
    loaded, _ = read_checkpoint(tmp_path)
    assert loaded["as_fp8"].dtype == torch.float8_e4m3fn
    assert same_bits(loaded["as_fp8"], tensors["as_fp8"])


def test_save_refuses_metadata_without_lowconv_keys(tmp_path):
    with pytest.raises(ValueError, match="lowconv.plan"):
        save_checkpoint(tmp_path, {"a": torch.ones(1)}, {k: v for k, v in METADATA.items() if k != "lowconv.plan"})


def test_failed_save_leaves_old_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    old = {"w": torch.randn(4, 4)}
    save_checkpoint(tmp_path, old, METADATA)
    old_bytes = (tmp_path / CHECKPOINT_FILE).read_bytes()

    def half_written(filename, tensors, metadata):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_safetensors", half_written)
    with pytest.raises(LowconvError, match=f"cannot write {tmp_path / CHECKPOINT_FILE}: disk full; the file was left"):
        save_checkpoint(tmp_path, {"w": torch.zeros(4, 4)}, METADATA)
    assert os.listdir(tmp_path) == [CHECKPOINT_FILE]
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == old_bytes
    loaded, _ = read_checkpoint(tmp_path)
    assert torch.equal(loaded["w"], old["w"])


def test_text_files_replace_the_old_ones_with_the_checkpoint_all_or_none(tmp_path, monkeypatch):
    files = {"plan.json": "plan 1 ✓", "report.md": "report 1", "report.json": "{}"}
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, files)
    assert all((tmp_path / name).read_text(encoding="utf-8") == text for name, text in files.items())
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}

    def full_disk_at_report_json(content):
        def write(tmp):
            if tmp.name.startswith(".report.json."):
                raise OSError(28, "No space left on device")
            tmp.write_bytes(content)
        return write

    monkeypatch.setattr(checkpoint, "_file_writer", full_disk_at_report_json)
    with pytest.raises(LowconvError, match=f"cannot write {tmp_path / 'report.json'}: No space left on device; "
                                           f"nothing in {tmp_path} was changed"):
        save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA, {name: "run 2" for name in files})
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before

    monkeypatch.undo()
    (tmp_path / "plan.json").unlink()
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(LowconvError, match="plan.json: it is a directory; nothing in"):
        save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA, {name: "run 3" for name in files})
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == before[CHECKPOINT_FILE]
    assert sorted(os.listdir(tmp_path)) == sorted(before)


def test_missing_directory_or_file(tmp_path):
    with pytest.raises(LowconvError, match=r"no model\.safetensors in .*nowhere/: is this a lowconv output directory"):
        read_checkpoint(tmp_path / "nowhere")
    with pytest.raises(LowconvError, match=str(tmp_path)):
        read_checkpoint(tmp_path)
    with pytest.raises(LowconvError, match=r"nowhere\.safetensors does not exist"):
        read_checkpoint(tmp_path / "nowhere.safetensors")


def test_an_output_directory_named_like_a_checkpoint_file(tmp_path):
    out = tmp_path / "converted.safetensors"
    save_checkpoint(out, {"w": torch.ones(2)}, METADATA)
    assert torch.equal(read_checkpoint(out)[0]["w"], torch.ones(2))
    assert torch.equal(read_checkpoint(out / CHECKPOINT_FILE)[0]["w"], torch.ones(2))


def test_saving_into_a_file_says_it_is_one(tmp_path):
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(LowconvError, match="a_file is a file, not a directory: give the directory to save into"):
        save_checkpoint(tmp_path / "a_file", {"w": torch.ones(2)}, METADATA)
    assert (tmp_path / "a_file").read_text() == "mine"


def test_truncated_file(tmp_path):
    path = save_checkpoint(tmp_path, mixed_tensors(), METADATA)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])
    with pytest.raises(LowconvError, match=rf"{path}.*truncated or corrupt"):
        read_checkpoint(tmp_path)


def test_garbage_file(tmp_path):
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(LowconvError, match=rf"{tmp_path / CHECKPOINT_FILE}.*truncated or corrupt"):
        read_checkpoint(tmp_path)


def test_foreign_safetensors_file(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / CHECKPOINT_FILE, metadata={"format": "pt"})
    with pytest.raises(LowconvError, match="not a lowconv checkpoint"):
        read_checkpoint(tmp_path)
    save_file({"w": torch.ones(2)}, tmp_path / CHECKPOINT_FILE, metadata={"lowconv.version": "0.1.0"})
    with pytest.raises(LowconvError, match="lowconv.plan"):
        read_checkpoint(tmp_path)


def test_reading_the_file_itself(tmp_path):
    path = save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA)
    loaded, _ = read_checkpoint(path)
    assert torch.equal(loaded["w"], torch.ones(2))


def test_check_tensors_accepts_a_match():
    tensors = mixed_tensors()
    check_tensors(tensors, {name: t.clone() for name, t in tensors.items()}, "out/model.safetensors")


def test_check_tensors_lists_every_problem():
    expected = {
        "fc.weight": torch.empty(32, 16, dtype=torch.float8_e4m3fn),
        "fc.weight_scale": torch.empty(1),
        "head.weight": torch.empty(10, 16),
        "head.bias": torch.empty(10),
    }
    found = {
        "fc.weight": torch.empty(32, 16),  # dtype wrong
        "fc.weight_scale": torch.empty(32, 1),  # shape wrong
        "head.weight": torch.empty(10, 16),
        "head.extra": torch.empty(3),
    }
    with pytest.raises(LowconvError) as e:
        check_tensors(expected, found, "out/model.safetensors")
    message = str(e.value)
    assert message.startswith("out/model.safetensors")
    assert "missing from the checkpoint (1):\n    head.bias" in message
    assert "not in the model (1):\n    head.extra" in message
    assert "fc.weight: expected ([32, 16], float8_e4m3fn) vs found ([32, 16], float32)" in message
    assert "fc.weight_scale: expected ([1], float32) vs found ([32, 1], float32)" in message
    assert "head.weight:" not in message


def test_check_tensors_caps_long_lists():
    expected = {f"layer{i}.weight": torch.empty(2) for i in range(25)}
    with pytest.raises(LowconvError) as e:
        check_tensors(expected, {}, "ckpt")
    message = str(e.value)
    assert "missing from the checkpoint (25)" in message
    assert "layer9.weight" in message and "layer10.weight" not in message
    assert "and 15 more" in message


def test_model_signature():
    state = {"fc.weight": torch.randn(8, 4), "fc.bias": torch.randn(8)}
    signature = model_signature(state)
    assert signature == model_signature(state)
    assert len(signature) == 16
    assert signature == model_signature({"fc.bias": torch.zeros(8), "fc.weight": torch.ones(8, 4)})
    assert signature != model_signature({"fc.weight": torch.randn(8, 5), "fc.bias": torch.randn(8)})
    assert signature != model_signature({"fc.weight": torch.randn(8, 4).half(), "fc.bias": torch.randn(8)})
    assert signature != model_signature({"fc2.weight": torch.randn(8, 4), "fc.bias": torch.randn(8)})


def test_a_plan_written_before_notes_constants_and_decisions_existed_still_loads():
    """Checkpoints of earlier versions hold plans without Decision.note, constant_args, decided."""
    import json

    from lowconv.plan import Plan

    from tests.sites import linear_site

    site = linear_site(4, 8).describe().to_json()  # less the fields older sites lack
    site = {key: value for key, value in site.items() if key not in ("module_backed", "reads_parameter_device", "frozen")}
    old = {"recipe": "r", "recipe_text": "", "regions": [""], "none_args": {}, "untraced": [],
           "decisions": [{"site": site, "op": "fp8", "options": {}, "rule": 1, "reason": "matched"}]}
    plan = Plan.from_json(json.dumps(old))
    assert plan.decisions[0].note == "" and plan.constant_args == {} and plan.decided == {}
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_a_new_checkpoint_gets_the_umask_mode_and_a_replaced_one_keeps_its_mode(tmp_path, umask, mode):
    umask = os.umask(umask)
    try:
        path = save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, {"report.md": "r"})
        assert path.stat().st_mode & 0o777 == mode and (tmp_path / "report.md").stat().st_mode & 0o777 == mode
        os.chmod(path, 0o600)
        save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA)
        assert path.stat().st_mode & 0o777 == 0o600
        # the first save's report described the first checkpoint: it goes with it
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    finally:
        os.umask(umask)


def test_a_failed_rename_puts_back_the_files_already_replaced(tmp_path, monkeypatch):
    files = {"plan.json": "plan 1", "report.md": "report 1"}
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, files)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    replace = os.replace

    def report_md_is_not_ours(src, dst):  # as in a sticky directory where another user owns it
        if str(src).endswith("report.md"):
            raise PermissionError(1, "Operation not permitted")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", report_md_is_not_ours)
    with pytest.raises(LowconvError, match=f"cannot replace {tmp_path / 'report.md'}: Operation not permitted; "
                                           f"nothing in {tmp_path} was changed"):
        save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA, {name: "run 2" for name in files})
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


@pytest.mark.parametrize("version", ["99.0", "0.1.0-dev", ""])
def test_a_checkpoint_of_an_unknown_or_newer_version_is_refused(tmp_path, version):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, {**METADATA, "lowconv.version": version})
    with pytest.raises(LowconvError, match=f"was written by lowconv '{re.escape(version)}', which this lowconv"):
        read_checkpoint(tmp_path)
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, {**METADATA, "lowconv.version": "0.0.9"})
    read_checkpoint(tmp_path)  # an older one is read


def test_a_checkpoint_above_the_shard_size_is_sharded_as_hugging_face_names_it(tmp_path):
    tensors = mixed_tensors()
    tensors["tied"] = tensors["half"]  # an alias in one shard of a tensor stored in another
    path = save_checkpoint(tmp_path, tensors, METADATA, max_shard_bytes=600)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert path == tmp_path / "model.safetensors.index.json" and len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / CHECKPOINT_FILE).exists()
    index = json.loads(path.read_text())
    assert set(index["weight_map"]) == set(tensors) - {"tied"} and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "tied")
    found, metadata = read_checkpoint(tmp_path)
    assert metadata == METADATA and all(same_bits(found[name], t) for name, t in tensors.items())
    assert found["tied"] is found["half"]


def test_a_new_layout_removes_the_old_ones_files(tmp_path):
    tensors = mixed_tensors()
    save_checkpoint(tmp_path, tensors, METADATA, max_shard_bytes=600)
    save_checkpoint(tmp_path, tensors, METADATA, max_shard_bytes=1000)  # fewer shards: the others go
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert shards and all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    save_checkpoint(tmp_path, tensors, METADATA)  # one file: the shards and the index go
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]
    assert read_checkpoint(tmp_path)[1] == METADATA


def test_a_shard_missing_or_a_broken_index_names_the_file(tmp_path):
    save_checkpoint(tmp_path, mixed_tensors(), METADATA, max_shard_bytes=600)
    (tmp_path / "model-00002-of-00003.safetensors").rename(tmp_path / "elsewhere")
    with pytest.raises(LowconvError, match="names model-00002-of-00003.safetensors, which is not in"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(LowconvError, match="model.safetensors.index.json is not a safetensors index"):
        read_checkpoint(tmp_path)


def test_files_a_previous_checkpoint_wrote_go_with_it_and_others_stay(tmp_path):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, {"tokenizer.json": "{}", "report.md": "r1"})
    (tmp_path / "notes.txt").write_text("mine")
    save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA, {"report.md": "r2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt", "report.md"]
    assert (tmp_path / "report.md").read_text() == "r2"


def test_the_same_tensors_and_metadata_give_the_same_bytes_that_safetensors_reads(tmp_path):
    """write_safetensors sorts every key (safetensors' own writer ordered the metadata per process);
    safetensors reads what it writes, each dtype, 0-d and empty tensors, bit for bit."""
    tensors = mixed_tensors()
    metadata = {"b": "2", "a": "1 ✓"}
    write_safetensors(tmp_path / "one.safetensors", tensors, metadata)
    write_safetensors(tmp_path / "two.safetensors", dict(reversed(tensors.items())), dict(reversed(metadata.items())))
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    with safe_open(tmp_path / "one.safetensors", "pt") as f:
        assert f.metadata() == metadata
        assert all(same_bits(f.get_tensor(name), t) for name, t in tensors.items())


def test_a_conversion_run_twice_writes_the_same_bytes(tmp_path):
    """Two processes (other hash seeds), the model path spelled two ways: every file the same."""
    def convert(out, model, seed):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-m", "lowconv.cli", "convert", model, "fp8-dynamic", "-o", str(out)],
                       check=True, capture_output=True, env=env, cwd=ROOT)
    convert(tmp_path / "one", "examples/vit.py", "1")
    convert(tmp_path / "two", "./examples/../examples/vit.py", "2")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def header_of(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return 8 + size, json.loads(data[8:8 + size])


def rewritten(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def test_changed_tensor_bytes_are_found_at_load_and_named(tmp_path):
    """A flipped byte in a tensor, or two tensors' names swapped in the header: read_checkpoint
    names the tensors, where they loaded as if nothing happened."""
    path = save_checkpoint(tmp_path, mixed_tensors(), METADATA)
    start, header = header_of(path)
    data = bytearray(path.read_bytes())
    begin, _ = header["half"]["data_offsets"]
    data[start + begin] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(LowconvError, match=r"half do not hold the bytes they were saved with.*changed or corrupted"):
        read_checkpoint(tmp_path)

    path = save_checkpoint(tmp_path, mixed_tensors(), METADATA)
    start, header = header_of(path)
    header["fc.weight"], header["grad_like"] = header["grad_like"], header["fc.weight"]  # same shape, other bytes
    header["fc.weight"]["dtype"], header["grad_like"]["dtype"] = "F8_E4M3", "F8_E5M2"
    rewritten(path, header, path.read_bytes()[start:])
    with pytest.raises(LowconvError, match=r"fc.weight, grad_like do not hold the bytes"):
        read_checkpoint(tmp_path)


def test_an_alias_over_a_stored_tensor_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, {"a": torch.ones(2), "b": torch.zeros(2)}, METADATA)
    start, header = header_of(path)
    header["__metadata__"][ALIASES_KEY] = json.dumps({"b": "a"})
    rewritten(path, header, path.read_bytes()[start:])
    with pytest.raises(LowconvError, match="makes b aliases, but the file stores tensors under those names"):
        read_checkpoint(tmp_path)


def test_a_checkpoint_without_checksums_still_reads(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / CHECKPOINT_FILE, metadata=METADATA)
    loaded, _ = read_checkpoint(tmp_path)
    assert torch.equal(loaded["w"], torch.ones(2))


def test_a_read_only_disk_is_named_even_where_the_clean_up_fails_too(tmp_path, monkeypatch):
    """On a read-only file system the temporary files cannot be removed either: the error says why
    the save failed, not that the clean-up did."""
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(checkpoint, "write_safetensors", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(LowconvError, match=f"cannot write {tmp_path / CHECKPOINT_FILE}: Read-only file system"):
        save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA)


def test_temporaries_an_interrupted_save_left_are_reported_then_removed(tmp_path):
    """A save killed between its renames leaves the old file moved aside and its new one as a
    hidden temporary: load says so (where the checkpoint is missing), the next save removes them."""
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA)
    (tmp_path / CHECKPOINT_FILE).rename(tmp_path / f".{CHECKPOINT_FILE}.0badc0de.old")
    (tmp_path / f".{CHECKPOINT_FILE}.0badc0de.tmp").write_bytes(b"half a file")
    with pytest.raises(LowconvError, match=rf"a save was interrupted; the previous checkpoint is .*\.{CHECKPOINT_FILE}"
                                           rf"\.0badc0de\.old \(rename it back\)"):
        read_checkpoint(tmp_path)
    (tmp_path / ".notes.txt").write_text("the user's")
    save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.txt", CHECKPOINT_FILE]


@pytest.mark.skipif(os.name != "posix", reason="the lock is flock's")
def test_a_second_save_into_a_directory_waits_for_the_first(tmp_path):
    import fcntl
    import threading
    tmp_path.mkdir(exist_ok=True)
    held = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a save in progress holds it
    saving = threading.Thread(target=save_checkpoint, args=(tmp_path, {"w": torch.ones(2)}, METADATA))
    saving.start()
    saving.join(0.5)
    assert saving.is_alive() and not (tmp_path / CHECKPOINT_FILE).exists()
    os.close(held)
    saving.join(10)
    assert not saving.is_alive() and (tmp_path / CHECKPOINT_FILE).exists()



KILL_DURING_SAVE = """
import os, sys, torch
from lowconv.checkpoint import save_checkpoint
from tests.test_checkpoint import METADATA
real, done = os.replace, []
def replace(source, target):
    if str(source).endswith(".tmp"):
        if len(done) == int(sys.argv[2]):
            os._exit(9)  # as kill -9: no clean-up, no roll-back
        done.append(target)
    return real(source, target)
os.replace = replace
save_checkpoint(sys.argv[1], {"w": torch.zeros(2)}, METADATA, {"plan.json": "plan 2", "report.json": "{}"})
"""


@pytest.mark.parametrize("renames_done", [1, 2])
def test_a_save_killed_between_renames_is_never_read_as_a_mix(tmp_path, renames_done):
    """The files beside the weights are renamed in first and the weights last, and the weights list
    the files' hashes: a save killed after some renames is read as the old checkpoint with new files
    beside it, which load refuses by name, or finds the weights moved aside, which it says."""
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, {"plan.json": "plan 1", "report.json": "{\"run\": 1}"})
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(tmp_path), str(renames_done)])
    assert killed.returncode == 9
    if renames_done == 1:  # plan.json is the new one
        with pytest.raises(LowconvError, match=rf"plan.json is not the file saved with {CHECKPOINT_FILE} \(a save was "
                                               r"interrupted, or it was changed since\)"):
            read_checkpoint(tmp_path)
    else:  # both files new, the weights moved aside before their rename
        with pytest.raises(LowconvError, match=r"a save was interrupted; the previous checkpoint is"):
            read_checkpoint(tmp_path)


def test_ctrl_c_during_the_renames_puts_every_old_file_back(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, {"plan.json": "plan 1"})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.replace

    def interrupted_at_the_weights(source, target):  # plan.json is in by then, the old weights moved aside
        if Path(source).name.startswith(f".{CHECKPOINT_FILE}.") and str(source).endswith(".tmp"):
            raise KeyboardInterrupt
        return real(source, target)

    monkeypatch.setattr(os, "replace", interrupted_at_the_weights)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"w": torch.zeros(2)}, METADATA, {"plan.json": "plan 2"})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert torch.equal(read_checkpoint(tmp_path)[0]["w"], torch.ones(2))


def test_a_file_saved_beside_the_weights_that_is_gone_or_edited_is_named(tmp_path):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, METADATA, {"plan.json": "plan", "report.md": "report"})
    read_checkpoint(tmp_path)
    (tmp_path / "report.md").write_text("edited")
    with pytest.raises(LowconvError, match=r"report.md is not the file saved with model.safetensors"):
        read_checkpoint(tmp_path)
    (tmp_path / "report.md").unlink()
    with pytest.raises(LowconvError, match=r"report.md was saved with model.safetensors and is missing"):
        read_checkpoint(tmp_path)
