"""Batched generation with a KV cache and continuous batching, framework-neutral (numpy only).

A fixed number of slots share one preallocated cache; each step advances every active slot
by one token, and a finished slot takes the next pending request at once. Sampling draws from
a per-request generator seeded from (seed, key), so a row's tokens do not depend on which
rows shared its batch: a resumed job reproduces the rows it redoes, on any engine.

What touches the model is a `Decoder`, one per engine (runtime/engines/<engine>/decode.py,
made by a model's `make_decoder(slots, max_len)`). It returns numpy float32 logits, so
sampling and the greedy argmax are this module's, the same code on every engine: the same
logits give the same tokens on torch and on MLX.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

from typing import Protocol

import numpy as np

from runtime.base.errors import SpillpackError


@dataclass
class Request:
    key: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Result:
    key: str
    tokens: list[int]  # the completion, including the stop token when there is one
    text: str  # the completion decoded without special tokens
    finish_reason: str  # "stop" (an eos token) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int


class Decoder(Protocol):
    """One engine's half of generation: a KV cache of `slots` rows of up to `max_len` tokens."""

    slots: int
    max_len: int

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> np.ndarray:
        """Start each prompt in its slot (the slot's old keys are dropped); (n, V) float32
        logits at each prompt's last token."""

    def decode(self, slots: list[int], last: list[int]) -> np.ndarray:
        """One token for each of `slots`, its last token given; (n, V) float32 logits."""

    def release(self, slot: int) -> None:
        """The slot's row is done; the next prefill may reuse it."""


@dataclass
class _Row:
    request: Request
    rng: np.random.Generator | None
    tokens: list[int] = field(default_factory=list)


def request_generator(seed: int, key: str) -> np.random.Generator:
    """A row's own random stream, from (seed, key) only: not from its batch mates or the engine."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator | None) -> int:
    """One token from (V,) logits: argmax at temperature 0, else temperature + nucleus sampling.

    float64 from the float32 logits on, and one uniform draw per token, inverted through the
    cumulative probabilities: numpy's own arithmetic, so any engine's logits give the same token.
    """
    if temperature == 0:
        return int(np.argmax(logits))  # the first maximum
    x = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")  # most likely first; ties in index order
    sorted_probs = probs[order]
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        keep = np.cumsum(sorted_probs) - sorted_probs < top_p
        order, sorted_probs = order[keep], sorted_probs[keep]
    cdf = np.cumsum(sorted_probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


class Generator:
    # A prefill group stops growing when padding would exceed this share of its tokens: one
    # forward for many prompts saves per-call overhead, padding costs compute.
    MAX_PAD_SHARE = 0.25

    def __init__(self, decoder: Decoder, tokenizer):
        assert decoder.slots >= 1 and decoder.max_len >= 2
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.slots, self.max_len = decoder.slots, decoder.max_len
        self.rows: list[_Row | None] = [None] * self.slots
        self.pending: deque[Request] = deque()
        self.eos = tokenizer.eos_token_ids

    def add(self, request: Request) -> None:
        if len(request.prompt_ids) == 0:
            raise SpillpackError(f"request {request.key!r} has an empty prompt", "give every row a non-empty prompt")
        if len(request.prompt_ids) + request.max_tokens > self.max_len:
            raise SpillpackError(
                f"request {request.key!r}: {len(request.prompt_ids)} prompt tokens + max_tokens {request.max_tokens} "
                f"exceed the context of {self.max_len}",
                "a smaller --max-tokens or a shorter prompt",
            )
        self.pending.append(request)

    @property
    def active(self) -> bool:
        return bool(self.pending) or any(r is not None for r in self.rows)

    def step(self) -> list[Result]:
        """Advance every active slot by one token; return the requests that finished."""
        finished: list[Result] = []
        # Slots that are running now decode one token each...
        running = [i for i, r in enumerate(self.rows) if r is not None]
        if running:
            logits = self.decoder.decode(running, [self.rows[i].tokens[-1] for i in running])
            self._push(running, logits, finished)
        # ...and empty slots start pending requests, whose prefill yields their first token.
        # One round per step, even when requests finish at their prefill: a step is the
        # quantum a preemption may abandon and after which rows are committed, so it stays bounded.
        if self.pending and None in self.rows:
            free = [i for i, r in enumerate(self.rows) if r is None]
            starting = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
            starting.sort(key=lambda r: len(r.prompt_ids))
            for group in self._prefill_groups(starting):
                slots = [free.pop(0) for _ in group]
                for slot, req in zip(slots, group):
                    self.rows[slot] = _Row(req, request_generator(req.seed, req.key) if req.temperature > 0 else None)
                self._push(slots, self.decoder.prefill(slots, [r.prompt_ids for r in group]), finished)
        return finished

    def _prefill_groups(self, requests: list[Request]) -> list[list[Request]]:
        """Requests sorted by prompt length, split where right padding to the longest gets costly."""
        groups: list[list[Request]] = []
        for req in requests:
            group = groups[-1] if groups else None
            if group:
                real = sum(len(r.prompt_ids) for r in group) + len(req.prompt_ids)
                if (len(group) + 1) * len(req.prompt_ids) - real <= self.MAX_PAD_SHARE * real:
                    group.append(req)
                    continue
            groups.append([req])
        return groups

    def _push(self, slots: list[int], logits: np.ndarray, finished: list[Result]) -> None:
        """Each slot's next token from its row of (n, V) logits; finished rows leave their slots."""
        # Greedy rows take one argmax over the batch, sampled rows draw their own.
        greedy = logits.argmax(-1).tolist()
        for n, slot in enumerate(slots):
            row = self.rows[slot]
            req = row.request
            token = greedy[n] if req.temperature == 0 else sample(logits[n], req.temperature, req.top_p, row.rng)
            row.tokens.append(token)
            reason = "stop" if token in self.eos else "length" if len(row.tokens) >= req.max_tokens else None
            if reason is None:
                continue
            text_ids = row.tokens[:-1] if reason == "stop" else row.tokens
            finished.append(Result(
                key=req.key, tokens=row.tokens, text=self.tokenizer.decode(text_ids), finish_reason=reason,
                prompt_tokens=len(req.prompt_ids), completion_tokens=len(row.tokens),
            ))
            self.rows[slot] = None
            self.decoder.release(slot)


def generate(model, tokenizer, prompts, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, batch: int = 8) -> list[Result]:
    """Complete each prompt (text, encoded as is, or a list of token ids) with any engine's
    model (through its `make_decoder`); results in input order."""
    encoded = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if not encoded:
        return []
    gen = Generator(model.make_decoder(min(batch, len(encoded)), max(map(len, encoded)) + max_tokens), tokenizer)
    for i, ids in enumerate(encoded):
        gen.add(Request(str(i), ids, max_tokens, temperature, top_p, seed))
    results: dict[str, Result] = {}
    while gen.active:
        for r in gen.step():
            results[r.key] = r
    return [results[str(i)] for i in range(len(encoded))]
