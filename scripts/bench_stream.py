"""Streamed conversion of a checkpoint larger than host memory (issue 28).

Makes a Llama-architecture bf16 checkpoint from a config, one tensor at a time (random weights,
never held whole, never committed), then runs `lowconv convert hf:DIR RECIPE -o OUT --stream` in a
child process and reports its peak RSS against the model's largest decoder layer, and its time
against the disk's own rates, measured in the same run: reading the input once and writing as many
bytes as the output has. The input's pages are dropped from the page cache before the stream and
before the read (posix_fadvise), so both read from the disk where the checkpoint fits in memory too.

    python scripts/bench_stream.py --dir /tmp/stream-bench            # 31 GB: 48 layers of Llama-2-13B's shape
    python scripts/bench_stream.py --dir /tmp/stream-bench --layers 2  # a smoke run
    python scripts/bench_stream.py --dir /tmp/stream-bench --device cuda  # each layer computed on the GPU
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import transformers

from lowconv import checkpoint
from lowconv.cli import shard_size

MB = 1e6
CHUNK = 64 << 20  # bytes per read or write when measuring the disk


def llama_config(layers: int) -> transformers.LlamaConfig:
    """Llama-2-13B's layer shape (hidden 5120, intermediate 13824, 40 heads), `layers` of them."""
    return transformers.LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=layers,
                                    num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                                    max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")


