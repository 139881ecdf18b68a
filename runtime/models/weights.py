"""Checkpoint files, framework-neutral: which safetensors make up a model, their headers, and
the strict name-and-shape check every engine applies before loading.

`read_tensors` reads a file one tensor at a time (positioned reads into a buffer of the
tensor's own size, no mapping of the whole file), so an engine that converts each tensor to
its dtype before reading the next holds one copy of the weights, in the target dtype, plus
one tensor: the peak host memory while loading (measured in benchmarks/bench_memory.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from runtime.base.errors import SpillpackError
from runtime.models.gguf import is_gguf_file

INDEX = "model.safetensors.index.json"
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


def read_safetensors_header(f: Path) -> bytes:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000 or n > f.stat().st_size - 8:
                raise ValueError("header length is larger than the file")
            header = fh.read(n)
        json.loads(header)
    except (OSError, struct.error, ValueError) as e:
        raise SpillpackError(f"{f} is not a readable safetensors file ({e})", f"re-download the weights into {f.parent}")
    return header


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


def read_tensors(files):
    """(name, safetensors dtype, numpy array) for each tensor, one at a time, in file order
    (a GGUF's dequantized to float32, under the Hugging Face names)."""
    for f in files:
        if is_gguf_file(f):
            from runtime.models.gguf.model import read_tensors as gguf_tensors

            yield from gguf_tensors(f)
            continue
        raw = read_safetensors_header(f)
        header, start = json.loads(raw), 8 + len(raw)
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
        with open(f, "rb", buffering=0) as fh:
            for name, info in entries:
                kind = _NUMPY.get(info["dtype"])
                if kind is None:
                    raise SpillpackError(f"{f}: tensor {name} has dtype {info['dtype']}, which spillpack does not read",
                                         "a checkpoint in float32, float16 or bfloat16")
                lo, hi = info["data_offsets"]
                array = np.empty(tuple(info["shape"]), dtype=kind)
                view = memoryview(array.reshape(-1).view(np.uint8))
                if array.nbytes != hi - lo:
                    raise SpillpackError(f"cannot read {f}: tensor {name} has {hi - lo} bytes for shape {info['shape']}",
                                         f"re-download the weights into {f.parent}")
                fh.seek(start + lo)
                got = 0
                while got < len(view):
                    n = fh.readinto(view[got:])
                    if not n:
                        raise SpillpackError(f"cannot read {f}: it ends inside tensor {name} (truncated)", f"re-download the weights into {f.parent}")
                    got += n
                yield name, info["dtype"], array


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
