"""Small random Hugging Face checkpoints built with transformers, the oracle our models must match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from runtime.models.tiny import ensure_tiny

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def copy_tiny_tokenizer(out: Path) -> None:
    src = ensure_tiny()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)


def make_llama_tokenizer(out: Path) -> int:
    """tiny's BPE plus the Llama-3 chat specials and template; returns the vocab size."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ensure_tiny() / "tokenizer.json"))
    tok.add_special_tokens(LLAMA3_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in tok.get_added_tokens_decoder().values() for t in [t.content]}
    config = {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
            for t, i in ids.items()
        },
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def _save(model, out: Path, max_shard_size=None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return out


def make_qwen2(out: Path, *, tied=False, max_shard_size=None, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    copy_tiny_tokenizer(out)
    vocab = json.loads((ensure_tiny() / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, tie_word_embeddings=tied, eos_token_id=vocab - 1, bos_token_id=vocab - 3, **SMALL)
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model)
    return _save(model, out, max_shard_size), model


def make_llama(out: Path, *, tied=False, max_shard_size=None, seed=0, llama3_rope=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = make_llama_tokenizer(out)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64} if llama3_rope else None
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=256,
                         rope_theta=500000.0, rope_scaling=rope, bos_token_id=vocab - 5, eos_token_id=vocab - 1, **SMALL)
    model = LlamaForCausalLM(config).eval()
    _randomize(model)
    return _save(model, out, max_shard_size), model


def _randomize(model) -> None:
    # HF's init leaves biases at zero and norms at one, which would hide a bias or norm
    # that is loaded into the wrong place; perturb everything.
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


# -- the supported families: small random configs from transformers' own config classes ----

FAMILY_SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256)
WINDOW = 8  # shorter than most test prompts, so sliding layers really slide
FAMILIES = {
    # name: (config class, model class, config arguments)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, use_sliding_window=True,
                                                               sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, partial_rotary_factor=0.75)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, norm_topk_prob=True)),
}


def make_family(name: str, out: Path, seed=0, **overrides):
    """A random HF directory of one family (tiny's tokenizer and chat template), and the HF model."""
    import transformers

    config_class, model_class, kwargs = FAMILIES[name]
    out.mkdir(parents=True, exist_ok=True)
    copy_tiny_tokenizer(out)
    vocab = json.loads((ensure_tiny() / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(vocab_size=vocab, eos_token_id=vocab - 1, bos_token_id=vocab - 3,
                                                 pad_token_id=vocab - 3, **{**FAMILY_SMALL, **kwargs, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    _randomize(model)
    return _save(model, out), model


def make_gemma3_image_text(out: Path, seed=0):
    """Gemma 3 as 4B/12B/27B ship it: Gemma3ForConditionalGeneration (model_type gemma3), a
    small vision tower, and the text model of FAMILIES['gemma3_text'] inside."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    copy_tiny_tokenizer(out)
    vocab = json.loads((ensure_tiny() / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    text = {**FAMILY_SMALL, **FAMILIES["gemma3_text"][2], "vocab_size": vocab, "eos_token_id": vocab - 1,
            "bos_token_id": vocab - 3, "pad_token_id": vocab - 3}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 2,
                          boi_token_index=vocab - 4, eoi_token_index=vocab - 5, eos_token_id=vocab - 1)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(model)
    return _save(model, out), model
