"""Where job state lives: one small interface over a local directory (and later S3).

Every write is whole-or-nothing: an object either has all its bytes or does not
exist. `create` succeeds for exactly one writer when several race for the same key;
the commit protocol in state.py is built on that one primitive.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

from runtime.base.errors import SpillpackError
from runtime.base.fileio import atomic_copy, atomic_write, temp_beside, unlink


class Store:
    """The interface. Keys are '/'-separated paths relative to the store's root."""

    uri: str

    def read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def read_stream(self, key: str, consume):
        """consume(chunks), over the object's bytes as they arrive, and what it returns; None when
        there is no such object. `consume` may raise to stop early (the rest is never fetched) and
        must start afresh when called again: a store may restart a broken read from the start."""
        data = self.read(key)
        return None if data is None else consume(iter((data,)))

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def create(self, key: str, data: bytes) -> bool:
        """Write only if the key does not exist yet; False when another writer got there first."""
        raise NotImplementedError

    # Whether a small write costs next to nothing (a local file, no fsync): hints such as a
    # job's progress are then written after every quantum, else at most once a second.
    cheap_hints = False

    def write_hint(self, key: str, data: bytes) -> None:
        """A small record that a killed process leaves whole or not at all; not a commit."""
        self.write(key, data)

    def list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def list_meta(self, prefix: str = "") -> list[tuple[str, int, str]]:
        """(key, size, version tag) of every object under `prefix`: the tag changes when the
        object's bytes do (an S3 ETag; size and mtime for a local file)."""
        raise NotImplementedError

    def check_writable(self) -> None:
        """Raise one line if this process cannot write here (before any work is done)."""
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def put_file(self, key: str, path: Path) -> None:
        self.write(key, Path(path).read_bytes())

    def get_file(self, key: str, path: Path) -> bool:
        data = self.read(key)
        if data is None:
            return False
        atomic_write(Path(path), data)
        return True

    def child_uri(self, key: str) -> str:
        return self.uri.rstrip("/") + "/" + key

    def local_dir(self) -> Path | None:
        """The directory behind this store when it is on this machine's filesystem."""
        return None


class LocalStore(Store):
    def __init__(self, root: Path, uri: str | None = None):
        self.root = Path(root)
        self.uri = uri or str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def local_dir(self) -> Path:
        return self.root

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{socket.gethostname()}-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise SpillpackError(f"state {self.uri} is not writable: {e.strerror}", "--state with a directory you can write, or an s3:// URI")

    def read(self, key):
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def write(self, key, data):
        atomic_write(self._path(key), data)

    cheap_hints = True

    def write_hint(self, key, data):
        atomic_write(self._path(key), data, durable=False)

    def create(self, key, data):
        # Write a private temp file, then hard-link it into place: link() fails if the
        # name exists, so exactly one racing writer wins and the winner's file is complete.
        path = self._path(key)
        tmp = temp_beside(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            unlink(tmp)

    def list(self, prefix):
        base = self._path(prefix)
        if not base.is_dir():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.startswith(".") and f.endswith(".tmp"):
                    continue  # someone's write in flight, or a torn one: not an object
                out.append(str(Path(dirpath, f).relative_to(self.root)).replace(os.sep, "/"))
        return sorted(out)

    def list_meta(self, prefix=""):
        out = []
        for key in self.list(prefix):
            st = self._path(key).stat()
            out.append((key, st.st_size, f"{st.st_size}-{st.st_mtime_ns}"))
        return out

    def size(self, key):
        try:
            return self._path(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete(self, key):
        p = self._path(key)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            unlink(p)
        # Folders left empty go too (a pruned checkpoint's), but never a top-level one such as
        # checkpoints/: another writer may be about to write into it.
        for parent in list(p.parents)[: max(0, len(Path(key).parts) - 2)]:
            try:
                parent.rmdir()
            except OSError:
                break

    def put_file(self, key, path):
        atomic_copy(path, self._path(key))

    def get_file(self, key, path):
        src = self._path(key)
        if not src.is_file():
            return False
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)
        return True


def local_file(uri: str) -> Path | None:
    """The path a local path or file:// URI names; None for s3://. The one place that parses
    URI schemes: everything that takes a URI comes through here or open_store."""
    if "://" not in uri:  # a path, even with a colon in it (tags such as qwen2.5:0.5b are not URIs)
        return Path(uri).expanduser()
    scheme = uri.split("://", 1)[0]
    if scheme == "s3":
        return None
    if scheme == "file":
        return Path(urlparse(uri).path).expanduser()
    raise SpillpackError(f"unsupported URI scheme {scheme}:// in {uri}", "a local path, file:///path or s3://bucket/prefix")
