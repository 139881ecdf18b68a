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

from runtime.models.args import ModelArgs, rope


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


def apply_rope(x, cos, sin):
    """x (B, heads, T, head_dim) rotated on its first rotary_dim dims; cos, sin (B, T, rotary_dim)."""
    r = cos.shape[-1]
    rot = x[..., :r] * cos[:, None] + rotate_half(x[..., :r]) * sin[:, None]
    return rot if r == x.shape[-1] else mx.concatenate([rot, x[..., r:]], axis=-1)


class Rotary:
    """A layer type's rotary embedding (runtime.models.args.Rope) as mlx arrays; not a Module,
    so nothing of it is a parameter."""

    def __init__(self, args: ModelArgs, layer_type: str):
        r = rope(args, layer_type)
        self.inv_freq = mx.array(r.inv_freq)  # (rotary_dim/2,)
        self.long_inv_freq = None if r.long_inv_freq is None else mx.array(r.long_inv_freq)
        self.long_from, self.scale = r.long_from, r.scale

    def __call__(self, positions: np.ndarray, dtype):
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and int(positions.max()) + 1 > self.long_from:
            inv_freq = self.long_inv_freq  # LongRoPE: as transformers switches, per forward
        freqs = mx.array(positions.astype(np.float32))[..., None] * inv_freq  # (B, T, rotary_dim/2)
        emb = mx.concatenate([freqs, freqs], axis=-1)  # (B, T, rotary_dim)
        cos, sin = mx.cos(emb), mx.sin(emb)
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.astype(dtype), sin.astype(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        d, hd = args.hidden_size, args.head_dim
        self.scale = hd**-0.5
        self.window, self.layer_type = args.window(layer), args.layer_types[layer]
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def project(self, x):
        """q (B, heads, T, head_dim), k and v (B, kv_heads, T, head_dim), before the rotation."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return q, k, v

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
    attention, mlp_class = Attention, MLP  # a family swaps in its own

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = self.attention(args, layer)
        self.mlp = self.mlp_class(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots, span)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_mask(positions: np.ndarray, span: int, window: int | None):
    """(B, 1, T, S) boolean: query t of row b (at cache index positions[b, t]) sees keys up to
    itself, and with a window only the `window` keys ending at itself (transformers' rule:
    key index > query index - window). Older keys of a reused slot are hidden too."""
    k_idx = np.arange(span)[None, None, None, :]
    q_idx = positions[:, None, :, None]
    allowed = k_idx <= q_idx
    if window is not None:
        allowed = allowed & (k_idx > q_idx - window)
    return mx.array(allowed)


def checkpointed(layer, x, *args):
    """The layer's output with its activations recomputed in backward instead of kept: the
    layer's trainable parameters go through mx.checkpoint as inputs, so their gradients flow."""

    def run(params, x):
        layer.update(params)
        return layer(x, *args)

    return mx.checkpoint(run)(layer.trainable_parameters(), x)


class LlamaModel(nn.Module):
    block, norm_class = TransformerBlock, nn.RMSNorm  # a family swaps in its own
    # Per-layer activation checkpointing in training (the same computation run again in backward).
    grad_checkpoint = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = self.norm_class(args.hidden_size, args.rms_norm_eps)
        # Underscore: not a parameter, never saved or trained. One per layer type (Gemma 3).
        self._rotary = {t: Rotary(args, t) for t in sorted(set(args.layer_types))}

    def embed(self, input_ids):
        return self.embed_tokens(input_ids)  # (B, T, D)

    def __call__(self, input_ids, cache: KVCache | None = None):
        B, T = input_ids.shape
        offsets = cache.lengths if cache is not None else np.zeros(B, dtype=np.int64)
        positions = offsets[:, None] + np.arange(T)[None, :]  # (B, T), host side
        slots = span = None
        if cache is not None:
            slots, span = positions, int(positions.max()) + 1
            assert span <= cache.max_len, f"KV cache overflow: need {span} positions, have {cache.max_len}"
        masks = {}
        for layer in self.layers:
            w = layer.self_attn.window
            if w in masks:
                continue
            if cache is None and (w is None or w >= T):
                masks[w] = "causal" if T > 1 else None  # the fused kernel's own causal mask
            else:
                masks[w] = build_mask(positions, span or T, w)
        x = self.embed(input_ids)  # (B, T, D)
        rotations = {t: r(positions, x.dtype) for t, r in self._rotary.items()}
        for i, layer in enumerate(self.layers):
            cos, sin = rotations[layer.self_attn.layer_type]
            if self.grad_checkpoint and cache is None:
                x = checkpointed(layer, x, cos, sin, masks[layer.self_attn.window])
            else:
                x = layer(x, cos, sin, masks[layer.self_attn.window], cache, i, slots, span)
        if cache is not None:
            cache.lengths += T
        return self.norm(x)


class Model(nn.Module):
    decoder = LlamaModel  # a family's decoder stack

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = self.decoder(args)
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
        """What runtime.engines.generation's Generator drives: batched prefill and decode over a KV cache."""
        from runtime.engines.mlx.decode import MLXDecoder

        return MLXDecoder(self, slots, max_len)
