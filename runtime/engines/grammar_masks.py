"""Constrained decoding's half inside the generator: llguidance matchers and their token masks.

One `Grammars` per Generator: the tokenizer as llguidance sees it (built once, from the
tokenizer.json the job already reads; no transformers), a compiled matcher per distinct
grammar that new rows copy (rows with the same schema compile it once), and a parallel
executor that fills every constrained row's mask for a step in one call with the GIL released.
Masks are numpy booleans over the logits' width: the same on torch and MLX, because the
generator's sampling is numpy on every engine.
"""

from __future__ import annotations

import numpy as np


# llguidance's view of a tokenizer takes seconds for a 50k vocabulary: made once per process and
# tokenizer (a job's Generator, and each generator a benchmark or a test makes after it).
_TOKENIZERS: dict[tuple, object] = {}


class Grammars:
    CACHE = 64  # distinct grammars kept compiled

    def __init__(self, tokenizer):
        import llguidance

        self._ll = llguidance
        backend = tokenizer.backend
        # One end token for the grammar (llguidance 1.6 takes one): the tokenizer's own eos when it
        # names one. The generator ends a row on any of its end tokens, and as soon as the grammar
        # is complete, so the others need no place in the mask.
        named = tokenizer.special_tokens.get("eos_token")
        eos = tokenizer.token_to_id(named) if named else None
        if eos is None and tokenizer.eos_token_ids:
            eos = min(tokenizer.eos_token_ids)
        self.vocab = backend.get_vocab_size(with_added_tokens=True)
        key = (str(tokenizer.path), self.vocab, eos)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab, eos_token=eos)
        self.tokenizer = _TOKENIZERS[key]
        self.executor = llguidance.LLExecutor()
        self._compiled: dict[str, object] = {}

    def matcher(self, grammar: str):
        """A fresh matcher for one row (a copy of the grammar's compiled one)."""
        base = self._compiled.get(grammar)
        if base is None:
            base = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
            if len(self._compiled) >= self.CACHE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[grammar] = base
        return base.deep_copy()

    def allowed(self, rows: list[tuple[int, object]], width: int) -> np.ndarray:
        """(n, width) booleans: for each (index, matcher), the tokens its grammar allows next.
        Ids past the tokenizer's vocabulary (a model's padded embedding) are never allowed."""
        n = max(i for i, _ in rows) + 1
        words = (self.vocab + 31) // 32
        bits = np.zeros((n, words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in rows], bits.ctypes.data, words * 4, n)
        flat = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : min(width, self.vocab)].astype(bool)
        if width > flat.shape[1]:
            flat = np.pad(flat, ((0, 0), (0, width - flat.shape[1])))
        return flat
