"""What a config.json means, for every framework: the model's arguments and its rotary frequencies.

numpy only: both engines build their models from these, so they cannot drift apart on what a
config.json says, and a machine without torch reads it the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from runtime.errors import SpillpackError


@dataclass
class ModelArgs:
    """The Llama-3 decoder's arguments, straight from config.json: unknown keys are ignored,
    derived ones (kv heads, head_dim) filled in."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA needs heads % kv_heads == 0"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        config = dict(config)
        # transformers >= 5 writes rope_theta and the scaling into one `rope_parameters` dict;
        # checkpoints on the Hub still carry the older `rope_theta` + `rope_scaling` pair.
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in known and v is not None}
        return cls(**args)


@dataclass
class Qwen2Args(ModelArgs):
    """Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections."""

    attention_bias: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen2Args":
        args = super().from_dict(config)
        # Qwen2 always has q/k/v biases; its config.json does not say so.
        args.attention_bias = True
        # Qwen2.5 ships sliding-window settings but switches them off (use_sliding_window: false);
        # nothing here implements Qwen2's window, so refuse a checkpoint that turns it on.
        if config.get("use_sliding_window"):
            raise SpillpackError(
                "config.json sets use_sliding_window: true, which spillpack's qwen2 does not implement",
                "a Qwen2/Qwen2.5 checkpoint with use_sliding_window: false (all released ones)",
            )
        return args


def rope_inv_freq(args: ModelArgs) -> np.ndarray:
    """Inverse frequencies (head_dim/2,) float32, with the Llama-3.1 long-context scaling when configured.

    float32 throughout, in transformers' order of operations, so both engines rotate by the
    same angles as the reference does.
    """
    dim = args.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(args.rope_theta) ** exponent)).astype(np.float32)
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind != "llama3":
        raise SpillpackError(
            f"rope scaling type {kind!r} in config.json is not supported (supported: default, linear, llama3)",
            "a model without that rope_scaling, such as qwen2.5:0.5b or llama3.2:1b",
        )
    factor = np.float32(scaling["factor"])
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = np.float32(2 * math.pi) / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
