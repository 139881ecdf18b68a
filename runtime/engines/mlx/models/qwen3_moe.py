"""Qwen3-MoE in MLX, the same model as runtime/engines/torch/models/qwen3_moe.py: Qwen3's
attention; on sparse layers a router (`mlp.gate`) picks the top-k experts per token (softmax in
float32, renormalized when norm_topk_prob), experts under the Hub's names `mlp.experts.E.*`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.engines.mlx.models import llama, qwen3
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
        self.experts = [ExpertMLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)]

    def route(self, x):
        """(N, D) tokens -> (weights (N, top_k) in x's dtype, experts (N, top_k)), largest first."""
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)  # (N, experts)
        # Like torch.topk: descending. Indices carry no gradient (as in torch): the router
        # learns through the weights of the experts it chose.
        chosen = mx.stop_gradient(mx.argsort(-probs, axis=-1)[:, : self.top_k])
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights.astype(x.dtype), chosen

    def __call__(self, x):
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        weights, chosen = self.route(flat)
        self._last_choices = chosen  # (N, top_k), for tests and inspection; underscore: not a parameter
        # Each expert runs on every token, weighted by its share (zero where not chosen): dense,
        # but differentiable without data-dependent shapes, and the experts are small.
        share = (chosen[:, :, None] == mx.arange(len(self.experts))[None, None, :]) * weights[:, :, None]  # (N, k, E)
        share = share.sum(axis=1)  # (N, E)
        out = mx.zeros_like(flat)
        for e in np.unique(np.array(chosen)).tolist():  # only the experts some token chose
            out = out + self.experts[e](flat) * share[:, e : e + 1]
        return out.reshape(B, T, D)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = qwen3.Attention(args, layer)
        self.mlp = SparseMoeBlock(args) if args.is_sparse(layer) else ExpertMLP(args, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)

    __call__ = llama.TransformerBlock.__call__


class Qwen3MoeModel(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    decoder = Qwen3MoeModel
