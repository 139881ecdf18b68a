"""Checkpoint files, framework-neutral: which safetensors make up a model, their headers, and
the strict name-and-shape check every engine applies before loading.

`read_tensors` reads a file one tensor at a time (positioned reads into a buffer of the
tensor's own size, no mapping of the whole file), so an engine that converts each tensor to
its dtype before reading the next holds one copy of the weights, in the target dtype, plus
one tensor: the peak host memory while loading (measured in benchmarks/bench_memory.py).
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from runtime.base.errors import SpillpackError
from runtime.models.gguf import is_gguf_file

INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"^(?:blk|model\.layers|model\.language_model\.layers|language_model\.model\.layers)\.(\d+)\.")
SINGLE = "model.safetensors"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or model.safetensors
    (a GGUF is its own one file)."""
    if is_gguf_file(path):
        return [path]
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise SpillpackError(f"{index} is not a valid safetensors index ({e})", f"re-download the weights into {path}")
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / SINGLE
    if single.exists():
        return [single]
    raise SpillpackError(f"no {SINGLE} or {INDEX} in {path}", f"ls {path}")


# The float types a model's parameters come in, with their widths in bytes. A parameter in any
# other type is not weights spillpack trains or runs (an integer label on float bytes is a lie).
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def read_safetensors_header(f: Path) -> bytes:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON), held to
    the file first: each tensor a float type, its bytes its shape's size, inside the file."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000 or n > size - 8:
                raise ValueError("header length is larger than the file")
            header = fh.read(n)
        entries = json.loads(header)
        if not isinstance(entries, dict):
            raise ValueError("the header is not a JSON object")
        for name, info in entries.items():
            if name != "__metadata__":
                _check_entry(name, info, size - 8 - n)
    except (OSError, struct.error, ValueError) as e:
        raise SpillpackError(f"{f} is not a readable safetensors file ({e})", f"re-download the weights into {f.parent}")
    return header


def _check_entry(name: str, info, data_bytes: int) -> None:
    """One tensor's header entry, against the data section's real size (ValueError: what is wrong)."""
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name} has no dtype, shape and offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in FLOAT_BYTES:
        raise ValueError(f"tensor {name} has dtype {dtype!r}, not a float type a model's weights come in "
                         f"({', '.join(FLOAT_BYTES)})")
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
    if not isinstance(shape, list) or not all(whole(d) for d in shape):
        raise ValueError(f"tensor {name} has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(whole(o) for o in offsets) or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {name} has data offsets {offsets!r}")
    want = math.prod(shape) * FLOAT_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise ValueError(f"tensor {name} claims {offsets[1] - offsets[0]} bytes, but {dtype} of shape {shape} is {want}")
    if offsets[1] > data_bytes:
        raise ValueError(f"tensor {name} ends at byte {offsets[1]} of data, past the file's {data_bytes}")


# safetensors dtype -> numpy dtype of the same width; bfloat16 travels as its raw 16 bits and
# the engine reinterprets them (numpy has no bfloat16).
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def tensor_shapes(files) -> dict[str, tuple]:
    """name -> shape of every tensor in the files, from their headers alone."""
    out = {}
    for f in files:
        if is_gguf_file(f):
            from runtime.models.gguf.model import tensor_shapes as gguf_shapes

            out.update(gguf_shapes(f))
            continue
        out.update({k: tuple(v["shape"]) for k, v in json.loads(read_safetensors_header(f)).items() if k != "__metadata__"})
    return out


