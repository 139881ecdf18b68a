"""The one job core: what every job command does around its own work.

A job is opened as a context manager: choose the engine, open the state (refusing another
job's), install the preemption handler and the spot-notice watcher; leaving the block
always uninstalls them. Its work runs in one quantum loop, the product's core promise:

    stop requested?  -> commit what is done, exit 75
    run a quantum    -> abandonable: a stop that cannot wait throws it away
    settle it        -> never interrupted (the optimizer update, recording finished rows)
    commit on cadence

Jobs return an `Outcome` (exit code, completeness, summary): the CLI turns it into an exit
code, `build` reads its stages' scores from it.

Under torchrun (WORLD_SIZE > 1) every rank opens the job and runs the same loop; rank 0
alone opens the state, commits and writes the history. The stop flag and "was the quantum
abandoned" are agreed by all ranks each step (`agree`), so a signal to any rank stops all
of them at the same step (runtime/engines/torch/distributed.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from runtime.base import place, ranks, threads
from runtime.base.allotment import cpus
from runtime.core import requeue
from runtime import trackers
from runtime.core.events import Events
from runtime.core.notices import NoticeWatcher, start_watcher
from runtime.base.signals import PROMISE_S, Abandon, Preemption, grace_from_env, install_process_handler
from runtime.engines.registry import base_dtype, get_engine, group_opener, kept_base_dtype, made_with
from runtime.engines.hardware import choose_engine
from runtime.base.errors import EXIT_OK, EXIT_PREEMPTED, SpillpackError, redact
from runtime.base.fileio import sha256_bytes
from runtime.base.paths import spillpack_home
from runtime.state.jobstate import JobState
from runtime.state.uri import open_store

RECENT_QUANTA = 10  # how many recent quanta judge whether the one in flight fits the promise


@dataclass
class Outcome:
    code: int
    complete: bool = False
    summary: dict = field(default_factory=dict)

    @property
    def preempted(self) -> bool:
        return self.code == EXIT_PREEMPTED


class Work(Protocol):
    """A job's work, cut into quanta (a tune step, a generation step)."""

    done: int  # steps or rows done so far

    def remaining(self) -> bool: ...

    def quantum(self) -> None:
        """The abandonable part: may be interrupted by Abandon at any point."""

    def discard(self) -> None:
        """Throw away what an abandoned quantum left half done."""

    def settle(self) -> None:
        """Finish a quantum that ran to the end; never interrupted."""

    def commit_due(self) -> bool: ...

    def commit(self) -> None:
        """Commit everything settled and not yet committed (nothing new: nothing written)."""


def default_state_uri(name: str) -> str:
    return str(spillpack_home() / "jobs" / name)


def state_uri(options: dict) -> str:
    """Where a job's state lives: --state, else SPILLPACK_HOME/jobs/NAME."""
    return options.get("state") or default_state_uri(options["name"])


def read_state(options: dict) -> JobState:
    """A job's state to read before the job opens it (for a check that must refuse first):
    neither claims nor creates anything, and checks no identity."""
    return JobState(open_store(state_uri(options)), {})


