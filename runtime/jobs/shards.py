"""A row job split over many workers: which rows a shard does, which shard a process is, and the
merge that happens exactly once.

- Rows are split into N contiguous blocks by position (shard I does rows [I*n//N, (I+1)*n//N)),
  so a worker's rows depend only on the input and N, never on timing. N (--shards) is part of
  the job's identity; the request ids in the output are not (they hash the job without N), so
  the merged file is byte-identical to what an unsharded run writes.
- Each shard is an ordinary row job in its own state (shards/I/ under the job's state, see
  runtime/state/jobstate.py): segment commits, resume, SIGTERM -> 75 and SIGKILL alike. When
  every one of its rows is committed it commits a "shard-done" marker.
- The worker that finds every shard done merges, once it has created merge-claim.json
  exclusively (Store.create: a hard link locally, a conditional PUT on S3; the claim names its
  process, so two claims are never the same bytes): of two workers finishing together exactly one
  writes. It builds the output in input order, writes results.jsonl, the task's other outputs and
  --out (each atomically: whole or absent), then creates merged.json, last. A merge cut short
  (a claim and no record) is completed by a rerun of any shard whose rows were all committed
  already, or by `spillpack resume STATE` (a process without a shard index only merges); a
  worker that has just finished its own shard leaves a claim to the process that made it. The output is a pure
  function of the committed rows, so completing writes the same bytes even if the first merger
  is still alive.

Which shard a process is: --shard I, else the first of these that is set (docs/environment.md):
SPILLPACK_SHARD, SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN (a Slurm array), JOB_COMPLETION_INDEX
(a Kubernetes Indexed Job), SKYPILOT_NODE_RANK (a multi-node SkyPilot task).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from runtime.base.errors import SpillpackError
from runtime.base.fileio import sha256_bytes
from runtime.state.jobstate import JobState
from runtime.state.uri import uri_exists, write_uri

RESULTS = "results.jsonl"  # the output under the state, as an unsharded row job writes it
# The scheduler variables that carry a worker's index, in the order they are believed.
INDEX_ENV = ("SPILLPACK_SHARD", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", "SKYPILOT_NODE_RANK")
# Tests only: DIR:N makes N processes meet right before the merge, each having committed its
# shard, and again right before the claim, so two workers finishing at the same moment is a
# real race for the exclusive create that happens every time.
BARRIER_ENV = "SPILLPACK_TEST_MERGE_BARRIER"


@dataclass(frozen=True)
class Plan:
    count: int  # N, the job's shard count
    index: int | None  # this process's shard; None: it only completes the merge
    source: str | None = None  # where the index came from: --shard or the variable's name

    def range(self, total: int, index: int | None = None) -> tuple[int, int]:
        i = self.index if index is None else index
        return total * i // self.count, total * (i + 1) // self.count


def plan(options: dict, command: str, env=None) -> Plan:
    """The shard this process does, checked against the job's shard count before anything is written."""
    n = options.get("shards") or 1
    if n == 1:
        return Plan(1, 0)
    if options.get("shard") is not None:
        return Plan(n, options["shard"], "--shard")
    env = os.environ if env is None else env
    for name in INDEX_ENV:
        raw = env.get(name)
        if raw in (None, ""):
            continue
        try:
            index = int(raw) - (int(env.get("SLURM_ARRAY_TASK_MIN") or 0) if name == "SLURM_ARRAY_TASK_ID" else 0)
        except ValueError:
            raise SpillpackError(f"{name}={raw!r} is not a shard index (a whole number)", f"spillpack {command} ... --shard 0")
        if not 0 <= index < n:
            raise SpillpackError(f"shard {index} (from {name}={raw}) is out of range: this job has {n} shards, numbered 0 to {n - 1}",
                                 f"spillpack {command} ... --shards {n}, or an array of {n} tasks (0-{n - 1})")
        return Plan(n, index, name)
    return Plan(n, None)


def shard_identity(identity: dict, p: Plan, total: int) -> dict:
    lo, hi = p.range(total)
    return {**identity, "shard": p.index, "rows": [lo, hi]}


@dataclass
class Merged:
    record: dict | None  # merged.json, once the job's output exists
    by_me: bool = False
    missing: list | None = None  # shards not done yet
    seconds: float = 0.0


