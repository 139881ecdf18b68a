"""Weights read from their file on demand: read-only maps of a GGUF or safetensors file.

A streamed load holds no copy of the large weights. Each 2-D tensor is a read-only numpy view
of one `mmap` of its file (PROT_READ, MAP_SHARED), so its bytes live in the kernel's page
cache: under memory pressure (a cgroup limit, the machine) the kernel drops those pages and
faults them back from the file when a product next reads them, as llama.cpp's default mmap
does. What stays resident is small: the norms and biases (1-D, converted to the compute
dtype) and one chunk of rows at a time that an engine dequantizes or converts for a product.

llama.cpp's q/k row permutation (runtime.models.gguf.tensors.unpermute) is not undone by
copying: a mapped q or k weight carries the row order (`order`: row i of the weight is the
stored row order[i]) that its reader applies as it gathers a chunk of rows, so even those
projections are read from the file.

This module also holds the one choice between resident and streamed (`choice`); what a
streamed load keeps resident and what it maps is weights.stream_bytes, from the headers alone.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.base.errors import env_choice

ENV = "SPILLPACK_WEIGHTS"
MODES = ("resident", "stream")

# The storage dtype of a float tensor's view, by its type name (bfloat16 travels as its 16 bits).
FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass
class MappedFloat:
    """A 2-D float weight as it lies in its file: `raw` a read-only view of the map in its stored
    dtype (FLOAT_VIEWS), `order` the row order to read it in (None: as stored)."""

    kind: str  # F32, F16 or BF16
    shape: tuple[int, int]
    raw: np.ndarray
    order: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


def open_map(path) -> mmap.mmap:
    """A read-only map of the whole file; the views made of it keep it open, and it is unmapped
    when the last of them is gone (the descriptor is closed at once)."""
    with open(path, "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


def view(m: mmap.mmap, offset: int, nbytes: int, dtype, shape: tuple) -> np.ndarray:
    """`nbytes` at `offset` of the map as a read-only array of `dtype` and `shape`; a copy where
    the bytes are not aligned to the dtype (a safetensors file may place a tensor so), which
    the caller's count of resident bytes then misses: such files are rare."""
    raw = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=offset)
    itemsize = np.dtype(dtype).itemsize
    if offset % itemsize:
        return raw.copy().view(dtype).reshape(shape)
    return raw.view(dtype).reshape(shape)


def is_mapped(array) -> bool:
    """A view of a map, as the streamed reads yield them (every array read into memory is writable)."""
    return isinstance(array, np.ndarray) and not array.flags.writeable


def safetensors_views(f: Path, header: dict, start: int):
    """(name, dtype, array) of each tensor of one safetensors file: 2-D and larger as read-only
    views of its map, the rest (norms, biases) copied."""
    m = open_map(f)
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        lo, hi = info["data_offsets"]
        dtype = {**FLOAT_VIEWS, "F64": np.float64}.get(info["dtype"])
        shape = tuple(info["shape"])
        if dtype is None:
            from runtime.base.errors import SpillpackError

            raise SpillpackError(f"{f}: tensor {name} has dtype {info['dtype']}, which spillpack does not read",
                                 "a checkpoint in float32, float16 or bfloat16")
        array = view(m, start + lo, hi - lo, dtype, shape)
        yield name, info["dtype"], (array if len(shape) >= 2 and info["dtype"] != "F64" else array.copy())


# ---- the choice


def forced() -> str | None:
    """SPILLPACK_WEIGHTS: resident, stream, or None (any other value is the one refusal)."""
    return env_choice(ENV, MODES)


def choice(resident_peak_gb: float, available_gb: float, source: str, can_stream: bool, engine: str) -> tuple[bool, str]:
    """(streamed, why) for a job whose plan with every weight resident peaks at `resident_peak_gb`
    and that may use `available_gb` (`source`: where that figure comes from): resident where it
    fits, else streamed from the file, unless SPILLPACK_WEIGHTS says which; `can_stream`: whether
    the engine reads weights from a map (torch-cpu's generation)."""
    mode = forced()
    if not can_stream:
        return False, f"resident: the {engine} engine holds every weight in its own memory" + (
            f" ({ENV}=stream applies to torch-cpu)" if mode == "stream" else "")
    if mode == "stream":
        return True, f"streamed from the file ({ENV}=stream)"
    if mode == "resident":
        return False, f"resident ({ENV}=resident)"
    if resident_peak_gb <= available_gb:
        return False, (f"resident: about {resident_peak_gb:.2f} GB at the peak, within the {available_gb:.2f} GB this job "
                       f"may use ({source})")
    return True, (f"streamed from the file: resident, it would take about {resident_peak_gb:.2f} GB at the peak, more than "
                  f"the {available_gb:.2f} GB this job may use ({source})")
