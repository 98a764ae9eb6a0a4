"""A safetensors checkpoint read tensor by tensor: its headers, a reader that reads ahead of
use with plain reads, and the names a model's tensors are stored under (tied ones once)."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lowconv import checkpoint
from lowconv.errors import LowconvError

READ_AHEAD = 128 << 20  # bytes of the input read ahead of the tensors in use (256 MB: as fast on an H200, 0.07 GB more RSS)


@dataclass(frozen=True)
class InputCheckpoint:
    """Safetensors weights as their headers describe them; no data read."""
    files: dict[str, Path]  # tensor name -> its file
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype | None]  # None: a dtype torch has no name for here
    spans: dict[str, tuple[int, int]]  # tensor name -> its bytes' (start, end) in its file
    index_dtype: str | None  # the sharded index's metadata "dtype", where it has one

    def load_dtype(self) -> torch.dtype:
        """The dtype from_pretrained(dtype="auto") builds a model whose config names none in: the
        index's, else the first floating tensor's (by name) of the first file, not counting FP8 and
        FP4, else torch's default (transformers' _get_dtype)."""
        if self.index_dtype and hasattr(torch, self.index_dtype):
            return getattr(torch, self.index_dtype)
        first = min(self.files.values(), key=lambda path: path.name, default=None)
        for name in sorted(n for n, path in self.files.items() if path == first):
            dtype = self.dtypes[name]
            if dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
                return dtype
        return torch.get_default_dtype()

    def fingerprint(self) -> str:
        """Changes when an input file does (its size or modification time): a run resumed on
        other weights starts over."""
        stats = sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in set(self.files.values()))
        return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


TORCH_DTYPES = {name: dtype for dtype, name in checkpoint.SAFETENSORS_DTYPES.items()}


def input_checkpoint(path: Path, spec: str) -> InputCheckpoint:
    """The safetensors weights at `path` (a file, or a directory holding one or shards with their
    index), every file's header read."""
    directory = path if path.is_dir() else path.parent
    index = directory / checkpoint.INDEX_FILE
    index_dtype, weight_map, single = None, None, None
    if path.is_file():
        single = path
    elif index.is_file():
        try:
            read = json.loads(index.read_text(encoding="utf-8"))
            weight_map = {name: directory / file for name, file in read["weight_map"].items()}
            index_dtype = (read.get("metadata") or {}).get("dtype")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise LowconvError(f"model {spec!r}: {index} is not a safetensors index ({err})") from None
    elif (directory / checkpoint.CHECKPOINT_FILE).is_file():
        single = directory / checkpoint.CHECKPOINT_FILE
    elif path.is_dir():
        raise LowconvError(f"model {spec!r}: {directory} holds neither {checkpoint.INDEX_FILE} nor "
                           f"{checkpoint.CHECKPOINT_FILE} (safetensors weights)")
    else:
        raise LowconvError(f"model {spec!r}: its weights, {path}, do not exist")
    files, shapes, dtypes, spans = {}, {}, {}, {}
    for path in sorted(set(weight_map.values())) if weight_map else [single]:
        try:
            with safe_open(path, framework="pt") as f:  # checks the header against the file
                for name in f.keys():
                    tensor = f.get_slice(name)
                    files[name], shapes[name] = path, tuple(tensor.get_shape())
                    dtypes[name] = TORCH_DTYPES.get(tensor.get_dtype())
            spans.update(data_spans(path))
        except (SafetensorError, OSError) as err:
            raise LowconvError(f"model {spec!r}: {path} is not a readable safetensors file ({err})") from None
    if weight_map:
        absent = sorted(name for name, path in weight_map.items() if files.get(name) != path)
        if absent:
            raise LowconvError(f"model {spec!r}: {index} maps {', '.join(absent[:5])} to files that do not hold "
                               f"{'it' if len(absent) == 1 else 'them'}")
    return InputCheckpoint(files, shapes, dtypes, spans, index_dtype)


def data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's bytes in a safetensors file (safe_open has checked it): (start, end) offsets."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: (8 + length + entry["data_offsets"][0], 8 + length + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


