"""Llama-3 / Qwen2 decoder in MLX, the same model as runtime/engines/torch/models/llama.py.

Attribute names are the Hugging Face checkpoint keys, so the same safetensors load without a
rename table and LoRA wraps each linear by the name PEFT uses. The arguments, the rotary
frequencies and the checkpoint quirks are framework-neutral (runtime.models), so the two
engines cannot drift apart on what a config.json means. Qwen2 is this model with q/k/v
biases, which its arguments turn on.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.models.args import ModelArgs, rope_inv_freq


class KVCache:
    """Preallocated keys and values for every layer, with one length per row.

    Layout (B, max_len, kv_heads, head_dim) per layer so that a write is one scatter at
    (row, position). Lengths live on the host (numpy): they are bookkeeping. Keys past a
    row's length are garbage and are masked out, so a slot is reused without clearing it.
    """

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=mx.float32):
        shape = (batch, max_len, args.num_key_value_heads, args.head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.rows = np.arange(batch)
        self.max_len = max_len

    def view(self, slots: list[int]) -> "KVCache":
        """Some slots, in the given order, as one batch. Its lengths are a copy (fancy indexing):
        the caller stores them back with `self.lengths[slots] = view.lengths` after a forward."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.max_len = self.k, self.v, self.max_len
        view.rows = np.array(slots)
        view.lengths = self.lengths[view.rows]
        return view

    def write(self, layer: int, k, v, slots: np.ndarray, span: int):
        """Store k, v (B, kv_heads, T, head_dim) at positions `slots` (B, T); return (B, kv_heads, span, head_dim)."""
        rows = mx.array(self.rows[:, None])  # (B, 1)
        pos = mx.array(slots)  # (B, T)
        self.k[layer][rows, pos] = k.transpose(0, 2, 1, 3)  # target (B, T, kv_heads, head_dim)
        self.v[layer][rows, pos] = v.transpose(0, 2, 1, 3)
        if len(self.rows) == self.k[layer].shape[0] and (self.rows == np.arange(len(self.rows))).all():
            keys, values = self.k[layer][:, :span], self.v[layer][:, :span]
        else:
            sel = mx.array(self.rows)
            keys, values = self.k[layer][sel, :span], self.v[layer][sel, :span]
        return keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)


def rotate_half(x):
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        d, hd = args.hidden_size, args.head_dim
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, heads, T, head_dim)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, kv_heads, T, head_dim)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        if cache is not None:
            k, v = cache.write(layer, k, v, slots, span)  # (B, kv_heads, S, head_dim)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)  # GQA handled inside
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))  # (B, T, heads*head_dim) -> (B, T, D)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.up_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.down_proj = nn.Linear(h, d, bias=args.mlp_bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots, span)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Underscore: not a parameter, never saved or trained.
        self._inv_freq = mx.array(rope_inv_freq(args))  # (head_dim/2,)

    def __call__(self, input_ids, cache: KVCache | None = None):
        B, T = input_ids.shape
        offsets = cache.lengths if cache is not None else np.zeros(B, dtype=np.int64)
        positions = offsets[:, None] + np.arange(T)[None, :]  # (B, T), host side
        if cache is None:
            mask, slots, span = ("causal" if T > 1 else None), None, None
        else:
            slots, span = positions, int(positions.max()) + 1
            assert span <= cache.max_len, f"KV cache overflow: need {span} positions, have {cache.max_len}"
            # Query t of row b sees keys up to its own position; older keys of a reused slot are hidden.
            mask = mx.array(np.arange(span)[None, None, None, :] <= positions[:, None, :, None])  # (B, 1, T, S)
        freqs = mx.array(positions.astype(np.float32))[..., None] * self._inv_freq  # (B, T, head_dim/2)
        emb = mx.concatenate([freqs, freqs], axis=-1)  # (B, T, head_dim)
        x = self.embed_tokens(input_ids)  # (B, T, D)
        cos, sin = mx.cos(emb).astype(x.dtype), mx.sin(emb).astype(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, slots, span)
        if cache is not None:
            cache.lengths += T
        return self.norm(x)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def hidden_states(self, input_ids, cache=None):
        """(B, T) token ids -> (B, T, D) final-normed hidden states."""
        assert input_ids.ndim == 2, f"input_ids must be (B, T), got {tuple(input_ids.shape)}"
        return self.model(input_ids, cache)

    def logits(self, hidden):
        """(..., D) -> (..., V); apart so training projects only the positions with loss."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, input_ids, cache=None):
        return self.logits(self.hidden_states(input_ids, cache))

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.args, batch, max_len, dtype=self.model.embed_tokens.weight.dtype)

    def make_decoder(self, slots: int, max_len: int):
        """What runtime.generation's Generator drives: batched prefill and decode over a KV cache."""
        from runtime.engines.mlx.decode import MLXDecoder

        return MLXDecoder(self, slots, max_len)
