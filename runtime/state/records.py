"""A commit record as the state's protocols read it, and where record number `seq` lives
(runtime/state/jobstate.py writes and reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Commit:
    seq: int
    kind: str  # "checkpoint" | "segment" | "stage"
    step: int  # steps done (checkpoint) or rows in the segment
    files: dict  # name -> {"key", "size", "sha256"}
    meta: dict
    identity: dict | None = None  # the job's identity (None in records written before it travelled with them)
    log: list = field(default_factory=list)  # the log's chunks from the start, as files: {"key", "size", "sha256"}


def record_key(seq: int) -> str:
    return f"commits/{seq:08d}.json"
