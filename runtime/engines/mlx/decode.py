"""The MLX engine's decoder: what runtime.engines.generation's Generator drives, over one KV cache.

Logits leave as numpy float32 (n, V): sampling and the greedy argmax are the generator's,
the same code for every engine.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class MLXDecoder:
    """Slot prefill and batched decode over one KV cache of `slots` rows."""

    def __init__(self, model, slots: int, max_len: int):
        self.model = model
        self.slots, self.max_len = slots, max_len
        self.cache = model.make_cache(slots, max_len)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> np.ndarray:
        """Each prompt into its slot, right-padded into one forward; (n, V) logits at each prompt's end."""
        lengths = np.array([len(p) for p in prompts])
        width = int(lengths.max())
        ids = mx.array([p + [0] * (width - len(p)) for p in prompts])  # (n, width)
        view = self.cache.view(slots)
        view.lengths[:] = 0  # the slots' old keys are masked out, no need to clear them
        hidden = self.model.hidden_states(ids, cache=view)  # (n, width, D)
        self.cache.lengths[view.rows] = lengths  # pad tokens were written past each prompt's end
        last = hidden[mx.arange(len(prompts)), mx.array(lengths - 1)]  # (n, D)
        return np.array(self.model.logits(last).astype(mx.float32))

    def decode(self, slots: list[int], last: list[int]) -> np.ndarray:
        """One token for each of `slots` (its last token given); (n, V) logits."""
        view = self.cache.view(slots)
        logits = self.model(mx.array(last)[:, None], cache=view)[:, -1]  # (n, V)
        self.cache.lengths[view.rows] = view.lengths
        return np.array(logits.astype(mx.float32))

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0
