"""A job's state under its --state URI: the one owner of its layout (identity, commit records,
markers, invocation, progress hints, history). The protocols over it each have a module:
checkpoints (runtime/state/checkpoints.py), row segments (segments.py), a sharded row job's
shards and merge (shardstate.py); JobState holds one of each (state.checkpoints, state.rows,
state.shards).

Layout:
    job.json                          what job this state belongs to (refused if another job opens it)
    commits/<seq>.json                commit records, written last, created exclusively
    checkpoints/<seq>-<writer>/...    a checkpoint's files (tensors, cursor)
    log/<seq>-<writer>.jsonl          an append-only log in chunks (a tune's losses): each checkpoint's
                                      record lists the chunks from the start, so pruning never loses one
    segments/<seq>-<writer>.jsonl     a segment of finished rows
    history/<time>-<host>-<pid>-<n>.json   the job's life: opens, interruptions, checkpoints, resumes
    invocation.json                   the resolved config of the newest run (what `spillpack resume` runs)
    progress/<writer>.json            how far each process got, overwritten now and then: after a
                                      hard kill, `spillpack status` tells how much work was repeated
    trackers/<tracker>.json           the tracker run a --report-to job logs to (log dir, run id),
                                      created exclusively by the first process that reports to it
  a row job split with --shards N (runtime/jobs/shards.py) also has:
    shards/<I>/...                    shard I's own state, the same layout as above (its job.json adds
                                      the shard, its rows and the job's shard count); a "shard-done"
                                      marker commit once every row of it is committed
    merge-claim.json                  created exclusively by the one process that merges
    results.jsonl (and the task's other outputs)   the merged output, written by that process
    merged.json                       the merge record, created exclusively, written last

A checkpoint or segment exists only once its commit record does. Files written by a
process that died before committing are never referenced and are ignored, and so is a torn
or empty record: the next commit takes a sequence number past it. Commit records are
created with `Store.create`, so when two processes run the same job at once exactly one
wins each sequence number and the other stops with one line instead of interleaving.

Every commit record carries the job's identity as job.json does, so a state whose job.json
was lost or damaged is still checked against the job that opens it. A state whose every
process failed before a first commit (nothing but job.json and its story, each process ending
in a "failed" record) holds no work: another job's job.json there is replaced, so a corrected
command is never refused.
"""

import os
import socket
import time
import uuid

import orjson

from runtime.base.errors import SpillpackError
from runtime.base.fileio import sha256_bytes
from runtime.state.checkpoints import Checkpoints
from runtime.state.records import Commit, record_key
from runtime.state.segments import Segments
from runtime.state.shardstate import Shards
from runtime.state.store import Store



class StateConflict(SpillpackError):
    pass


