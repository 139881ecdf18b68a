"""Checkpoints over a job's state (runtime/state/jobstate.py owns the layout): the newest
complete one, a new one committed, and the pruning that keeps the newest KEEP of them."""

from __future__ import annotations

import time

from runtime.state.records import Commit, record_key

KEEP = 2


class Checkpoints:
    def __init__(self, state):
        self.state = state

    def latest(self) -> Commit | None:
        for c in reversed(self.state.commits()):
            if c.kind == "checkpoint" and self.state.complete(c):
                return c
        return None

    def commit(self, step: int, files: dict[str, bytes], meta: dict | None = None, log: bytes = b"") -> tuple[Commit, float]:
        """`log`: what this checkpoint adds to the log since the one before it."""
        t0 = time.perf_counter()
        commit = self.state.commit("checkpoint", step, files, "checkpoints/", meta or {}, log)
        seconds = time.perf_counter() - t0
        self.state.log("checkpoint", step=step, seq=commit.seq, uri=self.state.store.child_uri(record_key(commit.seq)), seconds=round(seconds, 3))
        self.prune()
        return commit, seconds

    def prune(self) -> None:
        commits = self.state.commits()
        checkpoints = [c for c in commits if c.kind == "checkpoint"]
        for old in checkpoints[:-KEEP]:
            # The record goes first: a record never points at files that are already gone.
            self.state.store.delete(record_key(old.seq))
            for f in old.files.values():
                self.state.store.delete(f["key"])
        kept = checkpoints[-KEEP:]
        if not kept:
            return
        # Files of checkpoints older than the oldest kept one that no record references: a
        # process that died (or lost a race) before its commit record. A writer still in
        # flight at such a number cannot commit it any more, so nothing live is removed.
        referenced = {f["key"] for c in commits for f in [*c.files.values(), *c.log]}
        oldest = kept[0].seq
        for prefix in ("checkpoints/", "log/"):
            for key in self.state.store.list(prefix):
                seq = key[len(prefix):].split("-", 1)[0]
                if seq.isdigit() and int(seq) < oldest and key not in referenced:
                    self.state.store.delete(key)