def read_tensors(files, rows=None, quantized: bool = False, mapped: bool = False):
    """(name, safetensors dtype, numpy array) for each tensor, one at a time, in file order
    (a GGUF's dequantized to float32, under the Hugging Face names). `rows(name, shape)`: the
    (lo, hi) rows of the first dimension to read, or None for the whole tensor; a safetensors
    file is read for those rows' bytes alone (a rank of a sharded base reads its own part).
    With `quantized`, a GGUF's quantized weights come as (name, type, QuantTensor),
    runtime.models.gguf.tensors (never with `rows`: a sharded base is a tune's, dense).
    With `mapped` (a streamed load, never with `rows`), the 2-D weights are read-only views of
    each file's map instead of reads (runtime.models.mapped)."""
    assert not (mapped and rows is not None), "a streamed load reads whole tensors"
    for f in files:
        if is_gguf_file(f):
            from runtime.models.gguf.model import read_tensors as gguf_tensors

            for name, kind, array in gguf_tensors(f, quantized, mapped):
                part = rows(name, array.shape) if rows is not None and array.ndim else None
                yield name, kind, (array if part is None else array[part[0]:part[1]].copy())
            continue
        raw = read_safetensors_header(f)
        header, start = json.loads(raw), 8 + len(raw)
        if mapped:
            from runtime.models.mapped import safetensors_views

            yield from safetensors_views(f, header, start)
            continue
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
        with open(f, "rb", buffering=0) as fh:
            for name, info in entries:
                kind = _NUMPY.get(info["dtype"])
                if kind is None:
                    raise SpillpackError(f"{f}: tensor {name} has dtype {info['dtype']}, which spillpack does not read",
                                         "a checkpoint in float32, float16 or bfloat16")
                lo, hi = info["data_offsets"]
                shape = tuple(info["shape"])
                array = np.empty(shape, dtype=kind)
                if array.nbytes != hi - lo:
                    raise SpillpackError(f"cannot read {f}: tensor {name} has {hi - lo} bytes for shape {info['shape']}",
                                         f"re-download the weights into {f.parent}")
                part = rows(name, shape) if rows is not None and shape else None
                if part is not None:  # a run of whole rows of a C-ordered tensor: one contiguous range of its bytes
                    row_bytes = array.nbytes // shape[0] if shape[0] else 0
                    array = np.empty((part[1] - part[0], *shape[1:]), dtype=kind)
                    lo += part[0] * row_bytes
                view = memoryview(array.reshape(-1).view(np.uint8))
                fh.seek(start + lo)
                got = 0
                while got < len(view):
                    n = fh.readinto(view[got:])
                    if not n:
                        raise SpillpackError(f"cannot read {f}: it ends inside tensor {name} (truncated)", f"re-download the weights into {f.parent}")
                    got += n
                yield name, info["dtype"], array


def _header_tensors(files) -> list[tuple[str, tuple, int]]:
    """(name, numpy shape, bytes in the file) of every weight of `files`."""
    out = []
    for f in files:
        if is_gguf_file(f):
            from runtime.models.gguf.model import open_gguf
            from runtime.models.gguf.tensors import IGNORED

            out += [(i.name, i.shape, i.nbytes) for i in open_gguf(f).tensors.values() if i.name not in IGNORED]
            continue
        header = json.loads(read_safetensors_header(Path(f)))
        out += [(k, tuple(v["shape"]), v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items()
                if k != "__metadata__"]
    return out


def stream_bytes(files, act_bytes: int) -> tuple[int, int, int]:
    """(resident, mapped, largest layer's mapped) bytes of a streamed load of `files`: the 1-D
    tensors are resident in the compute dtype (`act_bytes` a value), every other one mapped."""
    resident = mapped = 0
    layers: dict[str, int] = {}
    for name, shape, nbytes in _header_tensors(files):
        if len(shape) < 2:
            resident += math.prod(shape) * act_bytes
            continue
        mapped += nbytes
        m = _LAYER.match(name)
        if m:
            layers[m.group(1)] = layers.get(m.group(1), 0) + nbytes
    return resident, mapped, max(layers.values(), default=0)


def check_weights(expected: dict, got: dict, files, model_dir) -> None:
    """Strict loading, shared by every engine: `got` (name -> shape, after sanitize) must have
    exactly the names and shapes of the model (`expected`), or one line says what differs."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    names = ", ".join(f.name for f in files)
    if missing or unexpected:
        detail = "; ".join(
            part
            for part in (
                f"missing {len(missing)} tensor(s) such as {missing[0]}" if missing else "",
                f"{len(unexpected)} unexpected tensor(s) such as {unexpected[0]}" if unexpected else "",
            )
            if part
        )
        raise SpillpackError(
            f"{names} in {model_dir.path} does not match config.json's {model_dir.arch} model: {detail}",
            f"check that config.json and the safetensors in {model_dir.path} come from the same checkpoint",
        )
    for name, shape in expected.items():
        if tuple(got[name]) != tuple(shape):
            raise SpillpackError(
                f"{names} in {model_dir.path}: {name} has shape {tuple(got[name])}, config.json implies {tuple(shape)}",
                f"check that config.json and the safetensors in {model_dir.path} come from the same checkpoint",
            )
