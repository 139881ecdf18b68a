"""Model architectures and strict loading of Hugging Face safetensors checkpoints."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from runtime.errors import SpillpackError
from runtime.engines.torch.models import llama
from runtime.engines.torch.models import qwen2

if TYPE_CHECKING:
    from runtime.models.ref import ModelDir

# model_type in config.json -> the module holding its ModelArgs and Model.
ARCHITECTURES = {"qwen2": qwen2, "llama": llama}
SUPPORTED = ", ".join(sorted(ARCHITECTURES))

Model = llama.Model


def architecture(config: dict, where: str = "config.json"):
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise SpillpackError(
            f"{where}: model_type {model_type!r} is not supported (supported: {SUPPORTED})",
            "a qwen2 or llama checkpoint, such as --model qwen2.5:0.5b or --model tiny",
        )
    return ARCHITECTURES[model_type]


def weight_files(path) -> list:
    """The safetensors files of a checkpoint: the shards named by the index, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise SpillpackError(f"{index} is not a valid safetensors index ({e})", f"re-download the weights into {path}")
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise SpillpackError(f"no model.safetensors or model.safetensors.index.json in {path}", f"ls {path}")


def load_weights(files, dtype, device) -> dict:
    weights = {}
    for f in files:
        try:
            tensors = load_file(f, device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpillpackError(f"cannot read {f}: {e}", f"re-download the weights into {f.parent}")
        weights.update({k: v.to(dtype) for k, v in tensors.items()})
    return weights


def load_model(model_dir: "ModelDir", dtype=torch.float32, device="cpu"):
    """Build the architecture named by config.json and load its weights strictly."""
    arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
    args = arch.ModelArgs.from_dict(model_dir.config)
    # Build on the meta device: no time or memory spent on a random init that is overwritten.
    with torch.device("meta"):
        model = arch.Model(args)
    files = weight_files(model_dir.path)
    weights = model.sanitize(load_weights(files, dtype, device))
    check_weights({k: tuple(v.shape) for k, v in model.state_dict().items()},
                  {k: tuple(v.shape) for k, v in weights.items()}, files, model_dir)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()


def check_weights(expected: dict, got: dict, files, model_dir: "ModelDir") -> None:
    """Strict loading, shared by every engine: the same names and shapes as the model, or one line."""
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
