"""Many LoRA adapters over one frozen base, in one batch (S-LoRA / punica's grouping).

Every targeted linear of the base is wrapped once by a MultiLoRALinear holding each adapter's
A (r, in) and B (out, r) that targets it (ranks and targets may differ between adapters). The
base product runs once for the whole batch; then each adapter present in the batch adds its
update to its own tokens: its rows gathered, (x A^T) B^T scaled and added as LoRALinear adds it,
scattered back. The loop is over the adapters in the batch, never over rows, and the grouping
(which tokens belong to which adapter) is worked out once per forward, in AdapterRows
(runtime/engines/token_adapters.py, shared with the MLX engine's multi_lora.py), and read
by every wrapped linear of every layer.

A token whose adapter is BASE (-1) gets no update: the base model's answer. Where every token
of a forward belongs to one adapter the update is LoRALinear's own, on the whole batch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.token_adapters import TokenAdapters, updates_by_module
from runtime.engines.torch.models import routed_tokens


class AdapterRows(TokenAdapters):
    """Which adapter each token of the current forward belongs to, and its groups (token_adapters.py):
    shared by every MultiLoRALinear of one model, set by the decoder before each forward (`set`)."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def index(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows).to(self.device)

    def for_tokens(self, n: int):
        """(single, groups) of the `n` tokens a call sees: the forward's, or those routed to an expert."""
        if n == len(self.ids):
            return self.single, self.groups
        routed = routed_tokens.get()
        assert routed is not None and len(routed) == n, f"no adapter rows for {n} tokens (the forward has {len(self.ids)})"
        return self.grouped(self.ids[routed.cpu().numpy()])


class MultiLoRALinear(nn.Module):
    """A frozen linear (`base`) and the updates of the adapters that target it: `updates` maps an
    adapter's index to its (A (r, in), B (out, r), scale), float32."""

    def __init__(self, base: nn.Module, rows: AdapterRows, updates: dict[int, tuple[torch.Tensor, torch.Tensor, float]]):
        super().__init__()
        self.base = base
        self.rows, self.updates = rows, updates
        self.training = False

    def forward(self, x):
        return self.add_update(self.base(x), x)

    @staticmethod
    def _update(y, h, A, B, scale):
        """LoRALinear.add_update's arithmetic: y + scale * (h A^T) B^T, y (n, out), h (n, in)."""
        z = F.linear(h, A)  # (n, r)
        if y.dtype == z.dtype:
            return torch.addmm(y, z, B.t(), alpha=scale)
        return y + (scale * F.linear(z, B)).to(y.dtype)

    def add_update(self, y, x):
        """y, the frozen linear's output for x (here or from a joined GEMM), plus each token's adapter's update."""
        shape = y.shape
        n = x.numel() // x.shape[-1]
        single, groups = self.rows.for_tokens(n)
        if single is not None:
            if single not in self.updates:
                return y
            h = x.reshape(-1, x.shape[-1]).to(torch.float32)
            return self._update(y.reshape(-1, shape[-1]), h, *self.updates[single]).view(shape)
        groups = [g for g in groups if g[0] in self.updates]
        if not groups:
            return y
        out = y.reshape(-1, shape[-1]).clone()  # (N, out): the base rows keep the base's product
        h = x.reshape(-1, x.shape[-1]).to(torch.float32)
        for a, _, index in groups:
            out.index_copy_(0, index, self._update(out.index_select(0, index), h.index_select(0, index), *self.updates[a]))
        return out.view(shape)

    def numpy_updates(self) -> dict[int, tuple[np.ndarray, np.ndarray, float]]:
        """Each adapter's update as numpy_step adds it: A^T (in, r), B^T (r, out), scale; views of the float32 tensors."""
        return {a: (A.numpy().T, B.numpy().T, scale) for a, (A, B, scale) in self.updates.items()}


def apply_adapters(model: nn.Module, adapters: list[tuple[dict, object]], device) -> AdapterRows:
    """Wrap every linear any of `adapters` ((tensors, LoraSpec) each, PEFT's canonical names)
    targets; adapter i is index i. Returns the model's AdapterRows (also `model.adapter_rows`)."""
    rows = AdapterRows(device)
    per_module = updates_by_module(adapters, lambda a: torch.tensor(a, dtype=torch.float32, device=device))
    for name, updates in per_module.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), rows, updates))
    model.adapter_rows = rows
    return rows
