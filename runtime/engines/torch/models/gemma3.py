"""Gemma 3 (text) in torch: the embedding scaled by sqrt(hidden), RMSNorm with (1 + weight)
computed in float32, q/k norms, norms before and after both attention and the MLP, query
scaling by query_pre_attn_scalar, a GELU-tanh MLP, and sliding-window layers alternating with
global ones, each type with its own rotary base (runtime.models.families.Gemma3Args)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.torch.models import llama
from runtime.engines.torch.models.layout import joined_outputs, linear
from runtime.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        # (x * (1 + w)) in float32, then cast: Gemma rounds after the weight, Llama before.
        return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * (1.0 + self.weight.float())).to(self.weight.dtype)


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
    def forward(self, x):
        gate, up = joined_outputs(self, self.joined[0], x)
        return linear(self.down_proj, F.gelu(gate, approximate="tanh") * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
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
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as transformers does


class Model(llama.Model):
    decoder = Gemma3Model

    def logits(self, hidden):
        logits = super().logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
