"""The MLX engine's models: each architecture's module (named by runtime.models.arch) and
strict loading of the same Hugging Face directory the torch engine reads."""

from __future__ import annotations

import importlib

from typing import TYPE_CHECKING

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.models.arch import architecture
from runtime.models.weights import check_weights, read_tensors, weight_files

if TYPE_CHECKING:
    from runtime.models.ref import ModelDir


def model_file(arch):
    """This engine's module for an architecture: the file named by runtime.models.arch's table."""
    assert "mlx" in arch.frameworks, (arch.model_type, "mlx")
    return importlib.import_module(f"{__name__}.{arch.module}")


def submodule(model, path: str):
    """The module at a dotted PEFT-style name (`model.layers.0.self_attn.q_proj`): list items by index."""
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    return obj


def load_weights(files, dtype) -> dict:
    """Tensor by tensor: each is converted and evaluated before the next is read, so the host
    never holds the file's copy beside the converted one."""
    weights = {}
    for name, kind, array in read_tensors(files):
        t = mx.array(array)
        if kind == "BF16":
            t = t.view(mx.bfloat16)
        weights[name] = t.astype(dtype)
        mx.eval(weights[name])
    return weights


def load_model(model_dir: "ModelDir", dtype=mx.float32):
    """Build the architecture named by config.json and load its weights strictly."""
    arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
    args = arch.args.from_dict(model_dir.config)
    model = model_file(arch).Model(args)
    files = weight_files(model_dir.path)
    weights = arch.sanitize(args, load_weights(files, dtype))
    check_weights({k: v.shape for k, v in tree_flatten(model.parameters())}, {k: v.shape for k, v in weights.items()},
                  files, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model
