"""Many LoRA adapters over one frozen base, in one batch, on MLX: the torch engine's
runtime/engines/torch/multi_lora.py with mlx arrays (S-LoRA / punica's grouping).

Every targeted linear is wrapped once by a MultiLoRALinear holding each adapter's A (r, in) and
B (out, r) that targets it (ranks and targets may differ between adapters). The base product runs
once for the whole batch; then each adapter present adds its update to its own tokens: their
rows gathered (fancy indexing), scale * (x A^T) B^T computed as engine.py's LoRALinear computes
it, and added back in place (`y.at[rows].add`). The loop is over the adapters in the batch, never
over rows; the grouping is worked out once per forward (AdapterRows, token_adapters.py).

A token whose adapter is BASE (-1) gets no update; where every token of a forward belongs to one
adapter the update is LoRALinear's own, on the whole batch. The MLX Qwen3-MoE runs each chosen
expert on every token of the forward (weighted by its share, zero where not chosen), so an
expert's wrapped linear sees the forward's own tokens and the same groups apply.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.engines.mlx.models import submodule
from runtime.engines.token_adapters import TokenAdapters, updates_by_module


class AdapterRows(TokenAdapters):
    """The current forward's token -> adapter record, shared by every MultiLoRALinear of one model
    and set by the decoder before each forward (`set`); each group's rows as an mx.array."""

    def index(self, rows: np.ndarray) -> mx.array:
        return mx.array(rows.astype(np.int32))

    def for_tokens(self, n: int):
        assert n == len(self.ids), f"no adapter rows for {n} tokens (the forward has {len(self.ids)})"
        return self.single, self.groups


def _update(h, A, B, scale, dtype):
    """LoRALinear's update of float32 inputs h (n, in): scale * (h A^T) B^T, in the output's dtype."""
    return (scale * ((h @ A.T) @ B.T)).astype(dtype)


class MultiLoRALinear(nn.Module):
    """A frozen linear (`base`) and the updates of the adapters that target it: adapter index ->
    (A (r, in), B (out, r), scale), float32. Underscores: not parameters, never trained or saved."""

    def __init__(self, base: nn.Module, rows: AdapterRows, updates: dict[int, tuple[mx.array, mx.array, float]]):
        super().__init__()
        self.base = base
        self._rows, self._updates = rows, updates

    def __call__(self, x):
        y = self.base(x)
        single, groups = self._rows.for_tokens(x.size // x.shape[-1])
        if single is not None:
            if single not in self._updates:
                return y
            return y + _update(x.astype(mx.float32), *self._updates[single], y.dtype)
        groups = [g for g in groups if g[0] in self._updates]
        if not groups:
            return y
        shape = y.shape
        out = y.reshape(-1, shape[-1])  # (N, out): the base's rows keep the base's product
        h = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        for a, _, index in groups:
            out = out.at[index].add(_update(h[index], *self._updates[a], y.dtype))
        return out.reshape(shape)


def apply_adapters(model: nn.Module, adapters: list[tuple[dict, object]]) -> AdapterRows:
    """Wrap every linear any of `adapters` ((tensors, LoraSpec) each, PEFT's canonical names)
    targets; adapter i is index i. Returns the model's AdapterRows (also `model.adapter_rows`)."""
    rows = AdapterRows()
    per_module = updates_by_module(adapters, lambda a: mx.array(a, dtype=mx.float32))
    for name, updates in per_module.items():
        parent_name, _, child = name.rpartition(".")
        parent = submodule(model, parent_name)
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), rows, updates))
    model.adapter_rows = rows  # a plain object: an attribute, not a parameter
    return rows
