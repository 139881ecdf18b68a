"""The one table of supported architectures: config.json's model_type -> its arguments, its
checkpoint quirks, and the module holding its model in each framework.

The framework modules are named, not imported (each engine's models/ package imports its own
file by that name): reading the table (to validate a directory,
to refuse an unknown model_type, to list what is supported) never imports torch or mlx, and an
engine imports only its own model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from runtime.base.errors import SpillpackError
from runtime.models.args import ModelArgs
from runtime.models.families import Gemma3Args, MistralArgs, Phi3Args, Qwen2Args, Qwen3Args, Qwen3MoeArgs

FRAMEWORKS = ("torch", "mlx")


def sanitize_llama(args: ModelArgs, weights: dict) -> dict:
    """Drop what Llama-style checkpoints carry but the model does not own: rotary buffers
    (old checkpoints saved inv_freq) and the head of a tied model (some save it anyway).
    Keys only, so one definition serves every framework's tensors."""
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def sanitize_gemma3_multimodal(args: ModelArgs, weights: dict) -> dict:
    """Gemma 3 4B/12B/27B ship as an image-text model: keep the language model, under the text
    model's names (the Hub's `language_model.model.*`, transformers 5's `model.language_model.*`),
    and leave the vision tower and its projector out."""
    text = {}
    for k, v in weights.items():
        for prefix in ("language_model.model.", "model.language_model."):
            if k.startswith(prefix):
                text["model." + k[len(prefix):]] = v
        if k in ("language_model.lm_head.weight", "lm_head.weight"):
            text["lm_head.weight"] = v
        if k.startswith(("model.embed_tokens.", "model.layers.", "model.norm.")):
            text[k] = v  # already the text model's names: a `tune --merge` of this model
    return sanitize_llama(args, text)


# Gemma3TextConfig's defaults: an image-text config.json's text_config lists only what differs.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                            rope_theta=1_000_000.0, query_pre_attn_scalar=256, sliding_window=4096)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    args: type[ModelArgs]
    module: str  # file name under runtime/engines/<framework>/models/
    sanitize: Callable[[ModelArgs, dict], dict] = sanitize_llama
    frameworks: tuple[str, ...] = field(default=FRAMEWORKS)
    text_config: dict | None = None  # an image-text model whose language model is used: its text_config's defaults

    def effective_config(self, config: dict) -> dict:
        """The config the model is built from: config.json, or its text_config for an image-text model."""
        if self.text_config is None:
            return config
        nested = config.get("text_config") or {}
        return {**self.text_config, **nested, "model_type": config["model_type"],
                "tie_word_embeddings": config.get("tie_word_embeddings", nested.get("tie_word_embeddings", True)),
                **{k: config[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id") if k in config}}


# Qwen2 (q/k/v biases) and Mistral (a sliding window) are the Llama decoder with other
# arguments, so they share its model file, as in mlx-lm.
ARCHITECTURES = {
    "llama": Architecture("llama", ModelArgs, "llama"),
    "qwen2": Architecture("qwen2", Qwen2Args, "llama"),
    "mistral": Architecture("mistral", MistralArgs, "llama"),
    "qwen3": Architecture("qwen3", Qwen3Args, "qwen3"),
    "qwen3_moe": Architecture("qwen3_moe", Qwen3MoeArgs, "qwen3_moe"),
    "phi3": Architecture("phi3", Phi3Args, "phi3"),
    "gemma3_text": Architecture("gemma3_text", Gemma3Args, "gemma3"),
    "gemma3": Architecture("gemma3", Gemma3Args, "gemma3", sanitize_gemma3_multimodal, text_config=GEMMA3_TEXT_DEFAULTS),
}
SUPPORTED = ", ".join(sorted(ARCHITECTURES))


def architecture(config: dict, where: str = "config.json") -> Architecture:
    """The architecture config.json names, or the one refusal that lists every supported one."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise SpillpackError(
            f"{where}: model_type {model_type!r} is not supported (supported: {SUPPORTED})",
            "a checkpoint of a supported architecture as the job's MODEL, such as qwen2.5:0.5b with --weights DIR, or tiny",
        )
    return ARCHITECTURES[model_type]