class CheckpointReader:
    """Reads the input checkpoint's tensors with plain reads into their own memory (a memory map's
    page faults read at about half the disk's rate), ahead of their use: a thread of its own reads
    `order` (the tensors in the order the stream will ask for them) while the model computes, up to
    READ_AHEAD bytes beyond those handed out; a tensor asked for out of that order is read then."""

    def __init__(self, source: InputCheckpoint, order: list[str]):
        self.source, self.order = source, list(dict.fromkeys(order))
        self.ready: dict[str, torch.Tensor] = {}  # read ahead, not yet handed out
        self.held = 0  # their bytes
        self.taken: set[str] = set()  # handed out or asked for: not read ahead
        self.reading: str | None = None  # what the thread is reading now
        self.closing = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self.read_ahead, name="lowconv-read-ahead", daemon=True)

    def __enter__(self) -> CheckpointReader:
        self.opened = {path: os.open(path, os.O_RDONLY) for path in set(self.source.files.values())}
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        self.thread.join()
        for fd in self.opened.values():
            os.close(fd)

    def nbytes(self, name: str) -> int:
        start, end = self.source.spans[name]
        return end - start

    def read(self, name: str) -> torch.Tensor:
        with self.changed:
            self.changed.wait_for(lambda: self.reading != name)
            self.taken.add(name)
            if name in self.ready:
                self.held -= self.nbytes(name)
                self.changed.notify_all()
                return self.ready.pop(name)
        return self.read_now(name)

    def read_ahead(self) -> None:
        for name in self.order:
            with self.changed:
                self.changed.wait_for(lambda: self.closing or not self.ready or
                                      self.held + self.nbytes(name) <= READ_AHEAD)
                if self.closing:
                    return
                if name in self.taken:
                    continue
                self.reading = name
            tensor = None
            try:
                tensor = self.read_now(name)
            except LowconvError:  # the stream reads it again, and says why
                pass
            finally:  # whatever happened, a read waiting for this tensor goes on
                with self.changed:
                    self.reading = None
                    if tensor is not None:
                        self.ready[name] = tensor
                        self.held += self.nbytes(name)
                    self.changed.notify_all()

    def read_now(self, name: str) -> torch.Tensor:
        path, (start, end), dtype = self.source.files[name], self.source.spans[name], self.source.dtypes[name]
        if dtype is None:
            raise LowconvError(f"{path}: {name} has a dtype torch does not have")
        data = torch.empty(end - start, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        try:
            while done < len(view):
                got = os.preadv(self.opened[path], [view[done:]], start + done)
                if got == 0:
                    raise OSError(f"the file ends {end - start - done} bytes short of it")
                done += got
        except OSError as err:
            raise LowconvError(f"{path}: cannot read {name}: {err}") from None
        return data.view(dtype).reshape(self.source.shapes[name])


def check_shapes(model: nn.Module, read: set[str], stored_as: dict[str, str], source: InputCheckpoint,
                 spec: str, built_from: str) -> None:
    """Refuse a checkpoint whose tensors have other shapes than the model gives them (from_pretrained
    refuses it too), before anything is written; `built_from` names the model ("config.json's model")."""
    held = dict(named_tensors(model))
    for name in sorted(read):
        if name in stored_as and source.shapes[stored_as[name]] != tuple(held[name].shape):
            tied_to = f" (tied to {name})" if stored_as[name] != name else ""
            raise LowconvError(f"model {spec!r}: {source.files[stored_as[name]]} holds {stored_as[name]}{tied_to} with "
                               f"shape {list(source.shapes[stored_as[name]])}, but {built_from} has "
                               f"{list(held[name].shape)}: the model and the weights do not match")


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def checkpoint_names(model: nn.Module, loaded: dict[str, str]) -> dict[str, str]:
    """{name of a parameter or buffer: the name the checkpoint holds it under}, from `loaded`
    (loaded_as): its own, or that of a tensor tied to it (a checkpoint stores tied tensors once)."""
    names: dict[int, list[str]] = {}
    for name, t in named_tensors(model):
        names.setdefault(id(t), []).append(name)
    return {name: loaded[held] for group in names.values() for held in [next((n for n in group if n in loaded), None)]
            if held is not None for name in group}


def strict_names(model: nn.Module, source: InputCheckpoint, spec: str, built_from: str) -> dict[str, str]:
    """checkpoint_names of a checkpoint that holds the model's state dict under its own names (tied
    tensors under any one of theirs), refusing one that lacks a tensor of it (a parameter or a
    persistent buffer), holds a tensor the model lacks, or has another shape (as
    load_state_dict(strict=True) does)."""
    stored_as = checkpoint_names(model, {key: key for key in source.files})
    missing = sorted(name for name in model.state_dict(keep_vars=True) if name not in stored_as)
    unused = sorted(set(source.files) - set(stored_as.values()))
    files = sorted(set(source.files.values()))
    where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}" if files else "empty"
    for names, problem in ((missing, f"lacks {len(missing)} tensors of {built_from}"),
                           (unused, f"holds {len(unused)} tensors {built_from} lacks")):
        if names:
            raise LowconvError(f"model {spec!r}: its checkpoint ({where}) {problem}: "
                               f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")
    check_shapes(model, set(stored_as), stored_as, source, spec, built_from)
    return stored_as


def load_weights(model: nn.Module, source: InputCheckpoint, spec: str, built_from: str) -> None:
    """Put `source`'s tensors in `model` (strict_names; put_tensors)."""
    put_tensors(model, source, strict_names(model, source, spec, built_from), parameters=True)


def put_tensors(model: nn.Module, source: InputCheckpoint, stored_as: dict[str, str], parameters: bool) -> None:
    """Put the buffers that `source` holds, and its parameters where `parameters`, in `model`, each
    in the dtype the model built it in; a buffer the checkpoint lacks stays the model's own.
    Parameters are replaced, not copied into, so a model built on the meta device loads too; tied
    ones stay tied."""
    # (the slots, a name in them, its checkpoint key): no reference to the tensors, which go as replaced
    places = [(slots, name, stored_as[f"{fqn}.{name}" if fqn else name])
              for fqn, module in model.named_modules(remove_duplicate=False)
              for slots in ((module._parameters, module._buffers) if parameters else (module._buffers,))
              for name, held in slots.items() if held is not None and (f"{fqn}.{name}" if fqn else name) in stored_as]
    loaded: dict[int, torch.Tensor] = {}  # by the id of the tensor replaced: tied ones stay tied
    with CheckpointReader(source, [key for *_, key in places]) as reader:  # what is put, nothing more read ahead
        for slots, name, key in places:
            held = slots[name]
            if id(held) not in loaded:
                tensor = reader.read(key).to(held.dtype)
                loaded[id(held)] = nn.Parameter(tensor, held.requires_grad) if isinstance(held, nn.Parameter) else tensor
            slots[name] = loaded[id(held)]
