"""Which adapter each token of a forward belongs to, and the tokens grouped by adapter: the one
record both engines' multi_lora.py read (many LoRA adapters over one base in one batch).

The decoder sets it before each forward (PrefixPrefill._adapt); every wrapped linear of every
layer reads the same groups, so the grouping runs once per forward, not once per linear. It is
plain numpy; an engine's subclass turns each group's rows into its own index (`index`).
"""

from __future__ import annotations

import numpy as np

BASE = -1  # a row answered by the base model, no adapter


class TokenAdapters:
    """`ids`: each token's adapter in the forward's flattened (B*T) order; `single`: the one adapter
    of every token, when there is one (then no groups); else `groups`: (adapter, token rows as
    numpy, the engine's index of them) for each adapter present, BASE left out."""

    def __init__(self):
        self.ids = np.zeros(0, dtype=np.int64)
        self.groups: list[tuple[int, np.ndarray, object]] = []
        self.single: int | None = None

    def set(self, ids) -> None:
        self.ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.single, self.groups = self.grouped(self.ids)

    def grouped(self, ids: np.ndarray):
        """(single, groups) of the tokens `ids` names."""
        present = np.unique(ids)
        if len(present) == 1:
            return int(present[0]), []
        groups = []
        for a in present.tolist():
            if a != BASE:
                rows = np.flatnonzero(ids == a)
                groups.append((a, rows, self.index(rows)))
        return None, groups

    def index(self, rows: np.ndarray):
        """The engine's index of these token rows (a device tensor, an mx.array)."""
        return rows


def updates_by_module(adapters: list[tuple[dict, object]], as_array) -> dict[str, dict[int, tuple]]:
    """Each targeted linear's updates: module name -> {adapter index: (A (r, in), B (out, r), scale)},
    `adapters` ((tensors, LoraSpec) each, PEFT's canonical names) in index order, each A and B
    made an engine's float32 array by `as_array`. What both engines' apply_adapters wrap."""
    out: dict[str, dict[int, tuple]] = {}
    for i, (tensors, spec) in enumerate(adapters):
        for name in sorted({k.rsplit(".lora_", 1)[0] for k in tensors}):
            A, B = (as_array(tensors[f"{name}.lora_{x}.weight"]) for x in "AB")
            out.setdefault(name, {})[i] = (A, B, spec.scale)
    return dict(sorted(out.items()))