def make_checkpoint(directory: Path, config: transformers.LlamaConfig, shard_bytes: int, seed: int) -> None:
    """config.json and sharded safetensors of random bf16 weights (normal, std 0.02; norms ones),
    written tensor by tensor: memory holds one tensor at a time."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    stored = model.state_dict()
    shards = checkpoint.shard_files(stored, shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    start, done, total = time.monotonic(), 0, sum(checkpoint.nbytes(t) for t in stored.values())
    for file, tensors in shards.items():
        header, names = checkpoint.safetensors_header(tensors, {"format": "pt"})
        with open(directory / file, "wb") as f:
            f.write(header)
            for name in names:
                shape = tensors[name].shape
                weight = torch.ones(shape) if name.endswith("norm.weight") else \
                    torch.randn(shape, generator=generator).mul_(0.02)
                f.write(checkpoint.bytes_of(weight.to(torch.bfloat16)))
                done += checkpoint.nbytes(tensors[name])
                del weight
            f.flush()
            os.fsync(f.fileno())
        print(f"  {file}: {done / total:.0%} of {total / 1e9:.1f} GB, {time.monotonic() - start:.0f} s", flush=True)
    index = {"metadata": {"total_size": total},
             "weight_map": {name: file for file, tensors in shards.items() for name in tensors}}
    (directory / checkpoint.INDEX_FILE).write_text(json.dumps(index, indent=2))
    config.architectures = ["LlamaForCausalLM"]  # as save_pretrained records it: the class lowconv builds
    config.save_pretrained(directory)  # last: a directory with config.json is a finished one


def largest_layer_bytes(config: transformers.LlamaConfig) -> tuple[int, int]:
    """(the largest decoder layer's bytes, the largest tensor's) in bf16."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    layers = {}
    for name, t in model.state_dict().items():
        layer = re.match(r"model\.layers\.\d+\.", name)
        layers[layer.group(0) if layer else name] = layers.get(layer.group(0) if layer else name, 0) + checkpoint.nbytes(t)
    return max(layers.values()), max(checkpoint.nbytes(t) for t in model.state_dict().values())


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (written and synced: clean pages go)."""
    for path in files:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_rate(files: list[Path]) -> float:
    """Bytes per second reading `files` once, in order, as the stream reads them."""
    buffer, start, read = bytearray(CHUNK), time.monotonic(), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                read += n
    return read / (time.monotonic() - start)


def write_rate(path: Path, nbytes: int) -> float:
    """Bytes per second writing `nbytes` (random, incompressible) and syncing them, as the stream does."""
    block = os.urandom(CHUNK)
    start = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // CHUNK)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = max(1, nbytes // CHUNK) * CHUNK / (time.monotonic() - start)
    path.unlink()
    return rate


def sample_rss(child: subprocess.Popen, start: float, samples: list[tuple[float, int, int]]) -> None:
    """(seconds since start, the child's resident bytes, its high-water mark) every 20 ms while it
    runs: where its peak is, and the peak (the last high-water mark read)."""
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        try:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                      if line.startswith(("VmRSS:", "VmHWM:"))}
            samples.append((time.monotonic() - start, fields["VmRSS"], fields["VmHWM"]))
        except (OSError, KeyError, IndexError, ValueError):
            break
        time.sleep(0.02)


def runtime_rss(device: str) -> int:
    """Peak RSS of a process that imports lowconv's CLI and transformers and runs one matmul on
    `device`: what the libraries and the CUDA runtime take before any conversion."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child forked from this process
    # would report this process's size if that were larger.
    code = ("import re, torch, transformers, lowconv.cli; x = torch.ones(64, 64, device=%r); (x @ x).sum().item(); "
            "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024)" % device)
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="holds model/ (made if absent) and out/")
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48: 31 GB of bf16)")
    p.add_argument("--recipe", default="fp8-row")
    p.add_argument("--shard-size", type=shard_size, default="5GB", help="the input checkpoint's shards")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where each layer is computed")
    args = p.parse_args()
    config = llama_config(args.layers)
    model_dir, out = args.dir / "model", args.dir / "out"
    if not (model_dir / "config.json").is_file():
        print(f"making {model_dir}", flush=True)
        make_checkpoint(model_dir, config, args.shard_size, seed=0)
    inputs = sorted(model_dir.glob("*.safetensors"))
    in_bytes = sum(path.stat().st_size for path in inputs)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    layer, tensor = largest_layer_bytes(config)
    print(f"checkpoint {in_bytes / 1e9:.2f} GB, host memory {ram / 1e9:.1f} GB, largest decoder layer "
          f"{layer / 1e9:.2f} GB, largest tensor {tensor / 1e9:.2f} GB", flush=True)

    command = [sys.executable, "-m", "lowconv.cli", "convert", f"hf:{model_dir}", args.recipe, "-o", str(out),
               "--stream", "--device", args.device]
    evict(inputs)
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, int]] = []
    sampler = threading.Thread(target=sample_rss, args=(child, start, samples), daemon=True)
    sampler.start()
    lines = [f"{time.monotonic() - start:7.1f} s  {line}" for line in child.stderr]  # when each step began
    returncode = child.wait()
    sampler.join()
    seconds = time.monotonic() - start
    log = "".join(lines)
    (args.dir / "stream.log").write_text(log)
    if returncode not in (0, 1):  # 1: converted, and the report's gate failed (random weights, 32+ layers)
        sys.exit(f"{' '.join(command)} failed ({returncode}):\n{log[-3000:]}")
    gate = re.search(r"GATE FAILED: (.*)", log)
    # ru_maxrss is kept across exec, and a child spawned by vfork starts from this process's: an
    # upper bound. The child's own high-water mark, read while it ran, is its peak.
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    peak = max((hwm for _, _, hwm in samples), default=maxrss)
    out_bytes = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    streamed = re.search(r"converted and wrote (\d+) MB in (\S+) \((\d+) MB/s\)", log)

    evict(inputs)
    reading = read_rate(inputs)
    writing = write_rate(args.dir / "write-rate.tmp", out_bytes)
    disk_seconds = in_bytes / reading + out_bytes / writing
    runtime = runtime_rss(args.device)
    when, most, _ = max(samples, key=lambda sample: sample[1], default=(0.0, 0, 0))
    during = next((line.strip() for line in reversed(lines) if float(line.split()[0]) <= when), "")
    result = {
        "command": " ".join(command), "recipe": args.recipe, "layers": args.layers, "device": args.device,
        "checkpoint_GB": round(in_bytes / 1e9, 2), "output_GB": round(out_bytes / 1e9, 2),
        "host_memory_GB": round(ram / 1e9, 1), "largest_layer_GB": round(layer / 1e9, 3),
        "peak_rss_GB": round(peak / 1e9, 3), "ru_maxrss_GB": round(maxrss / 1e9, 3),
        "rss_bound_GB": round((layer + 1.5e9) / 1e9, 3),
        "runtime_rss_GB": round(runtime / 1e9, 3),
        "sampled_peak": f"{most / 1e9:.3f} GB at {when:.1f} s, after: {during}",
        "seconds": round(seconds, 1), "stream_line": streamed.group(0) if streamed else None,
        "gate": f"failed: {gate.group(1)}" if gate else "passed",
        "disk_read_MB_s": round(reading / MB), "disk_write_MB_s": round(writing / MB),
        "disk_bound_seconds": round(disk_seconds, 1), "time_over_disk_bound": round(seconds / disk_seconds, 2),
    }
    print(json.dumps(result, indent=1))
    print(f"peak RSS {peak / 1e9:.2f} GB (bound {(layer + 1.5e9) / 1e9:.2f} GB: "
          f"{'met' if peak <= layer + 1.5e9 else 'not met'}; the libraries and runtime alone {runtime / 1e9:.2f} GB); "
          f"{seconds:.0f} s, "
          f"{seconds / disk_seconds:.2f}x the disk's time for reading the input and writing the output")


if __name__ == "__main__":
    main()