class Merger:
    """The exactly-once merge of a sharded row job's output (see the module's docstring)."""

    def __init__(self, root: JobState, p: Plan, task, rows, out: str | None, events):
        self.root, self.plan, self.task, self.rows, self.out, self.events = root, p, task, rows, out, events

    def shards(self) -> list[JobState]:
        return [self.root.shards.shard(i) for i in range(self.plan.count)]

    def missing(self) -> list[int]:
        return [i for i, s in enumerate(self.shards()) if s.shards.done() is None]

    def attempt(self, complete: bool) -> Merged:
        """`complete`: this process may complete a merge another one claimed and did not record
        (it started with nothing of its own to do: a rerun of a finished shard, or a process
        without a shard); a worker that has just finished its shard leaves a claim to its owner."""
        _barrier("enter")
        record = self.root.shards.merge_record()
        if record is not None:
            return Merged(record)
        missing = self.missing()
        if missing:
            return Merged(None, missing=missing)
        t0 = time.perf_counter()
        # A claim with no record: its merger is finishing right now, or was killed. Completing
        # it writes the same bytes, so either way the result is one merge; but only a process
        # with nothing else to do completes it, not one that merely finished at the same moment.
        cut_short = self.root.shards.merge_claim() is not None
        if cut_short and not complete:
            return Merged(self.root.shards.merge_record())
        if not cut_short:
            _barrier("claim")
        if not cut_short and not self.root.shards.claim_merge(self.plan.index):
            return Merged(self.root.shards.merge_record())  # another worker finished at the same moment: it merges
        output = self.task.finish(self.rows, self._lines())
        self.root.shards.write_output(RESULTS, output.data)
        for name, data in output.extra.items():
            self.root.shards.write_output(name, data)
        self.deliver(output.data)
        seconds = time.perf_counter() - t0
        meta = {"rows": len(self.rows), "shards": self.plan.count, "shard": self.plan.index, "summary": output.summary,
                "sha256": sha256_bytes(output.data), "seconds": round(seconds, 3), "completed_cut_short": cut_short}
        mine = self.root.shards.record_merge(meta)
        if mine:
            self.root.log("merged", shard=self.plan.index, rows=len(self.rows), seconds=round(seconds, 3),
                          uri=self.root.store.child_uri(RESULTS), completed_cut_short=cut_short)
            self.events.emit("merged", step=len(self.rows), shard=self.plan.index, shards=self.plan.count,
                             uri=self.root.store.child_uri(RESULTS), out=self.out, seconds=round(seconds, 3))
            if output.message:
                self.events.say(output.message)
        return Merged(self.root.shards.merge_record(), by_me=mine, seconds=seconds)

    def deliver(self, data: bytes | None = None) -> None:
        """--out: written when absent; the same bytes there already are fine (a completed merge)."""
        if not self.out:
            return
        data = self.root.shards.output(RESULTS) if data is None else data
        if not uri_exists(self.out):
            write_uri(self.out, data)

    def _lines(self) -> list[dict]:
        """Every row's output line, in input order, read from the shards' committed segments."""
        lines: dict[str, dict] = {}
        total = len(self.rows)
        for i, state in enumerate(self.shards()):
            lo, hi = self.plan.range(total, i)
            known = {r.custom_id for r in self.rows[lo:hi]}
            for seg in state.rows.all():
                for raw in state.read_file(seg, "rows").splitlines():
                    rec = orjson.loads(raw)
                    if rec["custom_id"] in known:
                        lines.setdefault(rec["custom_id"], rec)
        lost = [r.custom_id for r in self.rows if r.custom_id not in lines]
        if lost:
            raise SpillpackError(f"the shards of {self.root.uri} are marked done but {len(lost)} rows have no committed result "
                                 f"(first: {lost[0]!r}): the state was changed by hand",
                                 f"delete the shard-done markers under {self.root.store.child_uri('shards/')} and rerun the shards")
        return [lines[r.custom_id] for r in self.rows]


def _barrier(point: str) -> None:
    """Tests make two workers finish at the same moment: each waits at `point` until N have
    arrived (at "enter" each has committed its shard; at "claim" each has found no claim)."""
    spec = os.environ.get(BARRIER_ENV)
    if not spec:
        return
    where, _, n = spec.rpartition(":")
    d = Path(where) / point
    d.mkdir(parents=True, exist_ok=True)
    (d / str(os.getpid())).touch()
    end = time.monotonic() + 300
    while len(list(d.iterdir())) < int(n) and time.monotonic() < end:
        time.sleep(0.01)
