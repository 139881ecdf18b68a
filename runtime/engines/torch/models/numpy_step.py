"""A decode step of a float32 CPU base's Llama-family stack (llama.py: Llama, Qwen2, Mistral,
SmolLM2; qwen3.py's q/k norms) with its elementwise work on numpy arrays.

A small model's decode step is its op calls more than its arithmetic: tiny's, 8 rows on one
thread, is some 210 torch ops at 3-25 us each (F.rms_norm alone is seven ops on a CPU), about
1.4 ms against 0.15 ms of products. numpy's calls on the same few rows cost a microsecond or
two, so the step runs here on numpy views of the model's own weights and KV cache (no copy):
the same arithmetic as llama.py's forward at one token per row, in the same order (the norms,
the rotation folded as RotaryEmbedding folds it, decode_attention's additive bias and scale),
and every product on the kernel the layout chose for it (gemm.product: numpy's BLAS, oneDNN's
packed weight, or MKL). The head stays the model's own call (gemm.head's kernels), once per step.

The packed step (attention.PackedStep: rows starting inside a decode step, or a prefill packed
without padding) runs here too, each prompt piece's attention on the same SDPA kernel over
zero-copy views. TorchDecoder takes this path where llama.Model.numpy_step makes one: plain
llama.py blocks (no family's own norm or attention; an adapter's LoRA updates added as
LoRALinear adds them), full rotary, float32 on a CPU (`takes`). Anything else runs through the
model's forward, as does a padded prefill.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.torch.models.attention import build_mask, decode_bias, flat_index, packed_layout
from runtime.engines.torch.models.gemm import BlasLinear, PackedLinear, product
from runtime.engines.torch.models.layout import base_linear as _base, joined_weight


def takes(model, k: torch.Tensor) -> bool:
    """Whether the step computes what `model`'s forward does over a KV cache of keys `k`: its
    float32 weights and cache on a CPU, its products plain linears or LoRA wrappers of them with
    dropout off, a full rotation without LongRoPE's switch (llama.Model.numpy_step checks the
    blocks are llama.py's own). Not a streamed load's (streamed.py): the step multiplies joined copies."""
    if getattr(model, "streamed_weights", None) is not None:
        return False
    if k.device.type != "cpu" or k.dtype != torch.float32 or model.model.embed_tokens.weight.dtype != torch.float32:
        return False
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        linears = [attn.o_proj, mlp.down_proj, *(attn._modules[n] for n in attn.joined[0]), *(mlp._modules[n] for n in mlp.joined[0])]
        if any(_linear_weight(_base(m)) is None or (_lora(m) is not None and m.training and m.p > 0) for m in linears):
            return False
    # Partial rotary (Phi-4-mini) and LongRoPE's switch by length stay with the model's forward.
    return all(r.inv_freq.numel() * 2 == model.args.head_dim and r.long_inv_freq is None for r in model.model.rotary.values())


def _lora(m: nn.Module):
    """A LoRA wrapper's update as the step adds it: (A^T (in, r), B^T (r, out), scale), numpy views
    of its float32 parameters; None for a plain linear."""
    if m._modules.get("base") is None or not hasattr(m, "lora_A"):
        return None
    return _np(m.lora_A).T, _np(m.lora_B).T, float(m.scale)


class _Product:
    """One GEMM of the step: x @ weight^T + bias on the kernel the layout chose (gemm.product), then
    each LoRA update, scale (x A^T) B^T, added on its linear's columns (as LoRALinear.add_update)."""

    def __init__(self, weight, bias, updates=()):
        # updates: (start, stop, A^T, B^T, scale), or for many adapters (start, stop, AdapterRows, None, {adapter: those three})
        self.weight, self.bias, self.updates = weight, bias, updates

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = product(x, self.weight, self.bias)
        for start, stop, a, b, scale in self.updates:
            if b is None:  # many adapters (multi_lora.py): a is the shared AdapterRows, scale each adapter's update
                self._grouped(x, y[:, start:stop], a, scale)
                continue
            update = (x @ a) @ b
            update *= scale
            y[:, start:stop] += update
        return y

    @staticmethod
    def _grouped(x: np.ndarray, y: np.ndarray, rows, updates: dict) -> None:
        """Each adapter's update added on its own tokens' rows of y (MultiLoRALinear.add_update's grouping)."""
        if rows.single is not None:
            if rows.single in updates:
                a, b, scale = updates[rows.single]
                update = (x @ a) @ b
                update *= scale
                y += update
            return
        for adapter, index, _ in rows.groups:
            if adapter in updates:
                a, b, scale = updates[adapter]
                update = (x[index] @ a) @ b
                update *= scale
                y[index] += update


