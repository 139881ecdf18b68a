"""A sharded row job's records over its state (runtime/state/jobstate.py owns the layout):
each shard's own state under shards/<I>/, the marker that a shard is done, and the
exactly-once merge (the claim, the merged outputs, the merge record written last)."""

from __future__ import annotations

import orjson

from runtime.state.records import Commit
from runtime.state.uri import open_store

SHARD_DONE = "shard-done"  # marker kind: every row of this shard is committed
MERGED = "merged.json"
MERGE_CLAIM = "merge-claim.json"


class Shards:
    def __init__(self, state):
        self.state = state

    def shard(self, index: int, identity: dict | None = None):
        """Shard `index`'s own state, under this one (`identity` None: to read it, not to open it)."""
        return type(self.state)(open_store(self.state.store.child_uri(f"shards/{index}")), identity or {}, engine=self.state.engine)

    def done(self) -> Commit | None:
        done = self.state.markers(SHARD_DONE)
        return done[-1] if done else None

    def mark_done(self, rows: int) -> None:
        self.state.commit_marker(SHARD_DONE, {"rows": rows})
        self.state.log("shard-done", rows=rows)

    def claim_merge(self, shard: int | None) -> bool:
        """Created exclusively (and naming this process, so no two claims are the same bytes):
        True for the one process that merges."""
        return self.state.store.create(MERGE_CLAIM, orjson.dumps(self.state.stamp({"shard": shard})))

    def merge_claim(self) -> dict | None:
        return self.state.read_json(MERGE_CLAIM)

    def write_output(self, name: str, data: bytes) -> None:
        self.state.store.write(name, data)

    def output(self, name: str) -> bytes | None:
        return self.state.store.read(name)

    def merge_record(self) -> dict | None:
        return self.state.read_json(MERGED)

    def record_merge(self, meta: dict) -> bool:
        """Written last, created exclusively: True for the one process whose record it is."""
        return self.state.store.create(MERGED, orjson.dumps(self.state.stamp(meta), option=orjson.OPT_INDENT_2))
