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

from runtime.models.args import ModelArgs, rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
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


class KVCache:
    """Preallocated keys and values for every layer, with one length per row.

    Rows may hold sequences of different lengths (continuous batching); new tokens of row b
    are written at positions lengths[b]..lengths[b]+T-1. Keys past a row's length are garbage
    and are masked out by the model, so a slot can be reused without clearing it.
    """

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (args.num_hidden_layers, batch, args.num_key_value_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.all_rows = torch.arange(batch, device=device)
        self.index = None  # the slots a view covers (None: all of them, in order)
        # The next forward's key span when the caller knows its rows' lengths on the host (the
        # decoder does): reading it from `lengths` would stop the host until the device catches up.
        self.next_span: int | None = None

    def view(self, slots: list[int]) -> "KVCache":
        """Some slots, in the given order, as one batch: writes land in this cache's storage.

        The view's lengths are a copy (advanced indexing), so the caller stores them back
        with `self.lengths[slots] = view.lengths` after a forward.
        """
        if slots == list(range(self.k.shape[1])):
            return self
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.max_len = self.k, self.v, self.max_len
        view.index = torch.tensor(slots, device=self.k.device)
        view.lengths = self.lengths[view.index]
        view.next_span = None
        return view

    def write(self, layer: int, k, v, slots: torch.Tensor, span: int):
        """Store k, v (B, kv_heads, T, head_dim) at `slots` (B, T); return keys/values up to `span`."""
        rows = self.all_rows if self.index is None else self.index
        # Advanced indices split by a slice put their dims first: the target is (B, T, kv_heads, head_dim).
        self.k[layer][rows[:, None], :, slots] = k.transpose(1, 2)
        self.v[layer][rows[:, None], :, slots] = v.transpose(1, 2)
        if self.index is None:
            return self.k[layer, :, :, :span], self.v[layer, :, :, :span]  # (B, kv_heads, S, head_dim)
        return self.k[layer, :, :, :span][rows], self.v[layer, :, :, :span][rows]  # a gathered copy


def joined_outputs(module: nn.Module, names: tuple[str, ...], x) -> list:
    """The outputs of `module`'s linears `names`, which all read x, from one GEMM over their
    weights laid end to end: q/k/v and gate/up become one call each, which on a small model's
    decode step (calls, not arithmetic, most of its time) saves what the peer spends. Each
    linear keeps its weight, as a view into the joined tensor, so checkpoint names, state_dict
    and LoRA targets are unchanged. A LoRA wrapper (its frozen linear as `.base`) adds its own
    update to its part.

    Only where no gradient flows back through x (generation, evaluation): in a tune the joined
    output's split and the gradients joined again in backward cost more than the one GEMM saves
    (Qwen2.5-0.5B shape, float32, 2-core AMD EPYC: 83.2 tokens/s joined, 87.8 separate)."""
    linears = [getattr(module, n) for n in names]
    bases = [getattr(m, "base", m) for m in linears]
    joined = None if torch.is_grad_enabled() and x.requires_grad else _joined(module, bases)
    if joined is None:
        outs = [b(x) for b in bases]
    else:
        weight, bias, sizes = joined
        outs = list(F.linear(x, weight, bias).split(sizes, dim=-1))
    return [y if m is b else m.add_update(y, x) for y, m, b in zip(outs, linears, bases)]


def _joined(module: nn.Module, bases: list):
    """(weight, bias, sizes) joining `bases`, made on first use and again whenever a weight has
    moved (model.to(), a reload); None where a weight is being trained, whose gradient must
    reach its own parameter (the engine's base is frozen: this is for other callers)."""
    weights = [b.weight for b in bases]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    ptrs = tuple(w.data_ptr() for w in weights)
    cached = module.__dict__.get("joined_linears")
    if cached is not None and cached[0] == ptrs:
        return cached[1]
    with torch.no_grad():
        weight = torch.cat(weights)
        bias = None if bases[0].bias is None else torch.cat([b.bias for b in bases])
    sizes = [w.shape[0] for w in weights]
    for b, part, w in zip(bases, weight.split(sizes), weights):
        b.weight = nn.Parameter(part, requires_grad=w.requires_grad)  # the separate copy is freed
    if bias is not None:
        for b, part in zip(bases, bias.split(sizes)):
            b.bias = nn.Parameter(part, requires_grad=b.bias.requires_grad)
    module.__dict__["joined_linears"] = (tuple(b.weight.data_ptr() for b in bases), (weight, bias, sizes))
    return weight, bias, sizes


def join_linears(model: nn.Module) -> None:
    """Join every module's `joined` linears now, as joined_outputs would on first use: at load,
    so the separate copies are freed before anything else is allocated (the loader then hands
    the freed heap back to the system: SmolLM2-135M in bfloat16, +289 MiB joined untrimmed,
    +263 trimmed, +268 not joined)."""
    with torch.no_grad():
        for module in model.modules():
            for names in getattr(module, "joined", ()):
                _joined(module, [getattr(getattr(module, n), "base", getattr(module, n)) for n in names])


def decode_attention(q, k, v, bias, scale):
    """Attention of one query per row, (B, heads, 1, head_dim), over (B, kv_heads, S, head_dim);
    `bias` (B * kv_heads, 1, S): 0 where a key is seen, -inf where not (`decode_bias`).

    The same result as SDPA with the mask; on CPU, torch's flash kernel spends ~0.3 ms per call
    on a single query, most of a small model's decode step, where these three ops take a tenth.
    Rows and kv heads flattened into one batch make the cached keys (a slice of the cache) a
    view that bmm reads in place, where a 4-d matmul copied them (tiny, 8 rows: 60 -> 22 us per
    layer), and baddbmm scales and masks as it multiplies. On CUDA, SDPA with a boolean mask and
    grouped kv heads falls back to its math kernel, which copies the keys and values out to
    every query head; grouping the queries instead reads them once.
    """
    B, H, _, hd = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    q = q.reshape(B * kv_heads, H // kv_heads, hd)  # query heads grouped by the kv head they share
    scores = torch.baddbmm(bias, q, k.reshape(B * kv_heads, S, hd).transpose(1, 2), alpha=scale)  # (B*kv, group, S)
    return torch.bmm(scores.softmax(-1), v.reshape(B * kv_heads, S, hd)).view(B, H, 1, hd)


def decode_bias(mask, kv_heads: int, dtype):
    """`build_mask`'s (B, 1, 1, S) for one query per row, as decode_attention's additive
    (B * kv_heads, 1, S) bias: made once per step, read by every layer."""
    B, S = mask.shape[0], mask.shape[-1]
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(B, kv_heads, 1, S).reshape(B * kv_heads, 1, S)


class Attention(nn.Module):
    joined = (("q_proj", "k_proj", "v_proj"),)  # linears computed as one GEMM (joined_outputs)

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

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v, slots, span)  # (B, kv_heads, S, head_dim)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        elif T == 1 and cache is not None:
            out = decode_attention(q, k, v, mask, self.scale)  # mask: decode_bias's
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, heads*head_dim)
        return self.o_proj(out)


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
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    attention, mlp_class = Attention, MLP  # a family swaps in its own

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = self.attention(args, layer)
        self.mlp = self.mlp_class(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, span=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots, span)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_mask(T: int, S: int, offsets, attn_mask, device, window: int | None = None):
    """Boolean (B, 1, T, S) mask, True where a query may attend a key.

    Query t of row b sits at key index offsets[b] + t (offsets: tokens already cached) and sees
    keys up to itself (with a sliding window, only the `window` keys ending at itself, as
    transformers counts them: key index > query index - window). `attn_mask` (B, S), 1 for real tokens and 0 for padding, hides pad keys.
    Every query keeps its own key even if it is padding, so no row is fully masked (softmax
    over nothing is NaN, and a NaN in a pad row would poison gradients); pad rows' outputs are
    never used.
    """
    q_idx = offsets[:, None] + torch.arange(T, device=device)[None, :]  # (B, T)
    k_idx = torch.arange(S, device=device)  # (S,)
    allowed = k_idx[None, None, :] <= q_idx[:, :, None]  # (B, T, S)
    if window is not None:
        allowed = allowed & (k_idx[None, None, :] > q_idx[:, :, None] - window)
    if attn_mask is not None:
        allowed = allowed & attn_mask.bool()[:, None, :]
        allowed = allowed | (k_idx[None, None, :] == q_idx[:, :, None])
    return allowed[:, None]  # (B, 1, T, S)


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
        B, T = input_ids.shape
        device = input_ids.device
        offsets = cache.lengths if cache is not None else torch.zeros(B, dtype=torch.long, device=device)
        if positions is None:
            positions = offsets[:, None] + torch.arange(T, device=device)[None, :]  # (B, T)
        slots = span = None
        if cache is not None:
            slots = offsets[:, None] + torch.arange(T, device=device)[None, :]  # (B, T) cache index per token
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
        for layer in self.layers:
            w = layer.self_attn.window
            if w not in masks:
                plain = attn_mask is None and S == T and (w is None or w >= T)
                masks[w] = None if plain else build_mask(T, S, offsets, attn_mask, device, w)
        x = self.embed(input_ids)  # (B, T, D), in the weights' dtype
        compute = x.dtype
        # The residual stream is float32 whatever the weights' dtype, as llama.cpp keeps its
        # activations: each layer reads it through a norm that rounds to the weights' dtype and
        # adds its output back in float32. On a bfloat16 base this halves the distance from a
        # float32 run (SmolLM2-135M-Instruct, 8 rows: per-token loss 0.046 -> 0.019 off, LoRA
        # gradient cosine 0.977 -> 0.997); on a float32 base it changes nothing.
        x = x.float()
        if T == 1 and cache is not None:  # a decode step: decode_attention's additive bias
            kv_heads = self.layers[0].self_attn.n_kv_heads
            masks = {w: None if m is None else decode_bias(m, kv_heads, compute) for w, m in masks.items()}
        rotations = {t: r(positions, compute) for t, r in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            cos, sin = rotations[layer.self_attn.layer_type]
            if self.grad_checkpoint and cache is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, masks[layer.self_attn.window], use_reentrant=False)
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
        # Tied checkpoints have no head weight: logits() reuses the embedding.
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def hidden_states(self, input_ids, positions=None, cache=None, attn_mask=None):
        """(B, T) token ids -> (B, T, D) final-normed hidden states."""
        assert input_ids.dim() == 2, f"input_ids must be (B, T), got {tuple(input_ids.shape)}"
        return self.model(input_ids, positions, cache, attn_mask)

    def logits(self, hidden):
        """(..., D) -> (..., V); kept apart so training can project only the positions with loss."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def forward(self, input_ids, positions=None, cache=None, attn_mask=None):
        return self.logits(self.hidden_states(input_ids, positions, cache, attn_mask))

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.model.embed_tokens.weight
        return KVCache(self.args, batch, max_len, dtype=p.dtype, device=p.device)

    def make_decoder(self, slots: int, max_len: int):
        """What runtime.engines.generation's Generator drives: batched prefill and decode over a KV cache."""
        from runtime.engines.torch.decode import TorchDecoder

        return TorchDecoder(self, slots, max_len)
