"""A job's state under its --state URI: identity, commits, checkpoints, row segments, history.

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
from dataclasses import dataclass, field

import orjson

from runtime.errors import SpillpackError
from runtime.fileio import sha256_bytes
from runtime.state.store import Store, open_store

KEEP_CHECKPOINTS = 2
SHARD_DONE = "shard-done"  # marker kind: every row of this shard is committed
MERGED = "merged.json"
MERGE_CLAIM = "merge-claim.json"


@dataclass
class Commit:
    seq: int
    kind: str  # "checkpoint" | "segment" | "stage"
    step: int  # steps done (checkpoint) or rows in the segment
    files: dict  # name -> {"key", "size", "sha256"}
    meta: dict
    identity: dict | None = None  # the job's identity (None in records written before it travelled with them)
    log: list = field(default_factory=list)  # the log's chunks from the start, as files: {"key", "size", "sha256"}


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
        commits = self._commits()
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

    def _commits(self) -> list[Commit]:
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

    def _complete(self, c: Commit) -> bool:
        return all(self.store.size(f["key"]) == f["size"] for f in [*c.files.values(), *c.log])

    def _write(self, key: str, data: bytes) -> dict:
        self.store.write(key, data)
        return {"key": key, "size": len(data), "sha256": sha256_bytes(data)}

    def _commit(self, kind: str, step: int, files: dict[str, bytes], prefix: str, meta: dict, log: bytes = b"") -> Commit:
        seq = self._next_seq  # taken at open: a record another process made since is a conflict, never skipped
        described = {}
        for name, data in files.items():
            key = f"{prefix}{seq:08d}-{self.writer}/{name}" if kind != "segment" else f"{prefix}{seq:08d}-{self.writer}.jsonl"
            described[name] = self._write(key, data)
        chunks = self._log + ([self._write(f"log/{seq:08d}-{self.writer}.jsonl", log)] if log else []) if kind == "checkpoint" else []
        record = {"seq": seq, "kind": kind, "step": step, "files": described, "meta": meta, "identity": self.identity, "log": chunks,
                  "time": round(time.time(), 3), "host": self.host, "pid": os.getpid(), "engine": self.engine, "writer": self.writer}
        if not self.store.create(_record_key(seq), orjson.dumps(record)):
            raise StateConflict(
                f"another process committed to {self.uri} at the same time (commit {seq}); this one stops so the two do not mix",
                "make sure one copy of the job runs, then run it again to continue from the newest commit",
            )
        self._next_seq = seq + 1
        if kind == "checkpoint":
            self._log = chunks
        return Commit(seq, kind, step, described, meta, self.identity, chunks)

    def commit_uri(self, commit: Commit) -> str:
        return self.store.child_uri(_record_key(commit.seq))

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
                                 f"delete {self.store.child_uri(_record_key(commit.seq))} to fall back to the previous commit")
        return data

    # -- checkpoints -------------------------------------------------------------------

    def latest_checkpoint(self, agrees=None) -> Commit | None:
        """The newest complete checkpoint; `agrees(commit)`, when given, also holds the record to
        what its files say (a record edited by hand is passed over, as a torn one is)."""
        for c in reversed(self._commits()):
            if c.kind == "checkpoint" and self._complete(c) and (agrees is None or agrees(c)):
                return c
        return None

    def commit_checkpoint(self, step: int, files: dict[str, bytes], meta: dict | None = None, log: bytes = b"") -> tuple[Commit, float]:
        """`log`: what this checkpoint adds to the log since the one before it."""
        t0 = time.perf_counter()
        commit = self._commit("checkpoint", step, files, "checkpoints/", meta or {}, log)
        seconds = time.perf_counter() - t0
        self.log("checkpoint", step=step, seq=commit.seq, uri=self.store.child_uri(_record_key(commit.seq)), seconds=round(seconds, 3))
        self._prune()
        return commit, seconds

    def _prune(self) -> None:
        commits = self._commits()
        checkpoints = [c for c in commits if c.kind == "checkpoint"]
        for old in checkpoints[:-KEEP_CHECKPOINTS]:
            # The record goes first: a record never points at files that are already gone.
            self.store.delete(_record_key(old.seq))
            for f in old.files.values():
                self.store.delete(f["key"])
        kept = checkpoints[-KEEP_CHECKPOINTS:]
        if not kept:
            return
        # Files of checkpoints older than the oldest kept one that no record references: a
        # process that died (or lost a race) before its commit record. A writer still in
        # flight at such a number cannot commit it any more, so nothing live is removed.
        referenced = {f["key"] for c in commits for f in [*c.files.values(), *c.log]}
        oldest = kept[0].seq
        for prefix in ("checkpoints/", "log/"):
            for key in self.store.list(prefix):
                seq = key[len(prefix):].split("-", 1)[0]
                if seq.isdigit() and int(seq) < oldest and key not in referenced:
                    self.store.delete(key)

    # -- row segments -------------------------------------------------------------------

    def segments(self) -> list[Commit]:
        return [c for c in self._commits() if c.kind == "segment" and self._complete(c)]

    def commit_segment(self, rows_jsonl: bytes, count: int, meta: dict | None = None) -> tuple[Commit, float]:
        t0 = time.perf_counter()
        commit = self._commit("segment", count, {"rows": rows_jsonl}, "segments/", meta or {})
        seconds = time.perf_counter() - t0
        self.log("checkpoint", rows=count, seq=commit.seq, uri=self.store.child_uri(commit.files["rows"]["key"]), seconds=round(seconds, 3))
        return commit, seconds

    # -- small named records (a build's finished stages, final outputs) ---------------------

    def commit_marker(self, kind: str, meta: dict) -> Commit:
        return self._commit(kind, 0, {}, "markers/", meta)

    def markers(self, kind: str) -> list[Commit]:
        return [c for c in self._commits() if c.kind == kind]

    # -- shards and their merge ---------------------------------------------------------------

    def shard(self, index: int, identity: dict | None = None) -> "JobState":
        """Shard `index`'s own state, under this one (`identity` None: to read it, not to open it)."""
        return JobState(open_store(self.store.child_uri(f"shards/{index}")), identity or {}, engine=self.engine)

    def shard_done(self) -> Commit | None:
        done = self.markers(SHARD_DONE)
        return done[-1] if done else None

    def mark_shard_done(self, rows: int) -> None:
        self.commit_marker(SHARD_DONE, {"rows": rows})
        self.log("shard-done", rows=rows)

    def claim_merge(self, shard: int | None) -> bool:
        """Created exclusively (and naming this process, so no two claims are the same bytes):
        True for the one process that merges."""
        return self.store.create(MERGE_CLAIM, orjson.dumps(self._stamp({"shard": shard})))

    def merge_claim(self) -> dict | None:
        return self._json(MERGE_CLAIM)

    def write_output(self, name: str, data: bytes) -> None:
        self.store.write(name, data)

    def output(self, name: str) -> bytes | None:
        return self.store.read(name)

    def merge_record(self) -> dict | None:
        return self._json(MERGED)

    def record_merge(self, meta: dict) -> bool:
        """Written last, created exclusively: True for the one process whose record it is."""
        return self.store.create(MERGED, orjson.dumps(self._stamp(meta), option=orjson.OPT_INDENT_2))

    def _stamp(self, meta: dict) -> dict:
        return {**meta, "time": round(time.time(), 3), "host": self.host, "pid": os.getpid(), "writer": self.writer}

    def _json(self, key: str) -> dict | None:
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


def _record_key(seq: int) -> str:
    return f"commits/{seq:08d}.json"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
