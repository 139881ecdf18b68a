"""Batched generation with a KV cache and continuous batching, framework-neutral (numpy only).

A fixed number of slots share one preallocated cache; each step advances every active slot
by one token, and a finished slot takes the next pending request at once. Sampling draws from
a per-request generator seeded from (seed, key), so a row's tokens do not depend on which
rows shared its batch: a resumed job reproduces the rows it redoes, on any engine.

What touches the model is a `Decoder`, one per engine (runtime/engines/<engine>/decode.py,
made by a model's `make_decoder(slots, max_len)`). It returns (n, V) logits, numpy float32 or
a `Logits` (runtime/engines/logits.py) that keeps them where the engine computed them: the
greedy argmax runs there (the first maximum, as numpy's), and a row that samples or has options
is copied out as float32 and handled here, the same code on every engine: the same logits give
the same tokens on torch and on MLX.

A request may also carry OpenAI's per-request options, all applied here to the numpy logits:
`presence_penalty` / `frequency_penalty` (subtracted from the logits before sampling),
`grammar` (an llguidance grammar from response_format: each step's logits are masked to the
tokens it allows), `stop` strings (the row ends at the first occurrence in its decoded text)
and `logprobs` (of the model's own distribution, before penalties and masks). A request with
none of them takes the plain path, unchanged.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from dataclasses import dataclass, field

from typing import Protocol

import numpy as np

from runtime.base.errors import SpillpackError
from runtime.engines.logits import Logits, as_logits


@dataclass
class Request:
    key: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str | None = None  # llguidance grammar text (runtime/data/grammars.py)
    adapter: int | None = None  # which of the decoder's adapters answers (-1: the base); None: the model as loaded

    @property
    def plain(self) -> bool:
        return not (self.stop or self.logprobs or self.presence_penalty or self.frequency_penalty or self.grammar)


@dataclass
class Result:
    key: str
    tokens: list[int]  # the completion, including the stop token when there is one
    text: str  # the completion decoded without special tokens
    finish_reason: str  # "stop" (an eos token) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # OpenAI's choices[0].logprobs.content, when the request asked


class Decoder(Protocol):
    """One engine's half of generation: a KV cache of `slots` rows of up to `max_len` tokens."""

    slots: int
    max_len: int

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> np.ndarray | Logits:
        """Start each prompt in its slot (the slot's old keys are dropped); (n, V) logits at
        each prompt's last token."""

    def decode(self, slots: list[int], last: list[int]) -> np.ndarray | Logits:
        """One token for each of `slots`, its last token given; (n, V) logits."""

    def release(self, slot: int) -> None:
        """The slot's row is done; the next prefill may reuse it."""


