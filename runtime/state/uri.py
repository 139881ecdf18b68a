"""A URI (a path, file:// or s3://) to its store: the one factory of stores, above both kinds
(runtime/state/store.py, the interface and local disk; runtime/state/s3.py), and the
whole-file helpers that every job's outputs use."""

from __future__ import annotations

import os
import tempfile

from runtime.base.errors import SpillpackError
from runtime.state.store import LocalStore, Store, local_file


def open_store(uri: str) -> Store:
    """A path, file:// URI or s3:// URI, the same everywhere a URI is taken."""
    path = local_file(uri)
    if path is None:
        from runtime.state.s3 import S3Store  # boto3 is imported only for an s3:// URI

        return S3Store(uri)
    return LocalStore(path.absolute(), uri)


def write_uri(uri: str, data: bytes) -> None:
    """A whole file at a path, file:// or s3:// URI, written atomically."""
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    open_store(parent or ".").write(name, data)


def uri_exists(uri: str) -> bool:
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    return open_store(parent or ".").size(name) is not None


def check_output(uri: str, directory: bool, flag: str = "--out") -> None:
    """Raise one line unless an output (a directory of files, or one file) can be written at
    `uri`: checked before a job's first step, so no work is done for an output that would fail.
    Creates nothing: a bad value leaves no trace."""
    path = local_file(uri)
    if path is None:
        parent = uri.rstrip("/") if directory else uri.rstrip("/").rpartition("/")[0]
        open_store(parent).check_writable()
        return
    path = path.absolute()
    kind = "directory" if directory else "file"
    if directory and path.exists() and not path.is_dir():
        raise SpillpackError(f"{flag} {uri} is an existing file, not a directory", f"{flag} a new directory, or rm {uri}")
    if not directory and path.is_dir():
        raise SpillpackError(f"{flag} {uri} is a directory, not a file", f"{flag} {path / 'results.jsonl'}")
    base = path if directory and path.is_dir() else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise SpillpackError(f"{flag} {uri} cannot be created: {base} is a file", f"{flag} a {kind} under a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".spillpack-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SpillpackError(f"{flag} {uri} cannot be written: creating a file in {base} fails ({e.strerror})", f"{flag} a {kind} on a disk you can write")
