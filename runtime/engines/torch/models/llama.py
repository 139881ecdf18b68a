"""Llama-3 decoder in plain torch, one readable file (Qwen2 too: its arguments add q/k/v biases).

Attribute names are the Hugging Face checkpoint keys (`model.layers.N.self_attn.q_proj`, ...),
so a checkpoint loads without a rename table and LoRA can wrap each `nn.Linear` by the name
PEFT would use. Classes go from the smallest piece to the whole model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch.utils.checkpoint import checkpoint

from runtime.engines.torch.models.attention import KVCache, PackedStep, build_mask
from runtime.engines.torch.models.gemm import head
from runtime.engines.torch.models.layout import joined_outputs, linear
from runtime.engines.torch.models.quant_linear import QuantEmbedding
from runtime.models.args import ModelArgs, rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if self.weight.dtype == torch.float32 and x.dtype == torch.float32:
            # One call with the weight inside: bit for bit the product below, two ops fewer (a
            # small model's decode step and tune are their op calls more than their arithmetic).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and cast to the weights' dtype before the weight, as the reference
        # does, so bfloat16 runs round the same way (x: the float32 residual stream).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(self.weight.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str = "full_attention"):
        super().__init__()
        r = rope(args, layer_type)
        # Plain attributes, not buffers: they are not in checkpoints, and model.to(bfloat16)
        # must not round the frequencies.
        self.inv_freq = torch.from_numpy(r.inv_freq)  # (rotary_dim/2,) float32, on the CPU
        self.long_inv_freq = None if r.long_inv_freq is None else torch.from_numpy(r.long_inv_freq)
        self.long_from, self.scale = r.long_from, r.scale
        self._on_device = {}  # the frequencies copied to each device once, not on every call

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin (B, 1, T, rotary_dim) for `apply_rope`, sin with the rotation's sign in it."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and int(positions.max()) + 1 > self.long_from:
            inv_freq = self.long_inv_freq  # LongRoPE: as transformers switches, per forward
        key = (id(inv_freq), positions.device)
        if key not in self._on_device:
            self._on_device[key] = inv_freq.to(positions.device)
        freqs = positions[:, None, :, None].float() * self._on_device[key]  # (B, 1, T, rotary_dim/2)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x, cos, sin):
    """x (B, heads, T, head_dim) rotated: x * cos + rotate_half(x) * sin on the first rotary_dim dims.

    rotate_half(x) = [-x2, x1] is the halves swapped (a roll) times [-1, 1], folded into sin:
    the same products, two ops fewer per call. Partial rotary (Phi-4-mini) passes the rest through.
    """
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, dims=-1) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rot.roll(r // 2, dims=-1) * sin, rest], dim=-1)


class Attention(nn.Module):
    joined = (("q_proj", "k_proj", "v_proj"),)  # linears computed as one GEMM (joined_outputs)
    decode_blas = False  # a decode step's attention products on numpy's BLAS (layout.cpu_inference_layout sets it)

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        self.window = args.window(layer)  # None: full attention
        self.layer_type = args.layer_types[layer]
        d, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def project(self, x):
        """q (B, heads, T, head_dim), k and v (B, kv_heads, T, head_dim), before the rotation."""
        B, T, _ = x.shape
        q, k, v = joined_outputs(self, self.joined[0], x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v, mask, cache, layer, slots, span):
        """(B, heads, T, head_dim) attention output, the new keys stored in the cache first."""
        if cache is not None and mask is not None and q.shape[2] == 1:  # a decode step; mask: cache.decode_bias's
            return cache.decode(layer, q, k, v, slots, span, mask, self.scale, self.decode_blas)
        if cache is not None:
            k, v = cache.write(layer, k, v, slots, span)  # (B, kv_heads, S, head_dim)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, PackedStep):  # its parts' attention, each with its own mask
            out = cache.attend(layer, q, k, v, self.scale, self.window, self.decode_blas)
        else:
            out = self.attend(q, k, v, mask, cache, layer, slots, span)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, heads*head_dim)
        return linear(self.o_proj, out)


class MLP(nn.Module):
    joined = (("gate_proj", "up_proj"),)

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.up_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.down_proj = nn.Linear(h, d, bias=args.mlp_bias)

    def forward(self, x):
        gate, up = joined_outputs(self, self.joined[0], x)
        return linear(self.down_proj, F.silu(gate) * up)


class TransformerBlock(nn.Module):
    attention, mlp_class = Attention, MLP  # a family swaps in its own

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = self.attention(args, layer)
        self.mlp = self.mlp_class(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        # Each part by its forward, not nn.Module's call machinery (no module of the engine's models
        # carries hooks): tiny's decode step, 8 rows, one thread, in-process A/B, 1.03-1.06x.
        m = self._modules
        x = x + m["self_attn"].forward(m["input_layernorm"].forward(x), cos, sin, mask, cache, layer, slots, span)
        return x + m["mlp"].forward(m["post_attention_layernorm"].forward(x))


class Embedding(nn.Embedding):
    """nn.Embedding without its random init: the model is built on the meta device and every
    weight is loaded over it, and normal_ on meta imports torch._dynamo (a second per process)."""

    def reset_parameters(self):
        pass


class LlamaModel(nn.Module):
    block, norm_class = TransformerBlock, RMSNorm  # a family swaps in its own
    # Per-layer activation checkpointing in training: keep each layer's input only and run the
    # layer again in backward. The recomputation runs the same kernels on the same inputs, and
    # LoRA dropout's masks are a function of the tokens (runtime.models.dropout), not of a
    # generator's state, so losses and gradients are unchanged.
    grad_checkpoint = False
    # Each layer through nn.Module's call, hooks and all, where FSDP has sharded the layers
    # (runtime/engines/torch/shard.py): its hooks gather a layer's weights around the call.
    call_layers = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(self.block(args, i) for i in range(args.num_hidden_layers))
        self.norm = self.norm_class(args.hidden_size, args.rms_norm_eps)
        # One rotary per layer type (Gemma 3 rotates local and global layers differently);
        # a plain dict, so nothing of it is a parameter.
        self.rotary = {t: RotaryEmbedding(args, t) for t in sorted(set(args.layer_types))}

    def embed(self, input_ids):
        return self.embed_tokens(input_ids)  # (B, T, D)

    def forward(self, input_ids, positions=None, cache: KVCache | None = None, attn_mask=None):
        if isinstance(cache, PackedStep):
            return self._packed(input_ids, cache)
        B, T = input_ids.shape
        device = input_ids.device
        offsets = cache.lengths if cache is not None else torch.zeros(B, dtype=torch.long, device=device)
        steps = offsets[:, None] + torch.arange(T, device=device)[None, :]  # (B, T): each token's index after the cached ones
        if positions is None:
            positions = steps
        slots = span = None
        if cache is not None:
            slots = steps  # (B, T) cache index per token
            span = cache.next_span if cache.next_span is not None else int(slots.max()) + 1
            cache.next_span = None
            assert span <= cache.max_len, f"KV cache overflow: need {span} positions, have {cache.max_len}"
        S = span if cache is not None else T
        if attn_mask is not None:
            assert attn_mask.shape == (B, S), f"attn_mask must be (B, {S}) over cached + new tokens, got {tuple(attn_mask.shape)}"
        # A prefill from position 0 with no padding mask is plain causal attention (SDPA's
        # is_causal is faster; right padding after a row's prompt is hidden by causality),
        # and so is a sliding window no shorter than the prefill; anything else needs a mask.
        masks = {}
        decode = T == 1 and cache is not None  # a decode step: decode_attention's additive bias
        assert not (decode and attn_mask is not None), "a decode step takes no padding mask (the cache's lengths hide what is not there)"
        for layer in self.layers:
            w = layer.self_attn.window
            if w not in masks:
                plain = attn_mask is None and S == T and (w is None or w >= T)
                if plain:
                    masks[w] = None
                elif decode:
                    masks[w] = cache.decode_bias(S, w, self.embed_tokens.weight.dtype)
                else:
                    masks[w] = build_mask(T, S, offsets, attn_mask, device, w)
        x = self.embed(input_ids)  # (B, T, D), in the weights' dtype
        compute = x.dtype
        # The residual stream is float32 whatever the weights' dtype, as llama.cpp keeps its
        # activations: each layer reads it through a norm that rounds to the weights' dtype and
        # adds its output back in float32. On a bfloat16 base this halves the distance from a
        # float32 run (SmolLM2-135M-Instruct, 8 rows: per-token loss 0.046 -> 0.019 off, LoRA
        # gradient cosine 0.977 -> 0.997); on a float32 base it changes nothing.
        x = x.float()
        rotations = {t: r(positions, compute) for t, r in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            cos, sin = rotations[layer.self_attn.layer_type]
            if self.grad_checkpoint and cache is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, masks[layer.self_attn.window], use_reentrant=False)
            else:
                x = (layer if self.call_layers else layer.forward)(x, cos, sin, masks[layer.self_attn.window], cache, i, slots, span)
        if cache is not None:
            cache.lengths += T
        return self.norm(x)

    def _packed(self, input_ids, step: PackedStep):
        """(1, N) packed token ids (PackedStep) -> (1, N, D); the step's attention stores the keys."""
        x = self.embed(input_ids)
        rotations = {t: r(step.positions, x.dtype) for t, r in self.rotary.items()}
        x = x.float()  # the residual stream, as in forward
        for i, layer in enumerate(self.layers):
            cos, sin = rotations[layer.self_attn.layer_type]
            x = layer.forward(x, cos, sin, None, step, i)
        return self.norm(x)


