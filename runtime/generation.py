"""Batched generation with a KV cache and continuous batching.

A fixed number of slots share one preallocated cache; each step advances every active slot
by one token, and a finished slot takes the next pending request at once. Sampling draws from
a per-request generator seeded from (seed, key), so a row's tokens do not depend on which
rows shared its batch: a resumed job reproduces the rows it redoes.

The scheduling here is engine-neutral; what touches the model is a decoder with three
methods (`prefill(slots, prompts) -> (n, V)` logits at each prompt's last token, `decode(slots,
last_tokens) -> (n, V)` for the running slots only, `release(slot)`): `TorchDecoder` below,
or the one a model provides with `make_decoder` (the MLX model does). Logits may be torch
tensors or numpy arrays.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.errors import SpillpackError


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


@dataclass
class _Row:
    request: Request
    rng: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


def request_generator(seed: int, key: str) -> torch.Generator:
    # A CPU generator on every engine: the same probabilities give the same draw on CUDA and CPU.
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator | None) -> int:
    """One token from (V,) logits: argmax at temperature 0, else temperature + nucleus sampling."""
    if temperature == 0:
        return int(logits.argmax())  # the first maximum, in torch and numpy alike
    logits = torch.as_tensor(np.asarray(logits)) if not isinstance(logits, torch.Tensor) else logits
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=rng))


class TorchDecoder:
    """The torch half of generation: batched prefill and decode over one KV cache of `slots` rows."""

    def __init__(self, model, slots: int, max_len: int):
        self.model = model
        self.cache = model.make_cache(slots, max_len)
        self.device = self.cache.k.device

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Start each prompt in its slot, right-padded into one forward; (n, V) logits at each prompt's end."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)  # (n, width)
        view = self.cache.view(slots)
        view.lengths.zero_()  # the slots' old keys are masked out, no need to clear them
        hidden = self.model.hidden_states(ids, cache=view)  # (n, width, D)
        # Pad tokens were written past each prompt's end: a length that stops at the prompt hides them.
        self.cache.lengths[view.index if view.index is not None else slice(None)] = lengths
        return self.model.logits(hidden[torch.arange(len(prompts), device=self.device), lengths - 1])  # (n, V)

    @torch.inference_mode()
    def decode(self, slots: list[int], last: list[int]) -> torch.Tensor:
        """One token for each of `slots` (its last token given); (n, V) logits."""
        view = self.cache.view(slots)
        logits = self.model(torch.tensor(last, device=self.device)[:, None], cache=view)[:, -1]
        if view.index is not None:
            self.cache.lengths[view.index] = view.lengths
        return logits

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0


class Generator:
    # A prefill group stops growing when padding would exceed this share of its tokens: one
    # forward for many prompts saves per-call overhead, padding costs compute.
    MAX_PAD_SHARE = 0.25

    def __init__(self, model, tokenizer, slots: int, max_len: int):
        assert slots >= 1 and max_len >= 2
        self.tokenizer = tokenizer
        self.slots, self.max_len = slots, max_len
        make = getattr(model, "make_decoder", None)
        self.decoder = make(slots, max_len) if make else TorchDecoder(model, slots, max_len)
        self.rows: list[_Row | None] = [None] * slots
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

    def _push(self, slots: list[int], logits, finished: list[Result]) -> None:
        """Each slot's next token from its row of (n, V) logits; finished rows leave their slots."""
        # Greedy rows take one argmax over the batch (on the device), sampled rows draw their own.
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
    """Complete each prompt (text, encoded as is, or a list of token ids); results in input order."""
    encoded = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if not encoded:
        return []
    gen = Generator(model, tokenizer, slots=min(batch, len(encoded)), max_len=max(map(len, encoded)) + max_tokens)
    for i, ids in enumerate(encoded):
        gen.add(Request(str(i), ids, max_tokens, temperature, top_p, seed))
    results: dict[str, Result] = {}
    while gen.active:
        for r in gen.step():
            results[r.key] = r
    return [results[str(i)] for i in range(len(encoded))]
