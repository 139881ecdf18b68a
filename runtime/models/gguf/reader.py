"""The GGUF container: header, metadata and tensor directory, read without trusting a count.

Layout (little-endian): magic "GGUF", uint32 version (2 or 3), uint64 tensor count, uint64
metadata count; the metadata as (string key, uint32 type, value); each tensor as (string name,
uint32 n_dims, uint64 dims, uint32 ggml type, uint64 offset); then, at the alignment
(general.alignment, default 32), the tensor data. Every length, count and extent is checked
against the bytes the file has left before anything of that size is allocated or read, so a
truncated or lying header is one line, never a huge allocation.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.base.errors import SpillpackError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: llama.cpp's files use none; a deeper one is a file built to recurse

# Metadata value types: struct format of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFError(SpillpackError):
    """A file that is not a GGUF spillpack can read; the message names the file and what is wrong."""

    def __init__(self, path, what: str):
        super().__init__(f"{path} is not a readable GGUF file ({what})", f"re-download {Path(path).name}, or check it with gguf-dump")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] varies fastest
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's (row-major) shape: the dims reversed."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    data_start: int
    header_sha256: str = field(default="")

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def read_raw(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes as uint8 in numpy's shape of (rows..., bytes per row), read into a
        buffer of the tensor's own size (its extent was checked when the header was read)."""
        buf = np.empty(info.nbytes, dtype=np.uint8)
        view = memoryview(buf)
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(self.data_start + info.offset)
            got = 0
            while got < info.nbytes:
                n = fh.readinto(view[got:])
                if not n:
                    raise GGUFError(self.path, f"it ends inside tensor {info.name} (truncated)")
                got += n
        rows = info.shape[:-1]
        return buf.reshape(*rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))


class _Cursor:
    """Sequential reads of a file whose every read is checked against the file's size first."""

    def __init__(self, path: Path, fh, size: int):
        self.path, self.fh, self.size, self.pos = path, fh, size, 0
        self.hash = hashlib.sha256()

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise GGUFError(self.path, f"{what} needs {n} bytes but the file has {self.left()} left (truncated, or a header claiming more than the file holds)")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError(self.path, f"it ends inside {what} (truncated)")
        self.pos += n
        self.hash.update(data)
        return data

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.read(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(self.path, f"{what} is not UTF-8")

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if item in _NUMPY:
                width = np.dtype(_NUMPY[item]).itemsize
                self.need(count * width, f"{what} ({count} items)")
                return np.frombuffer(self.read(count * width, what), dtype=_NUMPY[item]).tolist()
            if item == STRING:
                self.need(count * 8, f"{what} ({count} strings)")  # each string has at least its 8-byte length
                return [self.string(what) for _ in range(count)]
            if item == ARRAY:
                if depth + 1 >= MAX_NESTING:
                    raise GGUFError(self.path, f"{what} nests arrays more than {MAX_NESTING} deep")
                self.need(count * 12, f"{what} ({count} arrays)")
                return [self.value(ARRAY, what, depth + 1) for _ in range(count)]
            raise GGUFError(self.path, f"{what} is an array of unknown type {item}")
        raise GGUFError(self.path, f"{what} has unknown value type {kind}")


def tensor_nbytes(path, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    from runtime.models.gguf.tensors import type_name, type_sizes

    block, size = type_sizes(path, name, ggml_type)
    if dims and dims[0] % block:
        raise GGUFError(path, f"tensor {name}'s first dimension {dims[0]} is not a multiple of {type_name(ggml_type)}'s block of {block}")
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def read_gguf(path) -> GGUFFile:
    """The header of a GGUF file, every claim checked against its size; no tensor data is read."""
    path = Path(path)
    try:
        size = os.stat(path).st_size
        fh = open(path, "rb")
    except OSError as e:
        raise SpillpackError(f"cannot read {path} ({e.strerror or e})", f"ls -l {path}")
    with fh:
        c = _Cursor(path, fh, size)
        if size < 4 or c.read(4, "the magic") != MAGIC:
            raise GGUFError(path, "wrong magic: it does not start with GGUF")
        version = c.scalar("<I", "the version")
        if version not in VERSIONS:
            raise GGUFError(path, f"unknown GGUF version {version} (spillpack reads versions 2 and 3, little-endian)")
        n_tensors = c.scalar("<Q", "the tensor count")
        n_kv = c.scalar("<Q", "the metadata count")
        # The smallest entry of each kind: a metadata item has an 8-byte key length, a 4-byte type
        # and at least one byte of value; a tensor an 8-byte name length, n_dims, a type and an offset.
        c.need(n_kv * 13, f"the header's {n_kv} metadata entries")
        metadata = {}
        for i in range(n_kv):
            key = c.string(f"metadata key {i}")
            kind = c.scalar("<I", f"the type of {key}")
            metadata[key] = c.value(kind, key)
        c.need(n_tensors * 24, f"the header's {n_tensors} tensor entries")
        infos: list[tuple] = []
        for i in range(n_tensors):
            name = c.string(f"tensor name {i}")
            n_dims = c.scalar("<I", f"tensor {name}'s dimension count")
            if n_dims > MAX_DIMS:
                raise GGUFError(path, f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = tuple(c.scalar("<Q", f"tensor {name}'s dimensions") for _ in range(n_dims))
            ggml_type = c.scalar("<I", f"tensor {name}'s type")
            offset = c.scalar("<Q", f"tensor {name}'s offset")
            infos.append((name, dims, ggml_type, offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise GGUFError(path, f"general.alignment {alignment!r} is not a positive multiple of 8")
        data_start = -(-c.pos // alignment) * alignment
        tensors = {}
        for name, dims, ggml_type, offset in infos:
            nbytes = tensor_nbytes(path, name, dims, ggml_type)
            if data_start + offset + nbytes > size:
                raise GGUFError(path, f"tensor {name} claims bytes {offset}..{offset + nbytes} of the data, past the end of the file (truncated?)")
            if name in tensors:
                raise GGUFError(path, f"tensor {name} is listed twice")
            tensors[name] = TensorInfo(name, dims, ggml_type, offset, nbytes)
        c.hash.update(f"\0{size}".encode())
        return GGUFFile(path, version, metadata, tensors, data_start, c.hash.hexdigest())
