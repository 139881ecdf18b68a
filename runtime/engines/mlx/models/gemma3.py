"""Gemma 3 (text) in MLX, the same model as runtime/engines/torch/models/gemma3.py: scaled
embedding, (1 + weight) RMSNorm in float32, q/k norms, four norms per block, query scaling by
query_pre_attn_scalar, GELU-tanh MLP, sliding layers with their own rotary base."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runtime.engines.mlx.models import llama
from runtime.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dim,))
        self.eps = eps

    def __call__(self, x):
        # (x * (1 + w)) in float32, then cast: Gemma rounds after the weight, Llama before.
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps)
        return (normed * (1.0 + self.weight.astype(mx.float32))).astype(x.dtype)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__(args, layer)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class MLP(llama.MLP):
    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def __call__(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots, span)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(llama.LlamaModel):
    block, norm_class = TransformerBlock, RMSNorm

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embed_scale = args.hidden_size**0.5

    def embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        return x * mx.array(self.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as transformers does


class Model(llama.Model):
    decoder = Gemma3Model

    def logits(self, hidden):
        logits = super().logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap
