"""The prefill savings every engine's decoder shares: what a prefill runs, not how it runs it.

A prefill computes only what the cache does not hold already, and in bounded pieces:
- a prefix cache (vLLM's automatic prefix caching, one entry): the ids and the keys and values
  of one recent prompt are kept; a prompt that starts with at least MIN_SHARED_PREFIX of those
  ids has their keys and values copied into its slot and runs only the rest (rows of one
  forward may resume from different positions: the model's mask takes each row's offset).
  A group of prompts with a long common start the entry lacks runs that start once, for its
  first row, and the others copy it;
- chunks: a forward covers at most `chunk_tokens` tokens (rows x width), each piece of a long
  prompt appending to the cache, so activations are bounded by the chunk, not by slots x the
  longest prompt.

With many adapters in one batch (each slot's adapter set by use_adapters) a slot's keys are its
adapter's: the prefix cache's entry is reused only by a prompt of the adapter that made it, and a
group's common start is shared only where the group is of one adapter.

The decisions (which prefix to reuse, what to remember, how to cut the pieces) are plain
Python on token ids, so they live here once and the engines cannot drift apart on them. An
engine's decoder subclasses PrefixPrefill and supplies the five tensor operations at the end.
"""

from __future__ import annotations

import numpy as np

from runtime.engines.logits import Logits, as_logits