@dataclass
class _Row:
    request: Request
    rng: np.random.Generator | None
    tokens: list[int] = field(default_factory=list)
    plain: bool = True
    counts: dict[int, int] = field(default_factory=dict)  # completion token -> times generated (penalties)
    matcher: object = None  # llguidance.LLMatcher, when the request has a grammar
    logprobs: list | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def penalize(logits: np.ndarray, counts: dict[int, int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's penalties: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, over the
    tokens generated so far (not the prompt's). float64, as sampling is."""
    x = np.array(logits, dtype=np.float64)
    if counts:
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        c = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        x[ids] -= c * frequency + presence
    return x


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
        self._grammars = None  # runtime/engines/grammar_masks.py, made for the first constrained row
        self._token_bytes = None  # id -> bytes, made for the first row that asks for logprobs

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
        running = [i for i, r in enumerate(self.rows) if r is not None]
        free = [i for i, r in enumerate(self.rows) if r is None]
        starting = self._starting(free)
        # Where the decoder can, the requests that free slots take start inside the running rows'
        # decode step, one forward for both (decode_and_prefill; with no row running, a prefill
        # of the prompts packed end to end, without padding)...
        if starting and self._packs(starting, len(running)):
            for _ in starting:
                self.pending.popleft()
            slots = free[: len(starting)]
            self._assign(slots, starting)
            decoded, started = self.decoder.decode_and_prefill(
                running, [self.rows[i].tokens[-1] for i in running], slots, [r.prompt_ids for r in starting])
            self._push(running, decoded, finished)
            for slot, req in zip(slots, starting):
                self.rows[slot] = self._start_row(req)
            self._push(slots, started, finished)
            return finished
        # ...else the running rows decode one token each, and empty slots start pending requests
        # in a prefill, whose logits give their first token. A slot this step's decode freed waits
        # for the next step where its request can start inside that step's forward. One round per
        # step, even when requests finish at their prefill: a step is the quantum a preemption may
        # abandon and after which rows are committed, so it stays bounded.
        if running:
            logits = self.decoder.decode(running, [self.rows[i].tokens[-1] for i in running])
            self._push(running, logits, finished)
        free = [i for i, r in enumerate(self.rows) if r is None]
        starting = self._starting(free)
        if starting and not self._packs(starting, self.slots - len(free)):
            for _ in starting:
                self.pending.popleft()
            for group in self._prefill_groups(starting):
                slots = [free.pop(0) for _ in group]
                self._assign(slots, group)
                for slot, req in zip(slots, group):
                    self.rows[slot] = self._start_row(req)
                self._push(slots, self.decoder.prefill(slots, [r.prompt_ids for r in group]), finished)
        return finished

    def _assign(self, slots: list[int], requests: list[Request]) -> None:
        """Tell a decoder of many adapters which one each slot's new request answers with."""
        if any(r.adapter is not None for r in requests):
            self.decoder.use_adapters(slots, [-1 if r.adapter is None else r.adapter for r in requests])

    def _starting(self, free: list[int]) -> list[Request]:
        """The pending requests the free slots would take now, shortest prompt first (not yet taken)."""
        return sorted(list(itertools.islice(self.pending, len(free))), key=lambda r: len(r.prompt_ids))

    def _packs(self, starting: list[Request], decoding: int) -> bool:
        """Whether the decoder can start these requests inside a decode step of `decoding` rows (a
        torch decoder on a CPU's float32 base can: runtime/engines/torch/decode.py)."""
        packs = getattr(self.decoder, "packs", None)
        return packs is not None and packs([r.prompt_ids for r in starting], decoding)

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

    def _start_row(self, req: Request) -> _Row:
        row = _Row(req, request_generator(req.seed, req.key) if req.temperature > 0 else None, plain=req.plain)
        if req.grammar is not None:
            if self._grammars is None:
                from runtime.engines.grammar_masks import Grammars

                self._grammars = Grammars(self.tokenizer)
            row.matcher = self._grammars.matcher(req.grammar)
        if req.logprobs:
            row.logprobs = []
        return row

    def _push(self, slots: list[int], logits: np.ndarray | Logits, finished: list[Result]) -> None:
        """Each slot's next token from its row of (n, V) logits; finished rows leave their slots."""
        # Greedy rows take one argmax over the batch (where the engine holds the logits), sampled
        # rows and rows with options their own row as float32.
        logits = as_logits(logits)
        greedy = logits.argmax()
        allowed = None
        if self._grammars is not None:  # only once a constrained row has started
            constrained = [(n, self.rows[slot].matcher) for n, slot in enumerate(slots) if self.rows[slot].matcher is not None]
            allowed = self._grammars.allowed(constrained, logits.shape[1]) if constrained else None
        for n, slot in enumerate(slots):
            row = self.rows[slot]
            req = row.request
            if row.plain:  # the path of a row without options, as before they existed
                token = greedy[n] if req.temperature == 0 else sample(logits.row(n), req.temperature, req.top_p, row.rng)
                row.tokens.append(token)
                reason = "stop" if token in self.eos else "length" if len(row.tokens) >= req.max_tokens else None
                if reason is not None:
                    self._finish(slot, row, reason, None, finished)
                continue
            token = self._choose(row, logits.row(n), allowed[n] if row.matcher is not None else None, greedy[n])
            row.tokens.append(token)
            text = None
            if token in self.eos:
                reason = "stop"
            elif req.stop and (text := self._stopped_text(row)) is not None:
                reason = "stop"
            elif row.matcher is not None and row.matcher.is_stopped():
                reason = "stop"  # the grammar is complete: nothing but an end may follow
            else:
                reason = "length" if len(row.tokens) >= req.max_tokens else None
            if reason is not None:
                self._finish(slot, row, reason, text, finished)

    def _finish(self, slot: int, row: _Row, reason: str, text: str | None, finished: list[Result]) -> None:
        """The row's Result (its text decoded without a final end token unless given), and its slot freed."""
        req = row.request
        if text is None:
            text = self.tokenizer.decode(row.tokens[:-1] if row.tokens[-1] in self.eos else row.tokens)
        finished.append(Result(
            key=req.key, tokens=row.tokens, text=text, finish_reason=reason,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(row.tokens), logprobs=row.logprobs,
        ))
        self.rows[slot] = None
        self.decoder.release(slot)

    def _choose(self, row: _Row, logits: np.ndarray, allowed: np.ndarray | None, greedy: int) -> int:
        """The next token of a request with options: penalties, then the grammar's mask, then
        argmax or sampling; its logprobs from the unmodified logits."""
        req = row.request
        x = logits
        if req.presence_penalty or req.frequency_penalty:
            x = penalize(x, row.counts, req.presence_penalty, req.frequency_penalty)
        if allowed is not None:
            x = np.where(allowed, x, -np.inf)
            if not allowed.any():  # the grammar allows nothing (its own error): end the row
                x = np.where(np.isin(np.arange(len(x)), list(self.eos)), 0.0, -np.inf)
        if x is logits:
            token = greedy if req.temperature == 0 else sample(x, req.temperature, req.top_p, row.rng)
        else:
            token = int(np.argmax(x)) if req.temperature == 0 else sample(x, req.temperature, req.top_p, row.rng)
        row.counts[token] = row.counts.get(token, 0) + 1
        if row.matcher is not None and token not in self.eos:
            row.matcher.consume_token(token)
        if row.logprobs is not None and token not in self.eos:
            row.logprobs.append(self._logprob_entry(logits, token, req.top_logprobs))
        return token

    def _entry(self, token: int, logprob: float) -> dict:
        if self._token_bytes is None:
            from runtime.models.token_bytes import byte_table

            self._token_bytes = byte_table(self.tokenizer.backend)
        raw = self._token_bytes[token] if token < len(self._token_bytes) and self._token_bytes[token] is not None else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _logprob_entry(self, logits: np.ndarray, token: int, top: int) -> dict:
        """OpenAI's ChatCompletionTokenLogprob: the chosen token and the `top` most likely ones."""
        lp = log_softmax(logits)
        entry = self._entry(token, float(lp[token]))
        best = []
        if top:
            candidates = np.argpartition(-lp, top - 1)[:top] if top < len(lp) else np.arange(len(lp))
            best = sorted(candidates.tolist(), key=lambda i: (-lp[i], i))[:top]
        entry["top_logprobs"] = [self._entry(i, float(lp[i])) for i in best]
        return entry

    def _stopped_text(self, row: _Row) -> str | None:
        """The completion cut before its first stop string, once one has appeared; else None.
        The decoded text is searched, so a stop string may span tokens and end mid-token."""
        text = self.tokenizer.decode(row.tokens)
        hits = [i for s in row.request.stop if (i := text.find(s)) >= 0]
        return text[:min(hits)] if hits else None


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
