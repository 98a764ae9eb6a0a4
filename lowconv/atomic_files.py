"""Files replaced in a directory as one step: each written to a temporary file beside it and
flushed, then all renamed over their paths, the old files put back if a rename fails; and a lock
on the directory so that two writers take turns."""
from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from lowconv.errors import LowconvError



def replace_atomically(writes: dict[Path, Callable[[Path], None]]) -> None:
    """Write each file to a temporary file beside it and flush it to disk; once every one is
    complete, rename them over their paths, the old files moved aside first and put back if a
    rename fails. A failure (a full disk, a file that cannot be replaced) leaves every path as it
    was, with a LowconvError naming the file; a crash during the renames can leave hidden
    `.NAME.*.old` files beside them (the next checkpoint save removes them: checkpoint._stale_files)."""
    for path in writes:
        if path.is_dir():
            raise LowconvError(f"cannot write {path}: it is a directory; nothing in {path.parent} was changed")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LowconvError(f"cannot create the directory {path.parent}: {reason(err)}") from None
    left = "nothing in {} was changed" if len(writes) > 1 else "the file was left as it was"
    token = secrets.token_hex(4)
    temporaries: dict[Path, Path] = {}
    moved_aside: list[tuple[Path, Path | None]] = []  # (path, its old file's new name or None)
    try:
        for path, write in writes.items():
            temporaries[path] = path.with_name(f".{path.name}.{token}.tmp")
            try:
                mode = file_mode(path, temporaries[path])
                write(temporaries[path])
                with open(temporaries[path], "rb+") as f:
                    os.fsync(f.fileno())
                os.chmod(temporaries[path], mode)
            except (OSError, SafetensorError) as err:
                raise LowconvError(f"cannot write {path}: {reason(err)}; {left.format(path.parent)}") from None
        for path, temporary in temporaries.items():
            try:
                old = path.with_name(f".{path.name}.{token}.old") if path.exists() else None
                if old is not None:
                    os.replace(path, old)
                moved_aside.append((path, old))
                os.replace(temporary, path)
            except BaseException as err:  # an OSError, or Ctrl-C: every path goes back to its old file
                for done, old in reversed(moved_aside):
                    if old is not None:
                        os.replace(old, done)
                    else:
                        done.unlink(missing_ok=True)
                moved_aside.clear()
                if not isinstance(err, OSError):
                    raise
                raise LowconvError(f"cannot replace {path}: {reason(err)}; {left.format(path.parent)}") from None
    finally:  # best effort: on a read-only disk the clean-up fails too, and must not hide why
        for leftover in [*temporaries.values(), *(old for _, old in moved_aside if old is not None)]:
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
    if os.name == "posix":  # the renames survive a crash only once the directories are synced
        for parent in {path.parent for path in writes}:
            directory = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)



@contextmanager
def locked(directory: Path):
    """An exclusive lock on the directory itself for the duration (flock on POSIX; elsewhere none):
    a second save into it waits."""
    if directory.exists() and not directory.is_dir():
        raise LowconvError(f"{directory} is a file, not a directory: give the directory to save into")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LowconvError(f"cannot create the directory {directory}: {reason(err)}") from None
    if os.name != "posix":
        yield
        return
    import fcntl
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # the lock goes with it



def file_mode(path: Path, temporary: Path) -> int:
    """The permissions `path` keeps: its own, or for a new file what the umask gives any file the
    user writes, read from `temporary` created as such a file (whatever mode a writer gives its
    file; reading the umask itself means setting it, for every thread)."""
    if path.exists():
        return path.stat().st_mode & 0o777
    descriptor = os.open(temporary, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o666)
    try:
        return os.fstat(descriptor).st_mode & 0o777
    finally:
        os.close(descriptor)



def reason(err: Exception) -> str:
    """An OSError's reason without its errno and temporary file name; other errors as they say."""
    return err.strerror if isinstance(err, OSError) and err.strerror else str(err)
