"""Qwen3 in torch: the Llama decoder with a per-head RMSNorm on queries and keys (before the
rotation), no attention bias. Attribute names are the checkpoint's (self_attn.q_norm, k_norm)."""

from __future__ import annotations

from runtime.engines.torch.models import llama
from runtime.models.args import ModelArgs


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__(args, layer)
        self.q_norm = llama.RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = llama.RMSNorm(args.head_dim, args.rms_norm_eps)

    def project(self, x):
        q, k, v = super().project(x)  # (B, heads, T, head_dim): the norm is over head_dim, per head
        return self.q_norm(q), self.k_norm(k), v


class TransformerBlock(llama.TransformerBlock):
    attention = Attention


class Qwen3Model(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    decoder = Qwen3Model
    numpy_parts = (TransformerBlock, Attention, llama.MLP)  # numpy_step.py applies the q/k norms
