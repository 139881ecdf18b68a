"""Phi-3 / Phi-3.5 / Phi-4-mini in torch: the Llama decoder with the q/k/v projections fused
into one `qkv_proj` and gate/up into one `gate_up_proj` (the checkpoint's names, so LoRA targets
them as PEFT does), partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE, both
in runtime.models.args' rope."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from runtime.engines.torch.models import llama
from runtime.engines.torch.models.layout import linear
from runtime.models.args import ModelArgs


class Attention(llama.Attention):
    joined = ()  # the checkpoint's qkv_proj is joined already

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
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)  # the order of the fused rows
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, kv_heads, T, head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # gate rows first, as in the checkpoint
        return linear(self.down_proj, up * F.silu(gate))


class TransformerBlock(llama.TransformerBlock):
    attention, mlp_class = Attention, MLP


class Phi3Model(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    decoder = Phi3Model