@dataclass
class Job:
    """One process's run of a job."""

    command: str
    name: str
    events: Events
    engine_name: str
    engine_reason: str
    state: JobState | None  # None on ranks other than 0: they write nothing
    preemption: Preemption
    notices: NoticeWatcher
    group: object | None = None  # the torch.distributed ProcessGroup when this is one rank of several
    state_uri: str = ""
    root: JobState | None = None  # a shard's process: the whole job's state (self.state is its shard's)
    t0: float = field(default_factory=time.monotonic)
    _progress_at: float = 0.0
    state_step: int | None = None  # steps or rows done, as last reported: for the history's records
    kept_dtype: str | None = None  # the base dtype this job's last process on this engine ran (its history)
    group_lost: bool = False  # left the group in the middle of a quantum: no last barrier to wait at
    reporter: object | None = None  # --report-to's trackers (runtime/trackers/), fed this job's events
    made_with: list = field(default_factory=list)  # each engine and base dtype earlier processes ran, oldest first

    PROGRESS_EVERY_S = 1.0

    @classmethod
    def open(cls, inv, identity: dict, events: Events, shard: dict | None = None, upgrade=None) -> "Job":
        """Open the job that `inv` (a resolved Invocation) describes. The resolved config is kept
        in the state so `spillpack resume STATE` can run the job again from its state alone.
        `shard`: the identity of the shard this process does (its "shard" key is the index);
        the job's state is claimed first, so a shard of another job is refused before anything
        is written, and the process works in the shard's state (runtime/jobs/shards.py).
        `upgrade(old_identity, uri)` reads an identity written by an older version (JobState)."""
        o = inv.options
        # The process's handler has been recording since start-up: a stop asked for before
        # the state is opened ends the job here, with nothing written.
        preemption = install_process_handler()
        preemption.set_grace(o.get("grace_s") or grace_from_env(strict=True) or PROMISE_S)
        preemption.expected_step_s = 0.0  # a build's stage does not inherit the previous stage's step times
        preemption.check()
        preemption.started()
        report_to = trackers.wanted(o.get("report_to"), inv.command)
        if report_to:  # before anything is written: a tracker that is missing or cannot write fails the start
            trackers.check(report_to, state_uri(o), o["name"], inv.command)
        engine_name, reason = choose_engine(o.get("engine"))
        events.engine = engine_name
        group = open_group(engine_name, inv.command)
        uri = state_uri(o)
        state = root = None
        kept_dtype, made = None, []
        if group is None or group.writer:
            config = inv.to_config()
            # The requeue guard's "same settings": a start with another config or grace begins a new count.
            settings = sha256_bytes(orjson.dumps({"config": config, "grace_s": preemption.promise_s}, option=orjson.OPT_SORT_KEYS))[:16]
            start = {"settings": settings, "grace_s": preemption.promise_s}
            root = JobState(open_store(uri), identity, engine=engine_name, upgrade=upgrade)
            root.open(log=shard is None, **place.describe(engine_name), **start,
                      **({"world": group.world, "hosts": group.hosts} if group else {}))
            state = root
            if shard is not None:
                state = root.shards.shard(shard["shard"], shard)
                state.open(**place.describe(engine_name), **start)
            root.save_invocation({**config, "options": {**config["options"], "state": uri}})
            history = state.history()  # read once: the thread count and the requeue guard both need it
            if engine_name == "torch-cpu":  # before the engine is made: a resume runs on the threads it ran on
                threads.keep(history, cpus().count)
            kept_dtype = kept_base_dtype(history, engine_name)
            made = made_with(history)
            if inv.command != "build":  # a build's progress is its stages', each guarded as a job of its own
                requeue.check(state, o.get("max_stalled_starts", requeue.DEFAULT_MAX_STALLED), settings,
                              "row" if inv.command in ("run", "eval", "distill") else "step", history)
        on_place = (lambda info: state.log("place", **info)) if state is not None else None
        notices = start_watcher(o.get("preemption_notice"), preemption, on_place=on_place)
        reporter = (open_reporter(report_to, inv, root, state, history, engine_name, events, shard)
                    if report_to and state is not None else None)
        return cls(inv.command, o["name"], events, engine_name, reason, state, preemption, notices, group,
                   root.uri if root is not None else uri, root=root if shard is not None else None, kept_dtype=kept_dtype,
                   reporter=reporter, made_with=made)

    def engine_dtype(self, asked: str | None) -> tuple[str | None, str | None]:
        """The base dtype this process's engine takes and why (runtime.engines.registry.base_dtype):
        --dtype, SPILLPACK_DTYPE, the dtype kept from this job's earlier starts, or (None, None)
        for the engine's policy."""
        return base_dtype(asked, self.kept_dtype)

    def open_engine(self, engine=None, dtype: str | None = None, width: int | None = None, splits_rows: bool = False,
                    shape: dict | None = None, quantize: str | None = None, max_mem_gb: float | None = None,
                    layer_types: dict | None = None):
        """This process's engine (made here, or given: tune makes it first to plan its memory),
        with its device, software and base dtype in the history: a resume is bit-identical only
        where they match (`spillpack status` says which applied). `splits_rows`: a tune, whose
        torch-cpu engine splits a micro-batch's rows across its threads."""
        threads.for_model(width, splits_rows)  # a narrow model's ops run on one thread (runtime.base.threads)
        engine = engine or get_engine(self.engine_name, dtype, width=width, kept=self.kept_dtype, shape=shape, quantize=quantize,
                                      max_mem_gb=max_mem_gb, layer_types=layer_types)
        engine.fit_threads()  # made before the state was read (tune plans with it): the count a resume keeps
        if self.writer:  # rank 0 of a data-parallel group writes for all (its ranks share one device model)
            self.state.log("engine", **engine.describe())
        return engine

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Abandon) and self.writer:
            # Stopped where nothing new was settled (loading, staging): the CLI emits `preempted`.
            self.state.log("interrupted", signal=self.preemption.signal_name or "SIGTERM", step=None, abandoned_quantum=True)
        self.close(failed=exc_type is not None)
        if isinstance(exc, Exception) and self.state is not None:
            # An end record, so `spillpack status` never takes a process that stopped on an
            # error for one that was killed.
            what = exc.line() if isinstance(exc, SpillpackError) else f"{type(exc).__name__}: {exc}"
            try:
                self.state.log("failed", step=self.state_step, error=what)
            except Exception:
                pass  # the state may be what failed (a full disk): the error itself matters more
        return False

    def close(self, failed: bool = False) -> None:
        # The process's handler stays: a stop after the job's end leaves the exit code alone.
        self.notices.stop()
        if self.reporter is not None:  # flushed within a few seconds (a preempted job still exits within its grace)
            self.events.detach(self.reporter)
            # Stopped by a signal: the trackers get what is left of the grace, less a margin for the exit itself.
            wait_s = trackers.close_wait_s()
            left = self.preemption.seconds_left() - 1.0 if self.preemption.t_signal is not None else wait_s
            self.reporter.close(max(0.2, min(wait_s, left)))
            for message in self.reporter.warnings():
                self.events.emit("warning", message=message)
            self.reporter = None
        # The other ranks wait here for rank 0's last commit; a failed rank does not wait
        # (the launcher ends the group when it exits).
        if self.group is not None and not failed and not self.group_lost:
            self.group.finish()

    @property
    def writer(self) -> bool:
        """This process writes the state and outputs (rank 0, or the only process)."""
        return self.state is not None

    def agree(self, flag: bool) -> bool:
        """`flag` as every rank agrees on it: true when true on any rank."""
        return self.group.any(flag) if self.group is not None else flag

    # -- the quantum loop ------------------------------------------------------------------

    def run(self, work: Work, stop_after: int | None = None) -> Outcome | None:
        """Run `work` until it is finished, stopped by --stop-after (None: the caller reports
        done) or preempted (the Outcome to return, after its commit)."""
        recent: list[float] = []
        while work.remaining():
            if self.agree(self.preemption.stop_requested):
                self.stopping(work.done)
                work.commit()
                return self.preempted(work.done, abandoned_quantum=False)
            if stop_after is not None and work.done >= stop_after:
                break
            t0 = time.monotonic()
            abandoned = False
            try:
                with self.preemption.abandonable():
                    work.quantum()
            except Abandon:
                abandoned = True
            if abandoned and getattr(work, "lockstep", False):
                # The quantum's collectives (a sharded base's gathers) may hold the other ranks, so
                # no agreement can follow: this rank commits what it has (rank 0) and leaves, and
                # the others lose the group (or, stopped too, leave the same way).
                work.discard()
                self.stopping(work.done)
                work.commit()
                self.group_lost = True
                return self.preempted(work.done, abandoned_quantum=True)
            if self.agree(abandoned):  # one rank's abandoned quantum is every rank's
                work.discard()
                self.stopping(work.done)
                work.commit()
                return self.preempted(work.done, abandoned_quantum=True)
            work.settle()
            recent = (recent + [time.monotonic() - t0])[-RECENT_QUANTA:]
            self.preemption.expected_step_s = max(recent)
            self.progress(work.done)
            if work.commit_due():
                work.commit()
        work.commit()
        return None

    # -- what the job reports ----------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def progress(self, done: int) -> None:
        """How far this process got (steps or rows): after every quantum where that is cheap (a local
        state), so a hard kill's repeated work is counted exactly; at most every PROGRESS_EVERY_S
        elsewhere (S3: a PUT each)."""
        self.state_step = done
        now = time.monotonic()
        if self.writer and (self.state.store.cheap_hints or now - self._progress_at >= self.PROGRESS_EVERY_S):
            self._progress_at = now
            self.state.note_progress(done)

    def stopping(self, done: int) -> None:
        """Asked to stop, about to commit: a start killed after this record died committing (the
        requeue guard's evidence that the grace is shorter than a checkpoint takes)."""
        if self.writer:
            self.state.log("stopping", step=done, signal=self.preemption.signal_name, grace_s=self.preemption.promise_s)

    def restored(self, count: int, uri: str) -> None:
        self.events.emit("restore", step=count, uri=uri, made_with=self.made_with)
        if self.writer:
            self.state.log("resume", step=count, uri=uri)

    def checkpointed(self, step: int, uri: str, seconds: float, **fields) -> None:
        self.events.emit("checkpoint", step=step, uri=uri, seconds=round(seconds, 3), **fields)

    def preempted(self, step: int, abandoned_quantum: bool, emit: bool = True) -> Outcome:
        """`emit=False` when the event was already emitted by the stage that stopped (a build)."""
        p = self.preemption
        sig = p.signal_name or "SIGTERM"
        # From the signal to the committed state: what the platform's grace period had to cover.
        since = round(time.monotonic() - p.t_signal, 3) if p.t_signal is not None else None
        signalled = round(time.time() - since, 3) if since is not None else None
        if self.writer:
            self.state.log("interrupted", signal=sig, step=step, abandoned_quantum=abandoned_quantum, seconds=since,
                           grace_s=p.promise_s, signalled=signalled)
        if emit:
            self.events.emit("preempted", step=step, signal=sig, abandoned_quantum=abandoned_quantum, seconds=since, grace_s=p.promise_s)
        self.notices.committed()  # the checkpoint is committed: a cloud that waits for an acknowledgement may evict now
        return Outcome(EXIT_PREEMPTED)

    def done(self, step: int, complete: bool, stopped_early: bool | None = None, **summary) -> Outcome:
        """`stopped_early`: a tune's --early-stop ended it (complete, before its last step); by default
        a job stopped early is one that --stop-after stopped."""
        if self.writer:
            self.state.log("done" if complete else "stopped", step=step)
        self.events.emit("done", step=step, complete=complete, stopped_early=not complete if stopped_early is None else stopped_early,
                         seconds=round(self.elapsed(), 3), **summary)
        return Outcome(EXIT_OK, complete, {**summary, **({"stopped_early": stopped_early} if stopped_early is not None else {})})


