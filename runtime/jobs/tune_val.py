"""A tune's validation: the held-out loss every --eval-every steps, the best adapter by that
loss kept beside the last, and --early-stop's patience.

The held-out pass is a quantum of its own in the job's loop (runtime/core/job.py): it runs
after the step that made it due, may be abandoned like a step (nothing is lost: it is pending
again in the checkpoint) and settles into the tracker. The tracker (every eval so far, the
best step and its loss, the evals without improvement, a pass still pending) and the best
adapter's tensors are part of each checkpoint, so a resumed job keeps, compares and stops
exactly as an uninterrupted one.
"""

from __future__ import annotations

import time

import numpy as np

from runtime.data.validation import eval_batches

BEST_PREFIX = "best."  # the best adapter's tensors in a checkpoint's state.safetensors


class Validation:
    def __init__(self, data, every: int, patience: int | None, micro_batch: int, pad_id: int):
        self.data, self.every, self.patience = data, every, patience
        self.batches = eval_batches(data.examples, micro_batch, pad_id)
        self.tokens = sum(len(e.ids) for e in data.examples)
        self.evals: list[dict] = []  # {"step", "val_loss", "tokens", "seconds"}
        self.best_step: int | None = None
        self.best_loss: float | None = None
        self.best: dict[str, np.ndarray] | None = None  # the best adapter's canonical tensors
        self.bad = 0  # evals in a row without improvement
        self.pending = False  # the step that made a pass due has settled; the pass has not
        self.stopped_early = False
        self._result = None

    def due(self, done: int, total: int) -> bool:
        return done > 0 and (done % self.every == 0 or done == total)

    def run(self, session) -> None:
        """The abandonable part: the forward passes."""
        t0 = time.perf_counter()
        loss_sum, targets = session.evaluate(self.batches)
        self._result = (loss_sum, targets, time.perf_counter() - t0)

    def settle(self, step: int, session) -> dict:
        """Record the pass just run; returns the `eval` event's fields."""
        loss_sum, targets, seconds = self._result
        self._result = None
        self.pending = False
        loss = loss_sum / max(1, targets)
        if self.best_loss is None or loss < self.best_loss:
            self.best_step, self.best_loss, self.best, self.bad = step, loss, session.adapter(), 0
        else:
            self.bad += 1
        if self.patience and self.bad >= self.patience:
            self.stopped_early = True
        record = {"step": step, "val_loss": loss, "tokens": self.tokens, "targets": targets, "seconds": round(seconds, 4)}
        self.evals.append(record)
        return {**record, "best_step": self.best_step, "best_val_loss": self.best_loss, "bad_evals": self.bad,
                "stopped_early": self.stopped_early}

    # -- in a checkpoint ---------------------------------------------------------------

    def to_meta(self) -> dict:
        return {"evals": self.evals, "best_step": self.best_step, "best_val_loss": self.best_loss, "bad": self.bad,
                "pending": self.pending, "stopped_early": self.stopped_early}

    def tensors(self) -> dict[str, np.ndarray]:
        return {BEST_PREFIX + k: v for k, v in (self.best or {}).items()}

    def restore(self, meta: dict | None, tensors: dict) -> None:
        meta = meta or {}
        self.evals = list(meta.get("evals") or [])
        self.best_step, self.best_loss = meta.get("best_step"), meta.get("best_val_loss")
        self.bad, self.pending = int(meta.get("bad") or 0), bool(meta.get("pending"))
        self.stopped_early = bool(meta.get("stopped_early"))
        best = {k[len(BEST_PREFIX):]: v for k, v in tensors.items() if k.startswith(BEST_PREFIX)}
        self.best = best or None
