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
