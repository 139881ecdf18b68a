"""The reporter: the job's events in, each tracker's metrics, params and notes out.

It is a sink of the event stream (Events.attach): `feed` translates the event and puts the
calls on each tracker's bounded queue, so the job never waits for a tracker. Each tracker has a
daemon thread of its own that opens it (its run as the job's state records it, or a new one
recorded there) and calls it. A tracker that fails (a server down, a disk full) is dropped with one warning, which the
job emits as a `warning` event from its own thread; the job goes on.

Steps reach a tracker that cannot take a value back (`committed_only`) when the checkpoint
that holds them is committed: a hard kill's steps past the last checkpoint are done again by
the next process, and logged once.
"""

from __future__ import annotations

import queue
import threading
import time

from runtime.base.errors import redact
from runtime.trackers import module

QUEUE_MAX = 10_000


class Reporter:
    """Feeds each tracker on a lane of its own, so a slow one (a W&B start, a server that does not
    answer) holds back neither the job nor the other trackers."""

    def __init__(self, names: list[str], context: dict):
        """`context`: what the trackers open with: state (the job's JobState), state_uri, job,
        command, host, params, and hard_kill (what a hard-killed previous process left, if one was)."""
        self.context = context
        self._warnings: list[str] = []
        self._opened = False
        self.lanes = [Lane(name, context, self._warnings) for name in names]

    # -- the job's side: never blocks -------------------------------------------------------

    def feed(self, record: dict) -> None:
        calls = []
        if not self._opened and record.get("event") in ("restore", "start", "stage"):
            # The first event that says where this process begins (the step or row it restored).
            self._opened = True
            calls.append(("open", (record.get("step") or 0,)))
            calls.append(("params", (self.context.get("params") or {},)))
            killed = self.context.get("hard_kill")
            if killed:  # the previous process left no end record: SIGKILL, out of memory, a lost machine
                calls.append(("note", ("hard_kill", killed["text"], killed.get("committed"))))
        if self._opened:
            calls += translate(record, self.context)
        for lane in self.lanes:
            for call in calls:
                lane.put(call)

    def warnings(self) -> list[str]:
        out = []
        while self._warnings:  # appended to by the lanes' threads
            out.append(self._warnings.pop(0))
        return out

    def close(self, wait_s: float) -> None:
        """Flush and close every tracker, waiting at most `wait_s` in all (then a lane is left behind)."""
        deadline = time.monotonic() + wait_s
        for lane in self.lanes:
            lane.put(None)
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                self._warnings.append(f"--report-to {lane.name} had not caught up after {wait_s:.3g} s at the end of this process; "
                                      "what it had not logged yet is left out")


class Lane:
    """One tracker's queue and daemon thread."""

    def __init__(self, name: str, context: dict, warnings: list[str]):
        self.name, self.context, self._warnings = name, context, warnings
        self.tracker = None
        self.failed = False
        self._dropped = 0
        self._pending: list[tuple[int, dict]] = []  # steps not yet committed, for a committed_only tracker
        self._queue: queue.Queue = queue.Queue(QUEUE_MAX)
        self.thread = threading.Thread(target=self._loop, name=f"spillpack-{name}", daemon=True)
        self.thread.start()

    def put(self, call) -> None:
        if self.failed and call is not None:
            return
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            if call is None:
                return
            if not self._dropped:
                self._warnings.append(f"--report-to {self.name} fell {QUEUE_MAX} events behind; events are left out until it catches up")
            self._dropped += 1

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                break
            if not self.failed:
                self._guard(self._do, *call)
        if self.tracker is not None and not self.failed:
            self._guard(self._flush, None)
            self._guard(self.tracker.close)

    def _do(self, kind: str, args: tuple) -> None:
        if kind == "open":
            self.tracker = module(self.name).open({**self.context, "start_step": args[0]})
            return
        t = self.tracker
        if t is None:
            return
        if kind == "metrics":
            if t.committed_only:
                self._pending.append(args)
            else:
                t.metrics([args])
        elif kind == "committed":
            self._flush(args[0])
        elif kind == "note":
            t.note(*args)
        elif kind == "params":
            t.params(*args)

    def _flush(self, upto: int | None) -> None:
        """Give a committed_only tracker every pending step up to `upto` (None: all)."""
        ready = [p for p in self._pending if upto is None or p[0] <= upto]
        self._pending = [p for p in self._pending if not (upto is None or p[0] <= upto)]
        if ready:
            self.tracker.metrics(ready)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a tracker that fails is dropped for this process, with one warning
            self.failed = True
            what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._warnings.append(f"--report-to {self.name} stopped reporting for this process ({redact(what)[:200]}); the job goes on")


