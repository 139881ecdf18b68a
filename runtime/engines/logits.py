"""A step's (n, V) logits, left where the engine computed them until the generator asks.

The generator needs every row's greedy argmax, and the full float32 row only for a row that
samples or carries options (penalties, a grammar, stop strings, logprobs). A decoder that
hands over a `Logits` instead of a numpy array lets the argmax run where the logits are: on a
GPU one (n,) copy a step instead of n x V floats, on a CPU's 16-bit base no (n, V) float32 copy
of them (SmolLM2-135M's 49,152 tokens at 32 rows: 6 MiB a step). `np.asarray(logits)` gives
them all as float32, as the oracles in the tests compare them.

This class holds numpy logits (the MLX decoder's, and any decoder that returns an array);
runtime/engines/torch/decode.py's TorchLogits holds a torch tensor.
"""

from __future__ import annotations

import numpy as np


class Logits:
    def __init__(self, values):
        self.values = values  # (n, V)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def argmax(self) -> list[int]:
        """Each row's first maximum."""
        return self.values.argmax(-1).tolist()

    def row(self, n: int) -> np.ndarray:
        """Row n as numpy float32 (V,)."""
        return np.asarray(self.values[n], dtype=np.float32)

    def __getitem__(self, rows: slice) -> "Logits":
        return type(self)(self.values[rows])

    def take(self, order: list[int]) -> "Logits":
        """The rows in `order`."""
        return type(self)(self.values[np.asarray(order)])

    def join(self, others: list["Logits"]) -> "Logits":
        """These rows, then each of `others`' (of the same kind)."""
        return type(self)(np.concatenate([self.values, *(o.values for o in others)]))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.values, dtype=dtype or np.float32)


def as_logits(values) -> Logits:
    """A decoder's output as Logits: a numpy array is wrapped, Logits passes through."""
    return values if isinstance(values, Logits) else Logits(np.asarray(values, dtype=np.float32))
