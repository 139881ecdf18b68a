"""The MLX engine's decoder: what runtime.engines.generation's Generator drives, over one KV cache.

Logits leave as numpy float32 (n, V): sampling and the greedy argmax are the generator's,
the same code for every engine.

A prefill computes only what the cache does not hold already, and in bounded pieces (a prefix
cache of one entry, and chunks): runtime/engines/prefill.py decides what runs, the same for the
torch decoder; this decoder supplies the array operations. The model takes each row's offset
(positions and masks from the cache's lengths), so rows of one forward resume from different
positions, sliding windows included.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.engines.prefill import PrefixPrefill
from runtime.models.memory_rows import PREFILL_CHUNK_TOKENS


class MLXDecoder(PrefixPrefill):
    """Slot prefill and batched decode over one KV cache of `slots` rows.

    `prefix_cache` and `chunk_tokens` switch the prefill's savings off (False; a chunk larger than
    any prefill) for the oracles that check them."""

    def __init__(self, model, slots: int, max_len: int, prefix_cache: bool = True, chunk_tokens: int = PREFILL_CHUNK_TOKENS):
        super().__init__(max_len, prefix_cache, chunk_tokens)
        self.model = model
        self.slots = slots
        self.cache = model.make_cache(slots, max_len)
        # The prefix cache's entry: its keys and values, (max_len, kv_heads, head_dim) a layer, as a
        # slot of the cache (the memory plan counts one prompt of max_len tokens).
        self.prefix_k = [mx.zeros_like(k[0]) for k in self.cache.k] if prefix_cache else None
        self.prefix_v = [mx.zeros_like(v[0]) for v in self.cache.v] if prefix_cache else None

    def _from_entry(self, slot: int, n: int) -> None:
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][slot, :n] = self.prefix_k[layer][:n]
            self.cache.v[layer][slot, :n] = self.prefix_v[layer][:n]

    def _to_entry(self, slot: int, n: int) -> None:
        for layer in range(len(self.cache.k)):
            self.prefix_k[layer][:n] = self.cache.k[layer][slot, :n]
            self.prefix_v[layer][:n] = self.cache.v[layer][slot, :n]
        # Now, not lazily: unevaluated, the entry would keep the whole cache as it is now alive
        # (its input) while later forwards write a new one.
        mx.eval(self.prefix_k, self.prefix_v)

    def _forward(self, slots: list[int], pieces: list[list[int]], offsets: list[int], width: int):
        """The pieces right-padded into one forward, appended after each slot's `offsets` cached tokens; (n, width, D)."""
        ids = mx.array([p + [0] * (width - len(p)) for p in pieces])  # (n, width)
        view = self.cache.view(slots)  # its lengths are the offsets; the model's += on them is a copy's
        hidden = self.model.hidden_states(ids, cache=view)
        # Evaluated piece by piece: a lazy graph over every chunk would hold them all at once.
        mx.eval(hidden, self.cache.k, self.cache.v)
        return hidden

    def _logits(self, hidden, rows: list[int], positions: list[int]) -> np.ndarray:
        return np.array(self.model.logits(hidden[mx.array(rows), mx.array(positions)]).astype(mx.float32))

    def _set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        self.cache.lengths[np.array(slots)] = lengths

    def decode(self, slots: list[int], last: list[int]) -> np.ndarray:
        """One token for each of `slots` (its last token given); (n, V) logits."""
        view = self.cache.view(slots)
        logits = self.model(mx.array(last)[:, None], cache=view)[:, -1]  # (n, V)
        self.cache.lengths[view.rows] = view.lengths
        return np.array(logits.astype(mx.float32))

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0
