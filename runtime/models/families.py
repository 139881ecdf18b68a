"""Each family's arguments: what its config.json says beyond the Llama decoder's.

Framework-neutral like runtime.models.args: the torch and MLX model files of a family read
the same arguments, and runtime.models.arch names the class per model_type.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.base.errors import SpillpackError
from runtime.models.args import ModelArgs

SLIDING, FULL = "sliding_attention", "full_attention"


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


@dataclass
class MistralArgs(ModelArgs):
    """Mistral: the Llama decoder; when config.json sets a sliding window, every layer slides."""

    @classmethod
    def from_dict(cls, config: dict) -> "MistralArgs":
        args = super().from_dict(config)
        args.layer_types = [SLIDING if args.sliding_window else FULL] * args.num_hidden_layers
        return args


@dataclass
class Qwen3Args(ModelArgs):
    """Qwen3: per-head RMSNorm on queries and keys, no attention bias; a window only when
    use_sliding_window is on (then on the layers from max_window_layers up)."""

    use_sliding_window: bool = False
    max_window_layers: int = 28

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen3Args":
        args = super().from_dict(config)
        if not args.use_sliding_window:
            args.sliding_window = None
        if args.sliding_window is None:
            args.layer_types = [FULL] * args.num_hidden_layers
        elif not config.get("layer_types"):
            args.layer_types = [SLIDING if i >= args.max_window_layers else FULL for i in range(args.num_hidden_layers)]
        return args


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3-MoE: Qwen3's attention; the MLP of each sparse layer is a router over experts."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen3MoeArgs":
        # transformers 5 writes num_local_experts; the Hub's checkpoints say num_experts.
        config = {**config, "num_experts": config.get("num_experts") or config.get("num_local_experts") or 0}
        return super().from_dict(config)

    def is_sparse(self, layer: int) -> bool:
        return (layer not in (self.mlp_only_layers or [])) and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0

    def lora_linears(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Attention as Qwen3's; on a sparse layer each expert's gate/up/down projection
        (`mlp.experts.E.gate_proj`, the Hub's names), on a dense one the MLP's."""
        linears = super().lora_linears(layer)
        if not self.is_sparse(layer):
            return linears
        d, inter = self.hidden_size, self.moe_intermediate_size
        linears = {k: v for k, v in linears.items() if k.startswith("self_attn.")}
        for e in range(self.num_experts):
            linears.update({f"mlp.experts.{e}.gate_proj": (d, inter), f"mlp.experts.{e}.up_proj": (d, inter),
                            f"mlp.experts.{e}.down_proj": (inter, d)})
        return linears


@dataclass
class Phi3Args(ModelArgs):
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE."""

    rms_norm_eps: float = 1e-5
    lora_fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    @classmethod
    def from_dict(cls, config: dict) -> "Phi3Args":
        args = super().from_dict(config)
        args.layer_types = [SLIDING if args.sliding_window else FULL] * args.num_hidden_layers
        return args

    def lora_linears(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        d, hd, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        return {"self_attn.qkv_proj": (d, q + 2 * kv), "self_attn.o_proj": (q, d),
                "mlp.gate_up_proj": (d, 2 * inter), "mlp.down_proj": (inter, d)}


@dataclass
class Gemma3Args(ModelArgs):
    """Gemma 3 (text): sliding layers alternating with global ones, each type with its own rope."""

    head_dim: int | None = 256
    query_pre_attn_scalar: float = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_parameters: dict | None = None
    rope_local_base_freq: float = 10000.0
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> "Gemma3Args":
        config = dict(config)
        params = config.get("rope_parameters") or {}
        if FULL in params or SLIDING in params:  # transformers >= 5: one dict per layer type
            config["rope_parameters"] = params
            config.pop("rope_scaling", None)
        else:  # the Hub's files: rope_theta + rope_scaling for global layers, rope_local_base_freq
            config["rope_parameters"] = {
                FULL: {**(config.get("rope_scaling") or params or {}), "rope_theta": config.get("rope_theta", params.get("rope_theta", 1e6))},
                SLIDING: {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)},
            }
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        config["sliding_window_pattern"] = pattern
        args = super().from_dict({k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")})
        if not config.get("layer_types"):
            args.layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(args.num_hidden_layers)]
        if args.attn_logit_softcapping is not None:
            raise SpillpackError("config.json sets attn_logit_softcapping, which Gemma 3 does not use and spillpack does not implement",
                                 "a Gemma 3 checkpoint with attn_logit_softcapping: null (all released ones)")
        if args.hidden_activation != "gelu_pytorch_tanh":
            raise SpillpackError(f"config.json's hidden_activation {args.hidden_activation!r} is not Gemma 3's gelu_pytorch_tanh",
                                 "a released Gemma 3 checkpoint")
        return args

    def rope(self, layer_type: str = FULL) -> tuple[float, dict | None]:
        params = dict(self.rope_parameters[layer_type])
        theta = params.pop("rope_theta")
        return theta, (params if params.get("rope_type", "default") != "default" else None)