def _product(module: nn.Module, names: tuple[str, ...] | None = None) -> _Product:
    """The step's product for one linear (`module`), or for `module`'s joined linears `names`."""
    linears = [module] if names is None else [module._modules[n] for n in names]
    weight, bias = _linear_weight(module) if names is None else joined_weight(module, names)
    updates, start = [], 0
    for m in linears:
        stop = start + _base(m).weight.shape[0]
        if _lora(m) is not None:
            updates.append((start, stop, *_lora(m)))
        elif hasattr(m, "numpy_updates"):  # a MultiLoRALinear
            updates.append((start, stop, m.rows, None, m.numpy_updates()))
        start = stop
    return _Product(weight, bias, tuple(updates))


def _linear_weight(m: nn.Module):
    """(weight, bias) of a linear (a LoRA wrapper's frozen one) as gemm.product takes them, or None
    for one it does not run."""
    m = _base(m)
    if type(m) is BlasLinear:
        return m.weight_t, m.bias
    if type(m) is PackedLinear:
        return m.packed, m.bias
    if type(m) is nn.Linear:
        return m.weight, m.bias
    return None


def _np(t: torch.Tensor | None):
    return None if t is None else t.detach().numpy()


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """F.rms_norm over the last axis, with the weight (llama.RMSNorm on a float32 base)."""
    scale = np.einsum("...j,...j->...", x, x)  # the sum of squares in one call
    scale *= 1.0 / x.shape[-1]
    scale += eps
    np.sqrt(scale, out=scale)
    out = x / scale[..., None]
    out *= weight
    return out


class _Layer:
    """One block's weights as the step reads them: norms as numpy, each product's (weight, bias)."""

    def __init__(self, block):
        attn, mlp = block.self_attn, block.mlp
        self.norms = (_np(block.input_layernorm.weight), _np(block.post_attention_layernorm.weight))
        self.eps = block.input_layernorm.eps
        self.qkv = _product(attn, attn.joined[0])
        self.o = _product(attn.o_proj)
        self.gate_up = _product(mlp, mlp.joined[0])
        self.down = _product(mlp.down_proj)
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale, self.window, self.layer_type = attn.scale, attn.window, attn.layer_type
        self.hidden = _base(mlp.gate_proj).weight.shape[0]
        # Qwen3's per-head norms of q and k as one (heads + kv_heads, head_dim) weight over the joined q/k heads.
        self.qk_norm, self.qk_eps = None, None
        if getattr(attn, "q_norm", None) is not None:
            self.qk_norm = np.concatenate([np.broadcast_to(_np(attn.q_norm.weight), (self.heads, self.head_dim)),
                                           np.broadcast_to(_np(attn.k_norm.weight), (self.kv_heads, self.head_dim))])
            self.qk_eps = attn.q_norm.eps  # k_norm's too: both are the config's rms_norm_eps