class JobState:
    def __init__(self, store: Store, identity: dict, engine: str | None = None, upgrade=None):
        self.store = store
        self.identity = identity
        self.upgrade = upgrade  # (identity in job.json, uri) -> today's form, or a SpillpackError
        self.engine = engine
        self.writer = uuid.uuid4().hex[:8]
        self.host = socket.gethostname()
        self._history_n = 0
        self._next_seq = 0
        self._log: list = []  # the log chunks of the checkpoint this process continues from
        self.checkpoints = Checkpoints(self)
        self.rows = Segments(self)
        self.shards = Shards(self)

    @property
    def uri(self) -> str:
        return self.store.uri

    # -- opening ------------------------------------------------------------------

    def open(self, log: bool = True, **about) -> None:
        """Claim the state for this job, or refuse if it holds another job. Writes nothing else
        (but the history's "open" record, unless `log` is False: a shard's process is told in its
        shard's history, not in the job's). `about`: more of this process for the history (its
        device and scheduler, a data-parallel group's world and hosts)."""
        self.store.check_writable()
        commits = self.commits()
        for c in commits:
            if c.identity is not None:
                self._check_identity(c.identity)
        theirs = self._job_json()
        if theirs is None and commits and all(c.identity is None for c in commits):
            raise SpillpackError(f"state {self.uri} has commits but no job.json, so which job they belong to cannot be checked",
                                 f"another --state (or delete {self.uri} to start over)")
        body = orjson.dumps(self.identity, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
        if theirs is None:
            if not self.store.create("job.json", body):
                theirs = self._job_json()
        if theirs is not None and theirs != self.identity:
            if commits or not self._only_failed_runs():
                self._check_identity(theirs)
            else:  # what runs that failed before their first commit left claims nothing
                self.store.write("job.json", body)
        self._next_seq = self._last_seq() + 1
        if log:
            self.log("open", engine=self.engine, pid=os.getpid(), **about)

    def claimed(self) -> dict | None:
        """The identity this state holds (job.json), or None when no job claimed it yet."""
        raw = self.store.read("job.json")
        try:
            return orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return None

    def resync(self) -> None:
        """After another process won a commit: the next commit takes the sequence number after its."""
        self._next_seq = self._last_seq() + 1

    def _only_failed_runs(self) -> bool:
        """True when the state holds nothing but its claim and its story (job.json, invocation.json,
        history/, progress/: no commit, no shards/ or stages/) and every process in that story
        failed (its "failed" record): no work, and no job running or stopped there on purpose."""
        story = ("history/", "progress/")
        if any(k not in ("job.json", "invocation.json") and not k.startswith(story) for k in self.store.list("")):
            return False
        history = self.history()
        writers = {r.get("writer") for r in history}
        return bool(writers) and writers <= {r.get("writer") for r in history if r.get("what") == "failed"}

    def _job_json(self) -> dict | None:
        raw = self.store.read("job.json")
        if raw is None:
            return None
        try:
            theirs = orjson.loads(raw)
        except orjson.JSONDecodeError:
            theirs = None
        if not isinstance(theirs, dict):
            raise SpillpackError(f"{self.store.child_uri('job.json')} is damaged (not a JSON object)",
                                 f"delete {self.store.child_uri('job.json')} (its commits carry the job's identity too), "
                                 "then run the same command again")
        return theirs

    def _check_identity(self, theirs: dict) -> None:
        if self.upgrade is not None:
            theirs = self.upgrade(theirs, self.uri)
        a, b = theirs.get("command"), self.identity.get("command")
        if a != b:
            raise SpillpackError(f"state {self.uri} holds a {a} job, not a {b} job",
                                 f"another --state for this {b} job (spillpack status {self.uri} tells that job's story)")
        for key in sorted(set(theirs) | set(self.identity)):
            a, b = theirs.get(key), self.identity.get(key)
            if a != b:
                raise SpillpackError(
                    f"state {self.uri} holds a different job: {key} is {_short(a)} there and {_short(b)} here",
                    f"the same options as that job, or another --state (or delete {self.uri} to start over)",
                )

    # -- commits ---------------------------------------------------------------------

    def commits(self) -> list[Commit]:
        out = []
        for key in self.store.list("commits/"):
            raw = self.store.read(key)
            try:
                r = orjson.loads(raw) if raw else None
                out.append(Commit(r["seq"], r["kind"], r["step"], r["files"], r.get("meta", {}), r.get("identity"), r.get("log", [])))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue  # a torn or foreign record is not a commit
        return sorted(out, key=lambda c: c.seq)

    def _last_seq(self) -> int:
        """The highest sequence number any record has taken, torn ones included: a torn record
        is passed over, never competed for."""
        seqs = [int(n) for key in self.store.list("commits/") if (n := key.rsplit("/", 1)[-1].split(".")[0]).isdigit()]
        return max(seqs, default=0)

    def complete(self, c: Commit) -> bool:
        return all(self.store.size(f["key"]) == f["size"] for f in [*c.files.values(), *c.log])

    def _write(self, key: str, data: bytes) -> dict:
        self.store.write(key, data)
        return {"key": key, "size": len(data), "sha256": sha256_bytes(data)}

    def commit(self, kind: str, step: int, files: dict[str, bytes], prefix: str, meta: dict, log: bytes = b"") -> Commit:
        seq = self._next_seq  # taken at open: a record another process made since is a conflict, never skipped
        described = {}
        for name, data in files.items():
            key = f"{prefix}{seq:08d}-{self.writer}/{name}" if kind != "segment" else f"{prefix}{seq:08d}-{self.writer}.jsonl"
            described[name] = self._write(key, data)
        chunks = self._log + ([self._write(f"log/{seq:08d}-{self.writer}.jsonl", log)] if log else []) if kind == "checkpoint" else []
        record = {"seq": seq, "kind": kind, "step": step, "files": described, "meta": meta, "identity": self.identity, "log": chunks,
                  "time": round(time.time(), 3), "host": self.host, "pid": os.getpid(), "engine": self.engine, "writer": self.writer}
        if not self.store.create(record_key(seq), orjson.dumps(record)):
            raise StateConflict(
                f"another process committed to {self.uri} at the same time (commit {seq}); this one stops so the two do not mix",
                "make sure one copy of the job runs, then run it again to continue from the newest commit",
            )
        self._next_seq = seq + 1
        if kind == "checkpoint":
            self._log = chunks
        return Commit(seq, kind, step, described, meta, self.identity, chunks)

    def commit_uri(self, commit: Commit) -> str:
        return self.store.child_uri(record_key(commit.seq))

    def file_uri(self, commit: Commit, name: str) -> str:
        return self.store.child_uri(commit.files[name]["key"])

    def read_file(self, commit: Commit, name: str) -> bytes:
        return self._read_checked(commit, commit.files[name])

    def read_log(self, commit: Commit) -> bytes:
        """The log up to checkpoint `commit`; the next checkpoints of this process continue it."""
        data = b"".join(self._read_checked(commit, f) for f in commit.log)
        self._log = list(commit.log)
        return data

    def _read_checked(self, commit: Commit, f: dict) -> bytes:
        data = self.store.read(f["key"])
        if data is None or len(data) != f["size"] or sha256_bytes(data) != f["sha256"]:
            raise SpillpackError(f"state file {self.store.child_uri(f['key'])} is damaged (its bytes do not match commit {commit.seq})",
                                 f"delete {self.store.child_uri(record_key(commit.seq))} to fall back to the previous commit")
        return data

    # -- small named records (a build's finished stages, final outputs) ---------------------

    def commit_marker(self, kind: str, meta: dict) -> Commit:
        return self.commit(kind, 0, {}, "markers/", meta)

    def markers(self, kind: str) -> list[Commit]:
        return [c for c in self.commits() if c.kind == kind]

    def stamp(self, meta: dict) -> dict:
        return {**meta, "time": round(time.time(), 3), "host": self.host, "pid": os.getpid(), "writer": self.writer}

    def read_json(self, key: str) -> dict | None:
        raw = self.store.read(key)
        try:
            return orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return None  # never torn (created whole); a foreign file is not a record

    # -- the invocation, and progress beyond the last commit ----------------------------------

    def save_invocation(self, config: dict) -> None:
        self.store.write("invocation.json", orjson.dumps(config, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2))

    def invocation(self) -> dict | None:
        raw = self.store.read("invocation.json")
        try:
            return orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return None

    def note_progress(self, done: int) -> None:
        """Not a commit: only a hint of how far this process got, for the history's story."""
        record = {"writer": self.writer, "pid": os.getpid(), "host": self.host, "done": done, "time": round(time.time(), 3)}
        try:
            self.store.write_hint(f"progress/{self.writer}.json", orjson.dumps(record))
        except Exception:
            pass  # a hint must never fail the job

    def progress(self) -> dict[str, dict]:
        out = {}
        for key in self.store.list("progress/"):
            try:
                r = orjson.loads(self.store.read(key) or b"")
                out[r["writer"]] = r
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
        return out

    # -- the tracker runs of --report-to (runtime/trackers/) ----------------------------------

    def tracker_run(self, tracker: str) -> dict | None:
        """The run `tracker` logs this job to, as the first process that reported to it decided."""
        return self.read_json(f"trackers/{tracker}.json")

    def claim_tracker_run(self, tracker: str, record: dict) -> dict:
        """Record `record` as the job's run for `tracker` unless one is recorded: the recorded one."""
        if self.store.create(f"trackers/{tracker}.json", orjson.dumps(record, option=orjson.OPT_SORT_KEYS)):
            return record
        return self.tracker_run(tracker) or record

    # -- history ---------------------------------------------------------------------------

    def log(self, what: str, **fields) -> None:
        self._history_n += 1
        now = time.time()
        record = {"what": what, "time": round(now, 3), "host": self.host, "pid": os.getpid(), "engine": self.engine,
                  "writer": self.writer, **fields}
        key = f"history/{int(now * 1e6):017d}-{self.writer}-{self._history_n:05d}.json"
        self.store.write(key, orjson.dumps(record))

    def history(self) -> list[dict]:
        out = []
        for key in self.store.list("history/"):
            raw = self.store.read(key)
            try:
                out.append(orjson.loads(raw))
            except (orjson.JSONDecodeError, TypeError):
                continue
        return sorted(out, key=lambda r: r["time"])


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
