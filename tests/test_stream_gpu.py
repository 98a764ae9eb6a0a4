"""convert --stream on CUDA (run on the lent GPU by scripts/gpu_check.sh): each module's weights on
the GPU while it runs; the files of the in-memory conversion on CUDA, where the recipe forces its
ops (never-slower's choices are timings), and never-slower's choices made as in memory."""
import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from lowconv import stream_writer  # noqa: E402
from lowconv.cli import main  # noqa: E402
from tests.test_stream import STATIC_MLP, same_conversion, sharded  # noqa: E402, F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def convert_both(tmp_path, source, recipe: str) -> tuple[dict, dict]:
    """Convert in memory and streamed on CUDA; both plans."""
    args = [f"hf:{source}", recipe, "--device", "cuda", "--max-shard-size", "100KB"]
    assert main(["convert", *args, "-o", str(tmp_path / "memory")]) == 0
    assert main(["convert", *args, "--stream", "-o", str(tmp_path / "stream")]) == 0
    return tuple(json.loads((tmp_path / d / "plan.json").read_text()) for d in ("memory", "stream"))


def test_streamed_on_cuda_is_the_in_memory_conversion_on_cuda(tmp_path, sharded, monkeypatch):  # noqa: F811
    """(GPU tensors written 1000 bytes at a time: their checksums are checked as the files are read.)"""
    monkeypatch.setattr(stream_writer, "WRITE_CHUNK", 1000)
    recipe = tmp_path / "forced.toml"
    recipe.write_text(STATIC_MLP.replace('op = "fp8"', 'op = "fp8"\nforce = true'))
    convert_both(tmp_path, sharded, str(recipe))
    ours, _ = same_conversion(tmp_path / "memory", tmp_path / "stream")
    assert any(n.endswith("input_scale") for n in ours)


def test_never_slower_times_on_cuda_as_in_memory(tmp_path, sharded):  # noqa: F811
    """Both paths time each site's op against its original at the same shapes, x's quantization
    shared alike, and keep the sites measured slower (which ones is a timing: at this tiny model's
    shapes an FP8 linear and bf16's GEMM take about as long)."""
    memory, stream = convert_both(tmp_path, sharded, "fp8-row")

    def timed(plan):
        found = r"at (\d+ x \d+ x \d+) \(CUDA graph replay(, x's quantization shared by \d+ sites)?, "
        return [(d["site"]["fqn"], re.findall(found, d["reason"] + d["note"])) for d in plan["decisions"]]
    assert timed(stream) == timed(memory)
    assert sum(1 for _, found in timed(stream) if found) == 14  # every linear but lm_head, which fp8-row keeps
    for (_, found), d in zip(timed(stream), stream["decisions"]):
        assert not found or (d["op"] == "fp8") == ("but kept" not in d["reason"])