class NumpyStep:
    """The decode step of `model` (a llama.Model that `takes` accepts) over the KV cache k, v."""

    def __init__(self, model, k: torch.Tensor, v: torch.Tensor):
        self.model = model
        self.layers = [_Layer(b) for b in model.model.layers]
        self.norm, self.eps = _np(model.model.norm.weight), model.model.norm.eps
        self.embed = _np(model.model.embed_tokens.weight)  # (vocab, D), however the layout laid it
        self.k, self.v = k.numpy(), v.numpy()  # (layers, slots, kv_heads, max_len, head_dim): the cache's memory
        layers, slots, kv_heads, max_len, hd = self.k.shape
        # Each layer's keys and values flattened to (slots * kv_heads * max_len, head_dim), for the store.
        self.flat = [(self.k[i].reshape(-1, hd), self.v[i].reshape(-1, hd)) for i in range(layers)]

    def decode(self, slots: list[int], last: list[int], lengths) -> torch.Tensor:
        """(n, V) logits of one token per row: row i's token last[i] at position lengths[i] of slot
        slots[i]; its keys and values are stored there."""
        return self.step(last, slots, lengths, [])

    def step(self, tokens: list[int], slots: list[int], lengths, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """attention.PackedStep's forward: one token for each decoding row (slots, their lengths),
        then each piece (slot, start, n) of a prompt starting in its slot at position `start`,
        `tokens` packed end to end in that order. Logits (rows + pieces, V) at each decoding row and
        at each piece's last token."""
        plan = _Plan(self, slots, lengths, pieces)
        x = self.embed[tokens]  # (N, D), a copy: the residual stream
        # Each layer type's cos and sin (N, 1, head_dim), from the model's own rotary, once per step.
        positions = torch.from_numpy(plan.positions)[None]
        rotations = {t: [c.numpy().reshape(len(tokens), 1, -1) for c in r(positions, torch.float32)]
                     for t, r in self.model.model.rotary.items()}
        with np.errstate(over="ignore"):  # silu's exp(-x) overflows to inf for a large negative x: x / inf is -0, as torch's
            for i, layer in enumerate(self.layers):
                x = self._block(i, layer, x, *rotations[layer.layer_type], plan)
        hidden = rms_norm(x[plan.ends] if pieces else x, self.norm, self.eps)
        return self.model.logits(torch.from_numpy(hidden))

    def _block(self, i, layer: _Layer, x, cos, sin, plan: "_Plan"):
        N, H, KV, hd = x.shape[0], layer.heads, layer.kv_heads, layer.head_dim
        qkv = layer.qkv(rms_norm(x, layer.norms[0], layer.eps))  # (N, (H + 2 KV) hd)
        # q and k rotated in one pass: x cos + [x2, x1] sin, sin carrying the rotation's sign.
        qk = qkv[:, :(H + KV) * hd].reshape(N, H + KV, hd)
        if layer.qk_norm is not None:  # Qwen3: each head's q and k normed over head_dim before the rotation
            qk = rms_norm(qk, layer.qk_norm, layer.qk_eps)
        half = hd // 2
        rotated = qk * cos
        rotated[..., :half] += qk[..., half:] * sin[..., :half]
        rotated[..., half:] += qk[..., :half] * sin[..., half:]
        keys, values = self.flat[i]
        keys[plan.index] = rotated[:, H:].reshape(-1, hd)
        values[plan.index] = qkv[:, (H + KV) * hd:].reshape(-1, hd)
        if not plan.pieces:
            out = self._decode_attention(i, layer, rotated[:, :H], plan)
        else:
            out = np.empty((N, H, hd), dtype=x.dtype)
            if plan.n:
                out[:plan.n] = self._decode_attention(i, layer, rotated[:plan.n, :H], plan)
            for (slot, start, n, at), mask in zip(plan.pieces, plan.masks(layer.window)):
                out[at:at + n] = self._piece_attention(i, layer, rotated[at:at + n, :H], slot, start + n, mask)
        x = x + layer.o(out.reshape(N, H * hd))
        gate_up = layer.gate_up(rms_norm(x, layer.norms[1], layer.eps))
        gate, up = gate_up[:, :layer.hidden], gate_up[:, layer.hidden:]
        act = np.negative(gate)
        np.exp(act, out=act)
        act += 1.0
        np.divide(gate, act, out=act)  # silu: x / (1 + exp(-x)), as torch computes it
        act *= up
        return x + layer.down(act)

    def _decode_attention(self, i, layer: _Layer, q, plan: "_Plan"):
        """The decoding rows' attention (attention.rows_attention): q (n, H, hd) -> (n, H, hd)."""
        n, H, KV, hd = q.shape[0], layer.heads, layer.kv_heads, layer.head_dim
        q = q.reshape(n, KV, H // KV, hd)  # query heads grouped by the kv head they share
        k, v = self.k[i, :, :, :plan.span], self.v[i, :, :, :plan.span]  # (slots, KV, span, hd), views
        if not plan.in_place:
            k, v = k[plan.rows], v[plan.rows]  # the rows' keys gathered
        elif plan.rows is not None:  # every slot's keys where they lie: idle slots' queries are zero and their outputs dropped
            every = np.zeros((k.shape[0], KV, H // KV, hd), dtype=q.dtype)
            every[plan.rows] = q
            q = every
        scores = np.matmul(q, k.swapaxes(-1, -2))  # (rows, KV, group, span)
        scores *= layer.scale
        scores += plan.bias(layer.window)[:, None, None, :]
        scores -= scores.max(-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(-1, keepdims=True)
        out = np.matmul(scores, v)
        if plan.in_place and plan.rows is not None:
            out = out[plan.rows]
        return out.reshape(n, H, hd)

    def _piece_attention(self, i, layer: _Layer, q, slot: int, keys: int, mask):
        """A prompt piece's causal attention over its slot's first `keys` keys, on the same SDPA
        kernel as PackedStep (zero-copy torch views): q (n, H, hd) -> (n, H, hd)."""
        as_torch = torch.from_numpy
        out = F.scaled_dot_product_attention(
            as_torch(q).transpose(0, 1)[None], as_torch(self.k[i, slot:slot + 1, :, :keys]),
            as_torch(self.v[i, slot:slot + 1, :, :keys]), attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            scale=layer.scale)  # (1, H, n, hd)
        return out[0].transpose(0, 1).numpy()


class _Plan:
    """What every layer of one step reads, made once: each token's slot and position, where its
    key lands, the decoding rows' key span and bias, and each piece's SDPA mask."""

    def __init__(self, step: NumpyStep, slots: list[int], lengths, pieces: list[tuple[int, int, int]]):
        all_slots, kv_heads, max_len = step.k.shape[1], step.k.shape[2], step.k.shape[3]
        self.n = n = len(slots)
        self.pieces, rows, positions = packed_layout(slots, lengths, pieces)
        # On the CPU by name: a caller's default device (meta, in a load) must not take them.
        token_rows, self.positions = torch.tensor(rows, device="cpu"), torch.tensor(positions, device="cpu")
        # Where each token's key lands in a layer's flattened cache, for every kv head.
        self.index = flat_index(token_rows, self.positions[:, None], kv_heads, max_len).numpy()
        self.positions = self.positions.numpy()
        self.ends = list(range(n)) + [at + m - 1 for _, _, m, at in self.pieces]
        # The decoding rows' attention: every slot's keys in place with most slots decoding (as
        # KVCache.reads_in_place), else their own gathered.
        self.rows, lengths = token_rows[:n].numpy(), self.positions[:n]
        self.in_place = 2 * n >= all_slots
        self.span = int(lengths.max()) + 1 if n else 0
        self.offsets = lengths
        if self.in_place:
            self.offsets = np.zeros(all_slots, dtype=np.int64)
            self.offsets[self.rows] = lengths
            if n == all_slots and (self.rows == np.arange(n)).all():
                self.rows = None  # every slot, in order: the queries and outputs are the cache's own order
        self._biases, self._masks = {}, {}

    def bias(self, window):
        """attention.decode_bias over the decoding rows (rows, span): 0 where a key is seen, -inf where not."""
        if window not in self._biases:
            bias = decode_bias(torch.from_numpy(self.offsets), self.span, window, 1, torch.float32)
            self._biases[window] = bias.numpy().reshape(len(self.offsets), self.span)
        return self._biases[window]

    def masks(self, window):
        """Each piece's SDPA mask, as PackedStep's: None where plain causal attention is the same."""
        if window not in self._masks:
            self._masks[window] = [None if start == 0 and (window is None or window >= m)
                                   else build_mask(m, start + m, torch.tensor([start], device="cpu"), None, "cpu", window)
                                   for _, start, m, _ in self.pieces]
        return self._masks[window]
