"""MLX models: the same architectures as runtime.engines.torch.models, loaded strictly from the same HF directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.errors import SpillpackError
from runtime.engines.mlx.models import llama
from runtime.engines.torch.models import architecture, check_weights, weight_files

if TYPE_CHECKING:
    from runtime.models.ref import ModelDir


def load_weights(files, dtype) -> dict:
    weights = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except (ValueError, RuntimeError, OSError) as e:
            raise SpillpackError(f"cannot read {f}: {e}", f"re-download the weights into {f.parent}")
        weights.update({k: v.astype(dtype) for k, v in tensors.items()})
    return weights


def load_model(model_dir: "ModelDir", dtype=mx.float32) -> llama.Model:
    """Build the architecture named by config.json (its torch-side ModelArgs) and load strictly."""
    arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
    model = llama.Model(arch.ModelArgs.from_dict(model_dir.config))  # qwen2's args switch on the q/k/v biases
    files = weight_files(model_dir.path)
    weights = model.sanitize(load_weights(files, dtype))
    check_weights({k: v.shape for k, v in tree_flatten(model.parameters())}, {k: v.shape for k, v in weights.items()},
                  files, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model
