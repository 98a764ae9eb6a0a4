"""Converted checkpoints: safetensors files in an output directory, written atomically.

`out/model.safetensors` holds the converted state dict; its metadata (all strings) holds the
lowconv version, the plan (with the recipe's text) and a signature of the original model. The
same tensors and metadata give the same bytes (write_safetensors). Tied
tensors are stored once and restored as the same tensor on read. Above MAX_SHARD_BYTES the state
dict goes into shards as Hugging Face names them (`model-00001-of-00003.safetensors`, each with the
same metadata) and `model.safetensors.index.json` maps each tensor to its shard.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from lowconv.atomic_files import locked, reason, replace_atomically
from lowconv.errors import LowconvError
from lowconv.version import __version__

CHECKPOINT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model-*-of-*.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"

VERSION_KEY = "lowconv.version"
PLAN_KEY = "lowconv.plan"  # the plan as JSON
MODEL_KEY = "lowconv.model"  # model_signature() of the original model
ALIASES_KEY = "lowconv.aliases"  # JSON {alias: stored name}; internal to this file
REQUIRED_KEYS = (VERSION_KEY, PLAN_KEY, MODEL_KEY)
FORMAT_KEY = "format"  # safetensors' own convention
TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.(tmp|old)")  # what replace_atomically writes beside a file
FILES_KEY = "lowconv.files"  # JSON {file written beside the weights: SHA-256 of its bytes}; internal to this file
CHECKSUMS_KEY = "lowconv.checksums"  # JSON {stored tensor: CRC-32 of its bytes}; internal to this file

MAX_LISTED = 10  # per kind of mismatch in check_tensors' message


def save_checkpoint(directory: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                    files: dict[str, str | bytes] | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write `directory/model.safetensors` (or its shards and index, above max_shard_bytes) and any
    `files` ({file name: text or bytes}) beside it, all or none: an existing checkpoint is replaced
    only by a complete one, and never next to reports of another run; then the files of the other
    layout (a single file where shards were written, stale shards) are removed. Returns the path of
    the file or the index."""
    stored, aliases = _store_shared_once(tensors)
    stored = {name: t.cpu() for name, t in stored.items()}  # once: checksummed, then written
    files = encoded(files)
    metadata = full_metadata(metadata, aliases, files, {name: _checksum(t) for name, t in stored.items()})
    directory = Path(directory)
    shards = shard_files(stored, max_shard_bytes)
    writes = {directory / name: _tensor_writer(shard, metadata) for name, shard in shards.items()}
    return install(directory, writes, files, shards)


def encoded(files: dict[str, str | bytes] | None) -> dict[str, bytes]:
    """The files written beside the weights ({file name: text or bytes}) as bytes."""
    return {name: content.encode() if isinstance(content, str) else content for name, content in (files or {}).items()}


def full_metadata(metadata: dict[str, str], aliases: dict[str, str], files: dict[str, bytes],
                  checksums: dict[str, str]) -> dict[str, str]:
    """Every shard's metadata: the caller's (REQUIRED_KEYS) and what this file keeps (aliases,
    format, the files beside the weights with their hashes, each stored tensor's checksum)."""
    missing = [key for key in REQUIRED_KEYS if key not in metadata]
    if missing:
        raise ValueError(f"checkpoint metadata lacks {missing}")
    not_text = [key for key, value in metadata.items() if not isinstance(value, str)]
    if not_text:
        raise ValueError(f"checkpoint metadata values must be strings: {not_text}")
    metadata = {key: value for key, value in metadata.items() if key != ALIASES_KEY}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    metadata[FORMAT_KEY] = "pt"  # torch tensors, for other readers: transformers 4.x refuses a file without it
    metadata[FILES_KEY] = json.dumps({name: hashlib.sha256(content).hexdigest() for name, content in files.items()},
                                     sort_keys=True)
    metadata[CHECKSUMS_KEY] = json.dumps(checksums, sort_keys=True)
    return metadata


