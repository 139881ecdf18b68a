"""The requeue guard: exit 75 means "run me again", so a job that can never get past its last
checkpoint (a grace period shorter than a checkpoint takes, a machine that dies at the same
step every time) would be requeued forever. Each start is read back from the state's history
(runtime/state/jobstate.py records opens, checkpoints, interruptions and ends); when the last
N starts in a row made no progress past the checkpoint they began from, the next start stops
with exit 1 and one line that says why and what to change.

A start made progress when it committed anything (a checkpoint, a segment of rows) or ended
the job (done, --stop-after). Starts that ended in an error (exit 1) end a streak: nobody
requeues them, and the next start is a person trying again. Starts with other settings than
this one (another --grace-s, --ckpt-every, ..., or SPILLPACK_GRACE_S: the `settings` hash of
the open record) end it too, so the change the line suggests takes effect at once. A start
that the guard itself stopped counts for nothing either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.base.errors import SpillpackError

DEFAULT_MAX_STALLED = 3


@dataclass
class Start:
    """One process's run of the job, as its history records tell it."""

    writer: str
    time: float
    settings: str | None = None  # hash of the resolved config and effective grace (None: an older version's record)
    grace_s: float | None = None
    began: int = 0  # steps or rows restored
    committed: list[int] = field(default_factory=list)  # what each of its commits reached
    checkpoint_s: list[float] = field(default_factory=list)
    end: str | None = None  # done, stopped, interrupted, failed, requeue-guard; None: killed (or still running)
    end_step: int | None = None
    stopping: dict | None = None  # asked to stop (signal or notice) and about to commit
    reached: int | None = None  # how far its progress record says it got

    @property
    def progressed(self) -> bool:
        return bool(self.committed) or self.end in ("done", "stopped")

    @property
    def killed(self) -> bool:
        return self.end is None


def starts(history: list[dict], progress: dict | None = None) -> list[Start]:
    """Every start in the order they began (a writer is one process)."""
    out: dict[str, Start] = {}
    for r in history:
        w = r.get("writer")
        s = out.get(w)
        if s is None:
            s = out[w] = Start(w, r["time"])
        what = r.get("what")
        if what == "open":
            s.settings, s.grace_s = r.get("settings"), r.get("grace_s")
        elif what == "resume":
            s.began = r.get("step") or 0
        elif what == "checkpoint":
            s.committed.append(r["step"] if "step" in r else r.get("rows") or 0)
            if r.get("seconds") is not None:
                s.checkpoint_s.append(float(r["seconds"]))
        elif what == "stopping":
            s.stopping = r
        elif what in ("done", "stopped", "interrupted", "failed", "requeue-guard", "shard-done"):
            if what == "shard-done":
                s.committed.append(r.get("rows") or 0)
                continue
            s.end, s.end_step = what, r.get("step")
    for w, p in (progress or {}).items():
        if w in out and isinstance(p, dict):
            out[w].reached = p.get("done")
    return sorted(out.values(), key=lambda s: s.time)


def counts(all_starts: list[Start]) -> dict:
    """What `spillpack status` shows: starts, preemptions, hard kills, and each start's progress."""
    last = all_starts[-1].writer if all_starts else None
    return {
        "starts": len(all_starts),
        "preemptions": sum(s.end == "interrupted" for s in all_starts),
        "hard_kills": sum(s.killed and s.writer != last for s in all_starts),
        "stalled_in_a_row": len(stalled(all_starts[:-1], all_starts[-1].settings if all_starts else None)),
        "progress": [{"began": s.began, "committed": max(s.committed) if s.committed else None, "end": s.end or "killed"}
                     for s in all_starts],
    }


def stalled(before: list[Start], settings: str | None) -> list[Start]:
    """The starts before this one, newest first, that made no progress in a row under the same settings."""
    out = []
    for s in reversed(before):
        if s.end == "requeue-guard":
            continue
        if s.progressed or s.end == "failed" or (settings is not None and s.settings != settings):
            break
        out.append(s)
    return out


def check(state, limit: int | None, settings: str, unit: str = "step", history: list[dict] | None = None) -> None:
    """Refuse to start when the `limit` starts before this one (the newest in `state`'s history)
    made no progress in a row. 0 or None turns the guard off. `history`: the state's, when the
    caller has read it already (each record is one object: on s3:// one GET)."""
    if not limit:
        return
    history = state.history() if history is None else history
    everyone = starts(history, state.progress())
    before = [s for s in everyone if s.writer != state.writer]
    streak = stalled(before, settings)
    if len(streak) < limit:
        return
    streak = streak[:limit]
    line, fix = diagnose(streak, everyone, unit, limit)
    state.log("requeue-guard", stalled=len(streak), reason=line)
    raise SpillpackError(line, fix)


def diagnose(streak: list[Start], everyone: list[Start], unit: str, limit: int) -> tuple[str, str]:
    """Why the starts stall, with the figures the history holds, and what to change."""
    n = len(streak)
    base = max((s.began for s in streak), default=0)
    off = "or --max-stalled-starts 0 to let it be requeued anyway"
    ckpt = max((c for s in everyone for c in s.checkpoint_s), default=None)
    head = f"the last {n} starts of this job made no progress past its checkpoint at {unit} {base}"
    if all(s.stopping is not None and s.killed for s in streak):
        grace = f"{streak[0].grace_s:g} s" if streak[0].grace_s is not None else "unknown"
        took = f"a checkpoint took up to {ckpt:g} s here" if ckpt is not None else "no checkpoint of this job has ever been committed"
        return (f"{head}: each was stopped (signal or notice) and killed while committing its checkpoint, so the grace period "
                f"({grace}) is shorter than a checkpoint takes ({took})",
                f"a longer grace on the scheduler (and --grace-s to match), a faster --state store or a smaller adapter; {off}")
    if all(s.killed for s in streak):
        at = sorted({s.reached if s.reached is not None else base for s in streak})
        if len(at) == 1:
            return (f"{head}: it dies at {unit} {at[0]} every time (killed with no record: out of memory, a lost machine)",
                    f"spillpack status STATE to see each start, then a machine with more memory (or --max-mem-gb) or another node; {off}")
        return (f"{head}: each start was killed (no record) before its next checkpoint, at {unit}s {', '.join(map(str, at))}",
                f"a smaller --ckpt-every (or a longer time before the machine is taken); {off}")
    if all(s.end == "interrupted" for s in streak):
        return (f"{head}: each start was preempted before it could commit a new {unit} "
                f"(at {unit}s {', '.join(str(s.end_step if s.end_step is not None else base) for s in streak)})",
                f"a smaller --ckpt-every or a longer allocation between preemptions; {off}")
    return (f"{head}: each start was preempted or killed before committing",
            f"spillpack status STATE to see each start; {off}")