# A prompt reuses the prefix cache's keys from this many shared tokens on. Below it the saving
# is a few tokens of compute, while a reused start costs a copy of every layer's keys and
# sends the forward through the explicit mask instead of plain causal attention; a chat
# template's header alone is about this long, a system prompt far longer.
MIN_SHARED_PREFIX = 16


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b have in common."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class PrefixPrefill:
    """A decoder's prefill over one KV cache of slots, with a one-prompt prefix cache and chunks.

    `prefix_cache=False` and a chunk larger than any prefill switch the savings off (the oracles
    that check them). The subclass holds the model, the cache and the entry's tensors (room for
    max_len tokens), calls _adapt before each forward, and implements _from_entry, _to_entry,
    _forward, _set_lengths and _logits."""

    def __init__(self, max_len: int, prefix_cache: bool, chunk_tokens: int):
        self.max_len, self.chunk_tokens = max_len, chunk_tokens
        self.keeps_prefix = prefix_cache
        self.prefix_ids: list[int] = []  # the entry's prompt; its keys and values are the engine's
        self.prefix_adapter = -1  # the adapter whose keys the entry holds
        self.slot_adapter: np.ndarray | None = None  # each slot's adapter (-1: the base); None: one model for every row

    def use_adapters(self, slots: list[int], adapters: list[int]) -> None:
        """The adapter each of `slots` answers with from its next prefill on (each engine's multi_lora.py)."""
        if self.slot_adapter is None:
            self.slot_adapter = np.full(self.slots, -1, dtype=np.int64)
        self.slot_adapter[slots] = adapters

    def _adapter(self, slot: int) -> int:
        return -1 if self.slot_adapter is None else int(self.slot_adapter[slot])

    def _token_adapters(self, slots: list[int], counts) -> np.ndarray | None:
        """Each token's adapter for a forward of `counts[i]` tokens of slots[i], in order; None: one model."""
        if self.slot_adapter is None:
            return None
        return np.repeat(self.slot_adapter[slots], counts)

    def _adapt(self, slots: list[int], counts) -> None:
        """Many adapters: tell the model's AdapterRows (runtime/engines/token_adapters.py) each token's
        adapter for its next forward, `counts` tokens per slot in order. Every forward calls it."""
        ids = self._token_adapters(slots, counts)
        if ids is not None and getattr(self.model, "adapter_rows", None) is not None:
            self.model.adapter_rows.set(ids)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> Logits:
        """Start each prompt in its slot (the slot's old keys are dropped); (n, V) logits at each prompt's end."""
        self._share_group_prefix(slots, prompts)
        logits = self._run(slots, prompts, [self._reuse(s, p) for s, p in zip(slots, prompts)])
        self._remember(slots[0], prompts[0])
        return logits

    def _share_group_prefix(self, slots: list[int], prompts: list[list[int]]) -> None:
        """Where the prompts start alike for longer than the prefix cache holds, run that start once
        (in the first row's slot) and cache it, so every row copies it."""
        if not self.keeps_prefix or len(prompts) < 2 or len({self._adapter(s) for s in slots}) > 1:
            return
        common = min(map(len, prompts)) - 1  # each row still runs its last token
        for p in prompts[1:]:
            common = shared_prefix(prompts[0][:common], p)
        held = shared_prefix(self.prefix_ids, prompts[0]) if self._adapter(slots[0]) == self.prefix_adapter else 0
        if common < MIN_SHARED_PREFIX or held >= common:
            return
        head = prompts[0][:common]
        self._run(slots[:1], [head], [self._reuse(slots[0], head)])
        self._remember(slots[0], head)

    def _reuse(self, slot: int, prompt: list[int]) -> int:
        """Copy the prefix cache's keys and values of the prompt's start into its slot; how many tokens (0: none)."""
        if not self.keeps_prefix or self._adapter(slot) != self.prefix_adapter:
            return 0
        n = min(shared_prefix(self.prefix_ids, prompt), len(prompt) - 1)  # the last token runs: its logits are needed
        if n < MIN_SHARED_PREFIX:
            return 0
        self._from_entry(slot, n)
        return n

    def _remember(self, slot: int, prompt: list[int]) -> None:
        """The prompt, prefilled in `slot`, becomes the prefix cache's entry (unless the entry holds it already)."""
        same = self._adapter(slot) == self.prefix_adapter
        if not self.keeps_prefix or len(prompt) < MIN_SHARED_PREFIX or same and shared_prefix(self.prefix_ids, prompt) == len(prompt):
            return
        self._to_entry(slot, len(prompt))
        self.prefix_ids, self.prefix_adapter = list(prompt), self._adapter(slot)

    def _run(self, slots: list[int], prompts: list[list[int]], starts: list[int]) -> Logits:
        """Run each prompt from `starts` (the tokens its slot holds already) to its end, at most
        chunk_tokens per forward; (n, V) logits at each prompt's last token."""
        done, parts, order = list(starts), [], []  # each piece's logits, and whose rows they are
        self._set_lengths(slots, done)  # the slots' old keys past these are masked out, no need to clear them
        while active := [i for i, p in enumerate(prompts) if done[i] < len(p)]:
            width = min(max(1, self.chunk_tokens // len(active)), max(len(prompts[i]) - done[i] for i in active),
                        # Pad tokens are written past a row's end too: they must stay inside the cache.
                        min(self.max_len - done[i] for i in active))
            pieces = [prompts[i][done[i]: done[i] + width] for i in active]
            hidden = self._forward([slots[i] for i in active], pieces, [done[i] for i in active], width)
            ends = [n for n, i in enumerate(active) if done[i] + len(pieces[n]) == len(prompts[i])]
            if ends:  # rows whose last token was in this piece: their logits
                parts.append(as_logits(self._logits(hidden, ends, [len(pieces[n]) - 1 for n in ends])))
                order += [active[n] for n in ends]
            for n, i in enumerate(active):
                done[i] += len(pieces[n])
            # Pad tokens were written past each piece's end: a length that stops at the piece hides them.
            self._set_lengths([slots[i] for i in active], [done[i] for i in active])
        logits = parts[0].join(parts[1:]) if len(parts) > 1 else parts[0]
        return logits if order == sorted(order) else logits.take(np.argsort(order).tolist())

    # -- the engine's part: tensors ----------------------------------------------------------

    def _from_entry(self, slot: int, n: int) -> None:
        """Copy the entry's keys and values of its first n tokens into `slot`, every layer."""
        raise NotImplementedError

    def _to_entry(self, slot: int, n: int) -> None:
        """Copy `slot`'s keys and values of its first n tokens into the entry, every layer."""
        raise NotImplementedError

    def _forward(self, slots: list[int], pieces: list[list[int]], offsets: list[int], width: int):
        """The pieces right-padded to `width` into one forward, appended after each slot's `offsets`
        cached tokens (the cache's lengths are those offsets); (n, width, D) hidden states."""
        raise NotImplementedError

    def _set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        """Each slot's cached tokens: keys past them are masked out."""
        raise NotImplementedError

    def _logits(self, hidden, rows: list[int], positions: list[int]):
        """The hidden states at (rows[i], positions[i]) as logits, (len(rows), V): numpy float32 or Logits."""
        raise NotImplementedError
