"""Qwen3-MoE in torch: Qwen3's attention; on sparse layers the MLP is a router over experts.

The router (`mlp.gate`, a linear to num_experts) scores each token, softmax in float32, keeps
the top num_experts_per_tok (renormalized when norm_topk_prob), and the token's output is the
weighted sum of those experts' SwiGLU MLPs. Experts are kept as the checkpoint stores them on
the Hub (`mlp.experts.E.{gate,up,down}_proj`), so loading needs no conversion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.torch.models import llama, qwen3, routed_tokens
from runtime.models.args import ModelArgs


class ExpertMLP(llama.MLP):
    def __init__(self, args: ModelArgs, intermediate: int):
        nn.Module.__init__(self)
        d = args.hidden_size
        self.gate_proj = nn.Linear(d, intermediate, bias=False)
        self.up_proj = nn.Linear(d, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d, bias=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(args, args.moe_intermediate_size) for _ in range(args.num_experts))
        self.last_choices = None  # (N, top_k) expert indices of the last forward, for tests and inspection

    def route(self, x):
        """(N, D) tokens -> (weights (N, top_k) in x's dtype, experts (N, top_k))."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, experts)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x):
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        weights, chosen = self.route(flat)
        self.last_choices = chosen.detach()
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # only the experts some token chose
            token, slot = torch.where(chosen == e)
            routed = routed_tokens.set(token)
            try:
                y = self.experts[e](flat[token]) * weights[token, slot, None]
            finally:
                routed_tokens.reset(routed)
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(B, T, D)


class TransformerBlock(qwen3.TransformerBlock):
    def __init__(self, args: ModelArgs, layer: int = 0):
        nn.Module.__init__(self)
        self.self_attn = qwen3.Attention(args, layer)
        self.mlp = SparseMoeBlock(args) if args.is_sparse(layer) else ExpertMLP(args, args.intermediate_size)
        self.input_layernorm = llama.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = llama.RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3MoeModel(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    decoder = Qwen3MoeModel
