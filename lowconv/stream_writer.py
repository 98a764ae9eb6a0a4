"""The streamed conversion's output (stream.py): every shard's layout known before any data, the
staging shards written tensor by tensor at their offsets from a thread of their own, and a journal
of each tensor written and its checksum, from which an interrupted run resumes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lowconv import checkpoint
from lowconv.errors import LowconvError
from lowconv.plan import Decision
from lowconv.site import Site

IN_FLIGHT = 2  # items the disk thread may hold: their converted tensors are the memory it costs
WRITE_CHUNK = 32 << 20  # bytes of a GPU tensor copied to host memory at a time to be written
JOURNAL = "journal.jsonl"  # in the staging directory: the layout's hash, then one line per tensor written
PLACEHOLDER = "0" * 8  # a checksum not yet known: checkpoint.crc_hex's width


@dataclass(frozen=True)
class Item:
    """One step of the stream: a converted site, or a tensor kept as it is."""
    label: str  # for the progress line
    outputs: list[str]  # the stored tensors it writes
    nbytes: int
    decision: Decision | None = None  # the site's, where it converts one
    site: Site | None = None



@dataclass(frozen=True)
class Layout:
    """Every output file, known before any data: the shards' tensors (meta), the metadata with
    placeholder checksums, the files beside the weights."""
    shards: dict[str, dict[str, torch.Tensor]]
    aliases: dict[str, str]
    metadata: dict[str, str]  # without the checkpoint's own keys (checkpoint.full_metadata adds them)
    files: dict[str, bytes]

    def headers(self, checksums: dict[str, str]) -> dict[str, tuple[bytes, list[str]]]:
        metadata = checkpoint.full_metadata(self.metadata, self.aliases, self.files, checksums)
        return {name: checkpoint.safetensors_header(shard, metadata) for name, shard in self.shards.items()}

    def blank_headers(self) -> dict[str, tuple[bytes, list[str]]]:
        """The headers with every checksum a placeholder: as long as the final ones."""
        return self.headers(dict.fromkeys(self.stored(), PLACEHOLDER))

    def offsets(self) -> dict[str, tuple[str, int]]:
        """stored tensor -> (its shard file, the offset of its bytes)."""
        found = {}
        for file, (header, names) in self.blank_headers().items():
            offset = len(header)
            for name in names:
                found[name] = (file, offset)
                offset += checkpoint.nbytes(self.shards[file][name])
        return found

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: t for shard in self.shards.values() for name, t in shard.items()}

    def fingerprint(self) -> str:
        headers = self.blank_headers()
        return hashlib.sha256(b"".join(name.encode() + header for name, (header, _) in sorted(headers.items())))\
            .hexdigest()



def resume(staging: Path, layout: Layout, inputs: str, progress: Callable[[str], None]) -> tuple[dict[str, str], int]:
    """The checksums of the tensors a previous run wrote in `staging` whose bytes still have them,
    and how many; the staging directory set up for this layout and these inputs (their
    fingerprint), emptied where it was another's."""
    offsets, stored = layout.offsets(), layout.stored()
    first = {"layout": layout.fingerprint(), "inputs": inputs}
    journal = staging / JOURNAL
    lines = journal.read_text(encoding="utf-8").splitlines() if journal.is_file() else []
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:  # a line the interruption cut short
            break
    if not entries or entries[0] != first or not all((staging / file).is_file() for file in layout.shards):
        if entries:
            progress(f"{staging} held {len(entries) - 1} tensors of a run on other inputs, another recipe or "
                     f"other shards: starting over")
        for leftover in staging.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
        for file, (header, names) in layout.blank_headers().items():
            with open(staging / file, "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(checkpoint.nbytes(stored[n]) for n in names))
        journal.write_text(json.dumps(first) + "\n", encoding="utf-8")
        return {}, 0
    sums = {}
    for entry in entries[1:]:
        name, crc = entry.get("tensor"), entry.get("crc")
        if name in offsets:
            file, offset = offsets[name]
            with open(staging / file, "rb") as f:
                f.seek(offset)
                if checkpoint.crc_hex(f.read(checkpoint.nbytes(stored[name]))) == crc:
                    sums[name] = crc
    return sums, len(sums)



class Writer:
    """Writes each item's tensors at their offsets in the staging shards, once (not those a previous
    run wrote): a tensor's checksum goes into `sums`, then the journal, once its bytes are written.
    Nothing is synced per tensor (a sync each held the disk's writes back): a resumed run checks
    every journalled tensor's bytes against its checksum, and installing syncs each file. A shard
    whose last tensor is written is synced then, beside the pass, so that installing has little left
    to sync. The disk work (write, checksum) runs on a thread of its own while the next item is
    computed, IN_FLIGHT items at most. Progress: a line per item, with an ETA."""

    def __init__(self, items: list[Item], layout: Layout, staging: Path, sums: dict[str, str],
                 progress: Callable[[str], None]):
        self.offsets, self.stored, self.staging, self.sums, self.progress = \
            layout.offsets(), layout.stored(), staging, sums, progress
        self.unwritten = {item.label for item in items if not all(name in sums for name in item.outputs)}
        self.total = sum(i.nbytes for i in items if i.label in self.unwritten)
        self.done, self.written, self.start = 0, 0, 0.0
        self.count = len(self.unwritten)
        # shard file -> how many of its tensors are still to write
        self.unsynced = Counter(file for name, (file, _) in self.offsets.items() if name not in sums)
        if len(self.unwritten) < len(items):
            progress(f"resuming: {len(items) - len(self.unwritten)} of {len(items)} steps were written by a previous run")

    def __enter__(self) -> Writer:
        self.journal = open(self.staging / JOURNAL, "a", encoding="utf-8")
        files = {file for file, _ in self.offsets.values()}
        self.shards = {file: os.open(self.staging / file, os.O_WRONLY) for file in files}
        self.disk, self.pending = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowconv-stream"), []
        self.start = time.monotonic()
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is None:
                self.drain(0)  # raises the disk's error, if any
            else:  # the writes under way finish (their tensors are whole); the error in flight is the one told
                wait(self.pending)
        finally:
            self.disk.shutdown()
            self.journal.close()
            for fd in self.shards.values():
                os.close(fd)

    def drain(self, most: int) -> None:
        """Wait until at most `most` items are being written."""
        while len(self.pending) > most:
            self.pending.pop(0).result()

    def wants(self, item: Item) -> bool:
        return item.label in self.unwritten

    def write(self, item: Item, tensors: dict[str, torch.Tensor]) -> None:
        if not self.wants(item):
            return
        elapsed = time.monotonic() - self.start
        eta = f", ETA {format_seconds(elapsed / self.done * (self.total - self.done))}" if self.done else ""
        self.progress(f"[{self.count - len(self.unwritten) + 1}/{self.count}] {item.label} ({item.nbytes / 1e6:.1f} MB){eta}")
        for name in item.outputs:
            tensor, stored = tensors[name], self.stored[name]
            if tensor.dtype != stored.dtype or tuple(tensor.shape) != tuple(stored.shape):
                raise LowconvError(f"{name}: converted as {tensor.dtype} {list(tensor.shape)}, but the converted "
                                   f"structure has {stored.dtype} {list(stored.shape)} (a bug in lowconv)")
        self.drain(IN_FLIGHT - 1)
        self.pending.append(self.disk.submit(self.put, {name: (*self.offsets[name], tensors[name]) for name in item.outputs}))
        self.unwritten.discard(item.label)
        self.done += item.nbytes

    def put(self, tensors: dict[str, tuple[str, int, torch.Tensor]]) -> None:
        """On the disk thread: each tensor's bytes at its offset, then its checksum journalled."""
        for name, (file, offset, tensor) in tensors.items():
            crc = 0
            for data in host_chunks(tensor):
                done = 0
                while done < len(data):
                    done += os.pwrite(self.shards[file], data[done:], offset + done)
                offset, crc = offset + len(data), zlib.crc32(data, crc)
            self.sums[name] = checkpoint.crc_hex(b"", crc)
            self.journal.write(json.dumps({"tensor": name, "crc": self.sums[name]}) + "\n")
            self.journal.flush()
            self.written += 1
            self.unsynced[file] -= 1
            if not self.unsynced[file]:
                os.fsync(self.shards[file])

    def summary(self) -> str:
        elapsed = time.monotonic() - self.start
        return (f"converted and wrote {self.done / 1e6:.0f} MB in {format_seconds(elapsed)} "
                f"({self.done / 1e6 / max(elapsed, 1e-3):.0f} MB/s), the models compared on the way")



def host_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """A tensor's bytes as the file holds them: at once where it is in host memory; from a GPU,
    WRITE_CHUNK bytes at a time (a copy of a whole embedding would add its size to host memory)."""
    if tensor.device.type == "cpu":
        yield checkpoint.bytes_of(tensor)
        return
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), WRITE_CHUNK):
        yield checkpoint.bytes_of(flat[start:start + WRITE_CHUNK])



def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