STEP_KEYS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "peak_mem_gb": "train/peak_mem_gb",
             "step_s": "train/step_s"}


def translate(r: dict, context: dict) -> list[tuple[str, tuple]]:
    """One event as the trackers' calls: ("metrics", (step, values)), ("committed", (step,)),
    ("note", (kind, text, step)), ("params", (dict,)). A build's stages are told apart by a
    prefix (its stages' steps each count from 1)."""
    command = context["command"]
    ev = r.get("event")
    stage = r.get("stage")
    prefix = f"{stage}/" if stage else f"shard-{context['shard']}/" if context.get("shard") is not None else ""
    step = r.get("step")
    out: list[tuple[str, tuple]] = []
    if ev == "step":
        values = {prefix + name: float(r[key]) for key, name in STEP_KEYS.items() if r.get(key) is not None}
        out.append(("metrics", (step, values)))
    elif ev == "eval":
        values = {prefix + "eval/val_loss": float(r["val_loss"])}
        if r.get("best_val_loss") is not None:
            values[prefix + "eval/best_val_loss"] = float(r["best_val_loss"])
        out.append(("metrics", (step, values)))
    elif ev == "row":
        out.append(("metrics", (step, {prefix + "rows/done": float(step)})))
    elif ev == "checkpoint" and step is not None:
        out.append(("committed", (step,)))
    elif ev == "restore":
        where = f" on host {context.get('host')}, engine {r.get('engine')}"
        out.append(("note", ("resumed", f"resumed at {_unit(command, stage)} {step} from {r.get('uri')}{where}", step)))
    elif ev == "preempted":
        if step is not None:
            out.append(("committed", (step,)))
        secs = f", checkpoint committed {r['seconds']} s after the signal" if r.get("seconds") is not None else ""
        at = f"at {_unit(command, stage)} {step}" if step is not None else "while starting"
        abandoned = " (the one in flight abandoned)" if r.get("abandoned_quantum") else ""
        out.append(("note", ("interrupted", f"interrupted by {r.get('signal')} {at}{abandoned}{secs}", step)))
    elif ev == "stage" and r.get("status") == "scored":
        score = r.get("score") or {}
        values = _numbers(score, f"{stage}/")
        if values:
            out.append(("metrics", (r.get("step") or 0, values)))
            out.append(("committed", (r.get("step") or 0,)))
    elif ev == "done":
        values = {}
        for key in ("accuracy", "rows", "failed_rows", "final_loss", "best_val_loss", "best_step"):
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool):
                values[f"{prefix}result/{key}"] = float(r[key])
        ci = r.get("ci95")
        if isinstance(ci, list) and len(ci) == 2:
            values[f"{prefix}result/ci95_low"], values[f"{prefix}result/ci95_high"] = float(ci[0]), float(ci[1])
        if values:
            out.append(("metrics", (step or 0, values)))
        out.append(("committed", (step or 0,)))
        how = "finished" if r.get("complete") else "stopped early"
        out.append(("note", ("done", f"{how} at {_unit(command, stage)} {step} in {r.get('seconds')} s", step)))
    return out


def _numbers(score: dict, prefix: str) -> dict[str, float]:
    """A stage's score as metrics: its numbers by name, a nested part's under its own name (the
    build's eval stage scores `base` and `tuned`: eval/base/accuracy, eval/tuned/accuracy)."""
    out = {}
    for k, v in score.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def _unit(command: str, stage: str | None) -> str:
    if command == "build" and not stage:
        return "stage"
    return "step" if (stage or command) == "tune" else "row"
