"""The file primitives every part of spillpack shares: atomic writes, SHA-256, an exclusive lock.

Standard library only, so the bundle's bootstrap (which runs before sys.path is complete)
and the packer use the same functions as the runtime. A write is whole or absent: the
bytes go to a synced temporary file beside the target, which is then renamed over it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

CHUNK = 1 << 20


def temp_beside(path: Path, data: bytes | None = None, source: Path | None = None, durable: bool = True) -> str:
    """A complete, synced private file next to `path` (same filesystem, so it can be renamed
    or linked into place), holding `data` or a copy of `source`. Its name starts with '.' and
    ends with '.tmp', which the stores' listings skip."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if source is not None:
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, f, CHUNK)
            else:
                f.write(data or b"")
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        unlink(tmp)
        raise
    return tmp


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """`durable=False` for hints that must survive a killed process but not a lost machine:
    whole or absent, without the cost of an fsync."""
    _into_place(temp_beside(path, data, durable=durable), path)


def atomic_copy(source: Path, path: Path) -> None:
    _into_place(temp_beside(path, source=source), path)


def _into_place(tmp: str, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise


def unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock held for the block (flock; between processes on one machine).
    Where flock does not exist the block runs unlocked: every caller re-checks its condition
    after taking the lock and writes atomically, so a lost lock costs work, not correctness."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
