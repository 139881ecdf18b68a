"""Phi-3 / Phi-3.5 / Phi-4-mini in MLX, the same model as runtime/engines/torch/models/phi3.py:
fused `qkv_proj` and `gate_up_proj` under the checkpoint's names, partial rotary, LongRoPE."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runtime.engines.mlx.models import llama
from runtime.models.args import ModelArgs


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int = 0):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        self.window, self.layer_type = args.window(layer), args.layer_types[layer]
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, args.hidden_size, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = mx.split(self.qkv_proj(x), [q_size, q_size + kv_size], axis=-1)  # the order of the fused rows
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, heads, T, head_dim)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, kv_heads, T, head_dim)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x):
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)  # gate rows first, as in the checkpoint
        return self.down_proj(up * nn.silu(gate))


class TransformerBlock(llama.TransformerBlock):
    attention, mlp_class = Attention, MLP


class Phi3Model(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    decoder = Phi3Model