def shard_files(stored: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: its tensors}: model.safetensors alone, or Hugging Face's numbered shards of at
    most max_shard_bytes each (the tensors' sizes are all it reads: meta tensors do)."""
    shards = _shards(stored, max_shard_bytes)
    if len(shards) == 1:
        return {CHECKPOINT_FILE: shards[0]}
    return {f"model-{i:05d}-of-{len(shards):05d}.safetensors": shard for i, shard in enumerate(shards, 1)}


def install(directory: Path, writes: dict[Path, Callable[[Path], None]], files: dict[str, bytes],
            shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Put the weights' files (`writes`, one per shard file) in `directory`, with the files beside
    them and the index where there are shards, all or none, and remove the previous checkpoint's
    other files. Returns the path of the file or the index."""
    # The files beside the weights go in first, the weights (their index) last: a save stopped
    # between renames leaves the old weights, whose list of files and hashes then tells the new
    # files from theirs (read_checkpoint refuses the mix).
    writes = {**{directory / name: _file_writer(content) for name, content in files.items()}, **writes}
    if len(shards) == 1:
        path = directory / CHECKPOINT_FILE
    else:
        index = {"metadata": {"total_size": sum(nbytes(t) for shard in shards.values() for t in shard.values())},
                 "weight_map": {tensor: name for name, shard in shards.items() for tensor in shard}}
        path = directory / INDEX_FILE
        writes[path] = _file_writer(json.dumps(index, indent=2) + "\n")
    with locked(directory):  # one save at a time into a directory: no report of another run beside the weights
        stale = _stale_files(directory, writes)
        replace_atomically(writes)
        _remove_stale(stale, path)
    return path


def _stale_files(directory: Path, writes: dict) -> list[Path]:
    """The previous checkpoint's files that this one does not write (its other layout, what it
    wrote beside the weights: another model's tokenizer files), and the temporaries that an
    interrupted save left (hidden `.NAME.<token>.tmp` / `.old`: under the lock, no save is running)."""
    old = [p for p in [directory / CHECKPOINT_FILE, directory / INDEX_FILE, *directory.glob(SHARD_PATTERN),
                       *(directory / name for name in _files_written_by(directory))]
           if p.is_file() and p not in writes]
    return old + [p for p in directory.glob(".*") if TEMPORARY.fullmatch(p.name) and p.is_file()]


def _remove_stale(stale: list[Path], path: Path) -> None:
    for old in stale:
        try:
            old.unlink()
        except OSError as err:
            raise LowconvError(f"wrote {path}, but cannot remove {old} of the previous checkpoint: {reason(err)}; "
                               f"remove it, or loaders may read it instead") from None


def _files_written_by(directory: Path) -> list[str]:
    """The names a previous lowconv checkpoint in `directory` wrote beside its weights ([] when
    there is none, or it cannot be read)."""
    path = checkpoint_path(directory)
    if path.name == INDEX_FILE:
        path = next(iter(sorted(directory.glob(SHARD_PATTERN))), path)
    try:
        with safe_open(path, framework="pt") as f:
            names = json.loads((f.metadata() or {}).get(FILES_KEY, "{}"))
    except (SafetensorError, OSError, ValueError):
        return []
    return [name for name in names if _plain_name(name)]


def _plain_name(name) -> bool:
    """A file name a checkpoint may list beside its weights: in the directory itself, not hidden."""
    return isinstance(name, str) and "/" not in name and "\\" not in name and not name.startswith(".") and name != ""


def _check_files(text: str | None, path: Path) -> None:
    """The files beside the weights are those saved with them (FILES_KEY): a save stopped between
    its renames, or an edit since, is named."""
    try:
        listed = json.loads(text) if text is not None else {}
    except ValueError:
        listed = None
    if not isinstance(listed, (dict, list)):
        raise LowconvError(f"{path}: its list of the files saved beside it is not valid")
    if isinstance(listed, list):  # written before the files had hashes: nothing to check
        return
    for name, digest in sorted(listed.items()):
        if not _plain_name(name) or not isinstance(digest, str):
            raise LowconvError(f"{path}: its list of the files saved beside it is not valid ({str(name)[:40]!r})")
        beside = path.parent / name
        if not beside.is_file():
            raise LowconvError(f"{beside} was saved with {path.name} and is missing: a save was interrupted, or it was "
                               f"removed since; convert again")
        if hashlib.sha256(beside.read_bytes()).hexdigest() != digest:
            raise LowconvError(f"{beside} is not the file saved with {path.name} (a save was interrupted, or it was "
                               f"changed since): convert again, or restore it")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into shards of at most max_bytes (a larger tensor alone in one)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + nbytes(tensor) > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes(tensor)
    return shards


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tensor_writer(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[Path], None]:
    return lambda tmp: write_safetensors(tmp, tensors, metadata)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format (an 8-byte little-endian header size, the JSON header padded to 8
    bytes, the tensors' bytes in header order), with every key sorted: the same tensors and
    metadata give the same bytes. (safetensors' own writer orders the metadata differently in
    each process.) Tensors go widest dtype first, as safetensors places them, so each is aligned."""
    header, names = safetensors_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
        for name in names:
            f.write(bytes_of(tensors[name]))


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """write_safetensors' file up to the tensors' bytes (the size, the header), and the names in
    the order their bytes follow. It reads only names, dtypes and shapes: meta tensors do."""
    unknown = sorted({str(t.dtype) for t in tensors.values() if t.dtype not in SAFETENSORS_DTYPES})
    if unknown:
        raise ValueError(f"safetensors has no dtype for {unknown}")
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header, offset = {}, 0
    for name in names:
        size = nbytes(tensors[name])
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def _file_writer(content: str | bytes) -> Callable[[Path], None]:
    if isinstance(content, bytes):
        return lambda tmp: tmp.write_bytes(content)
    return lambda tmp: tmp.write_text(content, encoding="utf-8")


def checkpoint_path(directory: str | Path) -> Path:
    """directory/model.safetensors (its index where the checkpoint is sharded), or the file itself
    when a user points at it (an output directory may itself be named *.safetensors)."""
    directory = Path(directory)
    if directory.suffix == ".safetensors" and not directory.is_dir():
        return directory
    single = directory / CHECKPOINT_FILE
    return directory / INDEX_FILE if not single.is_file() and (directory / INDEX_FILE).is_file() else single


def read_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (aliases restored) and the metadata of a lowconv output directory."""
    path = checkpoint_path(directory)
    if path == Path(directory) and not path.is_file():
        raise LowconvError(f"{path} does not exist")
    if not path.is_file():
        aside = sorted(path.parent.glob(f".{path.name}.*.old"))
        if aside:  # a save stopped between moving the old file aside and renaming the new one in
            raise LowconvError(f"no {path.name} in {path.parent}/: a save was interrupted; the previous checkpoint "
                               f"is {aside[0]} (rename it back), or convert again")
        raise LowconvError(f"no {path.name} in {path.parent}/: is this a lowconv output directory?")
    tensors, metadata = _read_shards(path) if path.name == INDEX_FILE else _read_file(path)
    if VERSION_KEY not in metadata:
        raise LowconvError(f"{path} is not a lowconv checkpoint: its metadata has no {VERSION_KEY!r}")
    missing = [key for key in REQUIRED_KEYS if key not in metadata]
    if missing:
        raise LowconvError(f"{path} is not a complete lowconv checkpoint: its metadata lacks {missing}")
    written_by = _version(metadata[VERSION_KEY])
    if written_by is None or written_by > _version(__version__):
        raise LowconvError(f"{path} was written by lowconv {metadata[VERSION_KEY]!r}, which this lowconv "
                           f"{__version__} does not know: read it with that version or a later one")
    metadata.pop(FORMAT_KEY, None)
    _check_files(metadata.pop(FILES_KEY, None), path)
    _check_sums(metadata.pop(CHECKSUMS_KEY, None), tensors, path)
    aliases = _parse_aliases(metadata.pop(ALIASES_KEY, "{}"), tensors, path)
    for alias, stored_name in aliases.items():
        tensors[alias] = tensors[stored_name]
    return tensors, metadata


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(path, framework="pt") as f:
            return f.get_tensors(), dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise LowconvError(
            f"{path} cannot be read ({e}): the file is truncated or corrupt; run lowconv convert again to rewrite it"
        ) from e


def _read_shards(index_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every shard the index names, merged; the metadata of the first (each shard holds the same)."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        shards = list(dict.fromkeys(weight_map.values()))
        if not shards or not all(isinstance(name, str) and "/" not in name for name in shards):
            raise ValueError("no shard files named")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LowconvError(f"{index_path} is not a safetensors index ({reason(err) if isinstance(err, OSError) else err}); "
                           f"run lowconv convert again to rewrite it") from None
    tensors, metadata = {}, None
    for name in shards:
        if not (index_path.parent / name).is_file():
            raise LowconvError(f"{index_path} names {name}, which is not in {index_path.parent}/")
        shard, shard_metadata = _read_file(index_path.parent / name)
        tensors.update(shard)
        metadata = shard_metadata if metadata is None else metadata
    return tensors, metadata


def check_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], path: str | Path) -> None:
    """Raise one LowconvError that lists every way `found` (the checkpoint) differs from `expected` (the model)."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    wrong = [
        f"{name}: expected {_describe(expected[name])} vs found {_describe(found[name])}"
        for name in expected
        if name in found and _describe(expected[name]) != _describe(found[name])
    ]
    if not (missing or unexpected or wrong):
        return
    lines = [f"{path} does not match the converted model (written for another model or recipe?):"]
    lines += _listing("missing from the checkpoint", missing)
    lines += _listing("in the checkpoint but not in the model", unexpected)
    lines += _listing("wrong shape or dtype", wrong)
    raise LowconvError("\n".join(lines))


def model_signature(state_dict: dict[str, torch.Tensor]) -> str:
    """A short hash of the original model's tensor names, shapes and dtypes (not values)."""
    entries = sorted(
        f"{name}:{list(value.shape)}:{_dtype_name(value.dtype)}"
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)  # skips modules' `_extra_state` objects
    )
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _store_shared_once(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tied tensors become aliases of the first name; safetensors refuses any other storage sharing."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    name_of_view: dict[tuple, str] = {}
    storages_in_use: set[tuple] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        view = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in name_of_view:
            aliases[name] = name_of_view[view]
            continue
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if storage in storages_in_use or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        name_of_view[view] = name
        storages_in_use.add((tensor.device, tensor.untyped_storage().data_ptr()))
        stored[name] = tensor
    return stored, aliases


def _version(text: str) -> tuple[int, ...] | None:
    """"1.2.3" as (1, 2, 3); None if it is not such a version."""
    parts = text.split(".")
    return tuple(map(int, parts)) if all(part.isdigit() for part in parts) else None


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order, as the file holds them (any dtype, 0-d and empty ones too)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data


def _checksum(tensor: torch.Tensor) -> str:
    return crc_hex(bytes_of(tensor))


def crc_hex(data, crc: int = 0) -> str:
    """The CRC-32 of bytes (continuing `crc`, that of the bytes before them) as the metadata stores
    it: 8 hex digits, always that wide."""
    return f"{zlib.crc32(data, crc):08x}"


def _check_sums(text: str | None, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Each stored tensor holds the bytes it was saved with (a flipped byte, tensors swapped between
    names, one missing). Checkpoints written before checksums have none to check."""
    if text is None:
        return
    try:
        sums = json.loads(text)
        if not isinstance(sums, dict):
            raise ValueError("not an object")
    except ValueError as err:
        raise LowconvError(f"{path}: metadata {CHECKSUMS_KEY!r} is not a JSON object ({err}); the file was changed "
                           f"after lowconv wrote it: run lowconv convert again") from None
    changed = sorted(name for name, t in tensors.items() if sums.get(name) != _checksum(t))
    gone = sorted(set(sums) - set(tensors))
    if changed or gone:
        what = "; ".join(filter(None, [changed and f"{', '.join(changed[:MAX_LISTED])} do not hold the bytes they "
                                                   f"were saved with", gone and f"{', '.join(gone[:MAX_LISTED])} are missing"]))
        raise LowconvError(f"{path}: {what}: the file was changed or corrupted after lowconv wrote it; "
                           f"run lowconv convert again")


def _parse_aliases(text: str, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    try:
        aliases = json.loads(text)
    except json.JSONDecodeError as e:
        raise LowconvError(f"{path}: metadata {ALIASES_KEY!r} is not valid JSON ({e})") from e
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise LowconvError(f"{path}: metadata {ALIASES_KEY!r} is not a JSON object of tensor names")
    dangling = {alias: name for alias, name in aliases.items() if name not in tensors}
    if dangling:
        raise LowconvError(f"{path}: metadata {ALIASES_KEY!r} names tensors the file does not hold: {dangling}")
    stored = sorted(alias for alias in aliases if alias in tensors)
    if stored:  # the alias would overwrite the tensor stored under its name
        raise LowconvError(f"{path}: metadata {ALIASES_KEY!r} makes {', '.join(stored)} aliases, but the file "
                           f"stores tensors under those names: the file was changed after lowconv wrote it")
    return aliases


def _describe(tensor: torch.Tensor) -> str:
    return f"({list(tensor.shape)}, {_dtype_name(tensor.dtype)})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listing(heading: str, items: list[str]) -> list[str]:
    if not items:
        return []
    lines = [f"  {heading} ({len(items)}):"]
    lines += [f"    {item}" for item in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(f"    and {len(items) - MAX_LISTED} more")
    return lines
