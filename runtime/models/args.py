"""What a config.json means, for every framework: the model's arguments and its rotary frequencies.

numpy only: both engines build their models from these, so they cannot drift apart on what a
config.json says, and a machine without torch reads it the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from runtime.base.errors import SpillpackError


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
    original_max_position_embeddings: int | None = None  # LongRoPE's pre-extension context
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    partial_rotary_factor: float = 1.0  # the share of head_dim that is rotated (Phi-4-mini: 0.75)
    sliding_window: int | None = None  # keys a sliding layer sees: its own and the window-1 before it
    layer_types: list[str] | None = None  # "full_attention" or "sliding_attention" per layer

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.sliding_window is None or self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA needs heads % kv_heads == 0"
        assert len(self.layer_types) == self.num_hidden_layers, "layer_types needs one entry per layer"

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def rope(self, layer_type: str = "full_attention") -> tuple[float, dict | None]:
        """(theta, scaling) of the rotary embedding a layer of this type uses."""
        return self.rope_theta, self.rope_scaling

    # A fused linear -> the unfused names it stands for (Phi-3's qkv_proj): --targets naming all
    # of them adapts the fused one, so one command line fits every family.
    lora_fused = {}

    def lora_linears(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """A layer's linears a LoRA may target: module path within the layer -> (in, out)."""
        d, hd, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        return {
            "self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv), "self_attn.o_proj": (q, d),
            "mlp.gate_proj": (d, inter), "mlp.up_proj": (d, inter), "mlp.down_proj": (inter, d),
        }

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
        if "partial_rotary_factor" not in config and "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope["partial_rotary_factor"]
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in known and v is not None}
        return cls(**args)


@dataclass(frozen=True)
class Rope:
    """A layer type's rotary embedding: angles are positions * inv_freq, cos and sin are scaled.

    LongRoPE (Phi-3.5, Phi-4-mini) has a second set of frequencies for sequences longer than
    the original context: like transformers, a forward whose largest position reaches
    `long_from` rotates by `long_inv_freq`.
    """

    inv_freq: np.ndarray  # (rotary_dim/2,) float32
    scale: float = 1.0
    long_inv_freq: np.ndarray | None = None
    long_from: int | None = None


def rope(args: ModelArgs, layer_type: str = "full_attention") -> Rope:
    """The rotary embedding of a layer type, in transformers' float32 arithmetic."""
    theta, scaling = args.rope(layer_type)
    dim = int(args.head_dim * args.partial_rotary_factor)
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = np.float32(theta) ** exponent
    inv_freq = (np.float32(1.0) / base).astype(np.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return Rope(inv_freq)
    if kind == "linear":
        return Rope((inv_freq / np.float32(scaling["factor"])).astype(np.float32))
    if kind == "llama3":
        return Rope(llama3_scaled(inv_freq, scaling))
    if kind in ("longrope", "su"):
        original = scaling.get("original_max_position_embeddings") or args.original_max_position_embeddings
        factor = args.max_position_embeddings / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = (np.float32(1.0) / (np.asarray(scaling["short_factor"], dtype=np.float32) * base)).astype(np.float32)
        long = (np.float32(1.0) / (np.asarray(scaling["long_factor"], dtype=np.float32) * base)).astype(np.float32)
        return Rope(short, float(attention), long, int(original))
    raise SpillpackError(
        f"rope scaling type {kind!r} in config.json is not supported (supported: default, linear, llama3, longrope)",
        "a model without that rope_scaling, such as qwen2.5:0.5b or llama3.2:1b",
    )


def rope_inv_freq(args: ModelArgs, layer_type: str = "full_attention") -> np.ndarray:
    """Inverse frequencies (rotary_dim/2,) float32 of a layer type (the short ones for LongRoPE)."""
    return rope(args, layer_type).inv_freq


def llama3_scaled(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama-3.1's long-context scaling of the inverse frequencies."""
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