class Model(nn.Module):
    decoder = LlamaModel  # a family's decoder stack
    head_kernel = "linear"  # a tied head's product, as gemm.head takes it (the layouts of layout.py set it)
    # The block, attention and MLP classes whose decode step numpy_step.py computes exactly (a
    # family with its own sets its own, qwen3.py; None: the forward decodes every step).
    numpy_parts = (TransformerBlock, Attention, MLP)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = self.decoder(args)
        # Tied checkpoints have no head weight: logits() reuses the embedding.
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def hidden_states(self, input_ids, positions=None, cache=None, attn_mask=None):
        """(B, T) token ids -> (B, T, D) final-normed hidden states."""
        assert input_ids.dim() == 2, f"input_ids must be (B, T), got {tuple(input_ids.shape)}"
        return self.model(input_ids, positions, cache, attn_mask)

    def logits(self, hidden):
        """(..., D) -> (..., V); kept apart so training can project only the positions with loss."""
        if self.lm_head is None:
            embed = self.model.embed_tokens
            if isinstance(embed, QuantEmbedding):  # its head over the same quantized blocks
                return embed.head(hidden)
            return head(hidden, embed.weight, self.head_kernel)
        return linear(self.lm_head, hidden)

    def forward(self, input_ids, positions=None, cache=None, attn_mask=None):
        return self.logits(self.hidden_states(input_ids, positions, cache, attn_mask))

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.model.norm.weight  # (a quantized embedding's weight is a placeholder on the meta device)
        return KVCache(self.args, batch, max_len, dtype=self.model.embed_tokens.weight.dtype, device=p.device)

    def numpy_step(self, k: torch.Tensor, v: torch.Tensor):
        """A decode step on numpy over the KV cache k, v (numpy_step.py) where this model is a plain
        stack of this file's blocks that it computes exactly; else None (the forward decodes)."""
        from runtime.engines.torch.models.numpy_step import NumpyStep, takes

        decoder = type(self.model)
        if self.numpy_parts is None or decoder.forward is not LlamaModel.forward or decoder.embed is not LlamaModel.embed:
            return None
        parts = (*self.numpy_parts, RMSNorm, RMSNorm)
        if type(self.model.norm) is not RMSNorm or any(
                (type(b), type(b.self_attn), type(b.mlp), type(b.input_layernorm), type(b.post_attention_layernorm)) != parts
                for b in self.model.layers) or not takes(self, k):
            return None
        with torch.no_grad():  # the joined weights made now if they are not yet (layout.joined_weight)
            return NumpyStep(self, k, v)

    def make_decoder(self, slots: int, max_len: int):
        """What runtime.engines.generation's Generator drives: batched prefill and decode over a KV cache."""
        from runtime.engines.torch.decode import TorchDecoder

        return TorchDecoder(self, slots, max_len)
