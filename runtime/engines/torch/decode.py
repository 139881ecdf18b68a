"""The torch engine's decoder: what runtime.generation's Generator drives, over one KV cache.

Logits leave as numpy float32 (n, V): sampling and the greedy argmax are the generator's,
the same code for every engine.
"""

from __future__ import annotations

import numpy as np
import torch


class TorchDecoder:
    """Batched prefill and decode over one KV cache of `slots` rows."""

    def __init__(self, model, slots: int, max_len: int):
        self.model = model
        self.slots, self.max_len = slots, max_len
        self.cache = model.make_cache(slots, max_len)
        self.device = self.cache.k.device

    @staticmethod
    def _host(logits: torch.Tensor) -> np.ndarray:
        return logits.float().cpu().numpy()

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> np.ndarray:
        """Start each prompt in its slot, right-padded into one forward; (n, V) logits at each prompt's end."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)  # (n, width)
        view = self.cache.view(slots)
        view.lengths.zero_()  # the slots' old keys are masked out, no need to clear them
        hidden = self.model.hidden_states(ids, cache=view)  # (n, width, D)
        # Pad tokens were written past each prompt's end: a length that stops at the prompt hides them.
        self.cache.lengths[view.index if view.index is not None else slice(None)] = lengths
        return self._host(self.model.logits(hidden[torch.arange(len(prompts), device=self.device), lengths - 1]))

    @torch.inference_mode()
    def decode(self, slots: list[int], last: list[int]) -> np.ndarray:
        """One token for each of `slots` (its last token given); (n, V) logits."""
        view = self.cache.view(slots)
        logits = self.model(torch.tensor(last, device=self.device)[:, None], cache=view)[:, -1]
        if view.index is not None:
            self.cache.lengths[view.index] = view.lengths
        return self._host(logits)

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0
