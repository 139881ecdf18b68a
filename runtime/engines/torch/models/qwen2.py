"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections.

Only the arguments differ, so the modules are llama.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import SpillpackError
from runtime.engines.torch.models import llama
from runtime.engines.torch.models.llama import KVCache  # noqa: F401  (part of this module's API, as in llama)


@dataclass
class ModelArgs(llama.ModelArgs):
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        args = super().from_dict(config)
        # Qwen2 always has q/k/v biases; its config.json does not say so.
        args.attention_bias = True
        # Qwen2.5 ships sliding-window settings but switches them off (use_sliding_window: false);
        # nothing here implements a window, so refuse a checkpoint that turns it on.
        if config.get("use_sliding_window"):
            raise SpillpackError(
                "config.json sets use_sliding_window: true, which spillpack's qwen2 does not implement",
                "a Qwen2/Qwen2.5 checkpoint with use_sliding_window: false (all released ones)",
            )
        return args


class Model(llama.Model):
    pass
