"""Held-out rows for a tune's validation loss: `--val FILE`, or `--val-fraction F` of the
training file, chosen by a seeded hash of each row's bytes. The hash depends on nothing but
the row and the seed, so the split is the same on every machine, engine and resume, and a
row keeps its side when other rows are added or reordered.
"""

from __future__ import annotations

import hashlib

import numpy as np

from runtime.data.train import Example, TrainData, collate, load_train_data


def held_out(line: bytes, seed: int, fraction: float) -> bool:
    """Whether this JSONL row (its bytes, surrounding whitespace ignored) is a validation row."""
    digest = hashlib.sha256(b"spillpack-val\0" + str(seed).encode() + b"\0" + line.strip()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


def load_split(uri: str, tokenizer, max_seq: int, fraction: float, seed: int, bundle=None) -> tuple[TrainData, TrainData]:
    """(training rows, held-out rows) of one file; each side must keep at least one row."""
    train = load_train_data(uri, tokenizer, max_seq, bundle, select=lambda line: not held_out(line, seed, fraction))
    val = load_train_data(uri, tokenizer, max_seq, bundle, select=lambda line: held_out(line, seed, fraction),
                          what="validation rows of")
    return train, val


def eval_batches(examples: list[Example], size: int, pad_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The held-out rows in micro-batches of `size`, grouped by length so little is padding
    (the loss is a sum over target tokens, so neither order nor grouping changes it)."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), i))
    return [collate([examples[i] for i in order[s:s + size]], pad_id) for s in range(0, len(order), size)]