def open_reporter(names: list[str], inv, root: JobState, state: JobState, history: list[dict], engine: str, events: Events,
                  shard: dict | None = None):
    """The trackers' reporter, attached to `events`: one tracker run per job, recorded in the job's
    state (`root`); `state`'s history (a shard's own) says whether the previous process was hard killed.
    The shards of a row job log to the job's one run, each under its own name (`shard-I/...`)."""
    from runtime.trackers.reporter import Reporter

    config = inv.to_config()
    params = {k: redact(v) if isinstance(v, str) else v for k, v in {**config["arguments"], **config["options"]}.items() if v is not None}
    context = {"state": root, "state_uri": root.uri, "job": inv.options["name"], "command": inv.command, "host": state.host,
               "engine": engine, "params": {"command": inv.command, **params},
               "shard": shard["shard"] if shard is not None else None}
    before = requeue.starts(history, state.progress())[:-1]  # the starts before this one
    if before and before[-1].killed:
        last = before[-1]
        unit = "row" if inv.command in ("run", "eval", "distill") else "stage" if inv.command == "build" else "step"
        committed = max(last.committed) if last.committed else last.began
        reached = max(last.reached or 0, committed)
        context["hard_kill"] = {"committed": committed, "text": (
            f"hard kill: the previous process left no end record (SIGKILL, out of memory or a lost machine); last commit at "
            f"{unit} {committed}, reached {unit} {reached}: {reached - committed} {unit}(s) done again")}
    reporter = Reporter(names, context)
    events.attach(reporter)
    return reporter


def open_group(engine_name: str, command: str):
    """The engine's process group when this process is one rank of several, else None."""
    world = ranks.world_size()
    if world <= 1:
        return None
    if command != "tune":
        raise SpillpackError(f"{command} runs as one process, not {world} (only tune is data-parallel)",
                             f"spillpack {command} ... as one process, without torchrun")
    opener = group_opener(engine_name)
    if opener is None:
        raise SpillpackError(f"the {engine_name} engine runs one process, not {world}",
                             "run it without torchrun or --nproc, or with --engine torch-cuda|torch-cpu")
    return opener()
