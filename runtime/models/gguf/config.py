"""A GGUF's metadata as the config.json spillpack's architectures read (runtime.models.arch).

The keys are llama.cpp's, prefixed by general.architecture; the mapping follows transformers'
GGUF loader (integrations/ggml.py) so a file means the same model to both, and adds what that
loader leaves out but the file states: Qwen3-MoE's expert width, Phi-3's partial rotary share
and LongRoPE factors. Mistral comes as `llama` (general.name says mistral), as transformers reads it.
"""

from __future__ import annotations

from runtime.base.errors import SpillpackError

# general.architecture -> spillpack's model_type.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
            "phi3": "phi3"}
SUPPORTED = ", ".join(sorted(FAMILIES))

_COMMON = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
_EXTRA = {
    "llama": {"rope.dimension_count": "head_dim"},
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen3moe": {"attention.key_length": "head_dim", "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
}
REQUIRED = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")


def model_config(gf) -> dict:
    """The config dict of the model a GGUF holds, or one line naming what is missing or unsupported."""
    md = gf.metadata
    arch = gf.architecture
    if arch not in FAMILIES:
        raise SpillpackError(f"{gf.path}: GGUF architecture {arch!r} is not supported (supported: {SUPPORTED})",
                             "a GGUF of a supported family (llama, mistral, qwen2, qwen3, qwen3moe, gemma3, phi3)")
    missing = [f"{arch}.{k}" for k in REQUIRED if f"{arch}.{k}" not in md]
    if arch == "qwen3moe" and f"{arch}.expert_feed_forward_length" not in md:
        missing.append(f"{arch}.expert_feed_forward_length")
    if missing:
        raise SpillpackError(f"{gf.path}: the GGUF has no {missing[0]} key, which says the model's shape",
                             f"a complete GGUF (gguf-dump {gf.path.name} lists its keys)")
    model_type = FAMILIES[arch]
    name = str(md.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        model_type = "mistral"
    config = {"model_type": model_type}
    for key, target in {**_COMMON, **_EXTRA.get(arch, {})}.items():
        if f"{arch}.{key}" in md:
            config[target] = md[f"{arch}.{key}"]
    tokens = md.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):
        config["vocab_size"] = len(tokens)
    # llama.cpp writes the output projection only when it is not the embedding matrix.
    config["tie_word_embeddings"] = "output.weight" not in gf.tensors
    for key, target in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in md:
            config[target] = md[f"tokenizer.ggml.{key}"]
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):  # divided by below
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            gguf_key = next(k for k, t in _COMMON.items() if t == key)
            raise SpillpackError(f"{gf.path}: the GGUF's {arch}.{gguf_key} must be a positive whole number, not {repr(value)[:40]}",
                                 f"a complete GGUF (gguf-dump {gf.path.name} lists its keys)")
    if model_type == "qwen3_moe":
        config["norm_topk_prob"] = True  # llama.cpp's qwen3moe always renormalizes the top-k weights
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    if arch == "phi3":
        _phi3(gf, config)
    if "head_dim" not in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def key_names(gf) -> dict:
    """config field -> the GGUF key it came from, for messages about the file's own keys."""
    arch = gf.architecture
    names = {target: f"{arch}.{key}" for key, target in {**_COMMON, **_EXTRA.get(arch, {})}.items()}
    names.update(bos_token_id="tokenizer.ggml.bos_token_id", eos_token_id="tokenizer.ggml.eos_token_id",
                 pad_token_id="tokenizer.ggml.padding_token_id")
    if f"{arch}.vocab_size" not in gf.metadata:
        names["vocab_size"] = "tokenizer.ggml.tokens"
    return names


def _phi3(gf, config: dict) -> None:
    """Phi-3's rotary dimensions (Phi-4-mini rotates 3/4 of each head) and LongRoPE (Phi-3.5,
    Phi-4-mini), whose factors llama.cpp stores as two tensors."""
    md = gf.metadata
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    dims = md.get("phi3.rope.dimension_count")
    if dims and dims != head_dim:
        config["partial_rotary_factor"] = dims / head_dim
    if "rope_factors_long.weight" in gf.tensors and "rope_factors_short.weight" in gf.tensors:
        from runtime.models.gguf.tensors import dequantize

        original = md.get("phi3.rope.scaling.original_context_length")
        if not original:
            raise SpillpackError(f"{gf.path}: the GGUF has LongRoPE factors but no phi3.rope.scaling.original_context_length",
                                 f"a complete GGUF (gguf-dump {gf.path.name} lists its keys)")
        config["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": original,
            "long_factor": dequantize(gf, gf.tensors["rope_factors_long.weight"]).tolist(),
            "short_factor": dequantize(gf, gf.tensors["rope_factors_short.weight"]).tolist(),
        }
        if md.get("phi3.rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = md["phi3.rope.scaling.attn_factor"]
        config["original_max_position_embeddings"] = original
