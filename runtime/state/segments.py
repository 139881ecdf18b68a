"""Row segments over a job's state (runtime/state/jobstate.py owns the layout): a row job's
finished rows, committed in segments; a segment exists once its commit record does."""

from __future__ import annotations

import time

from runtime.state.records import Commit


class Segments:
    def __init__(self, state):
        self.state = state

    def all(self) -> list[Commit]:
        return [c for c in self.state.commits() if c.kind == "segment" and self.state.complete(c)]

    def commit(self, rows_jsonl: bytes, count: int, meta: dict | None = None) -> tuple[Commit, float]:
        t0 = time.perf_counter()
        commit = self.state.commit("segment", count, {"rows": rows_jsonl}, "segments/", meta or {})
        seconds = time.perf_counter() - t0
        self.state.log("checkpoint", rows=count, seq=commit.seq, uri=self.state.store.child_uri(commit.files["rows"]["key"]), seconds=round(seconds, 3))
        return commit, seconds
