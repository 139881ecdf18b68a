"""Checkpoint files, framework-neutral: which safetensors make up a model, their headers, and
the strict name-and-shape check every engine applies before loading.

Nothing here reads a tensor: the engines load the files with their own framework, then hand
the names and shapes back to `check_weights`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from runtime.errors import SpillpackError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or model.safetensors."""
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
