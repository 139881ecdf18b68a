"""The one job core: what every job command does around its own work.

Choose the engine, open the state (refusing another job's), install the preemption
handler, and turn the outcome into events and an exit code: `done` (0), `preempted`
after a committed checkpoint (75), or an error line (1). Jobs supply only their work.
"""

import time
from dataclasses import dataclass, field

from runtime.errors import EXIT_OK, EXIT_PREEMPTED
from runtime.core.events import Events
from runtime.engines.hardware import choose_engine
from runtime.core.notices import NoticeWatcher, start_watcher
from runtime.paths import spillpack_home
from runtime.core.signals import Preemption
from runtime.state.jobstate import JobState
from runtime.state.store import open_store


def default_state_uri(name: str) -> str:
    return str(spillpack_home() / "jobs" / name)


@dataclass
class Job:
    """One process's run of a job."""

    command: str
    name: str
    events: Events
    engine_name: str
    engine_reason: str
    state: JobState
    preemption: Preemption
    notices: NoticeWatcher
    t0: float = field(default_factory=time.monotonic)
    _progress_at: float = 0.0

    PROGRESS_EVERY_S = 1.0

    @classmethod
    def open(cls, command: str, name: str, options: dict, identity: dict, events: Events,
             invocation: dict | None = None) -> "Job":
        """`invocation`: the resolved config (Invocation.to_config()), kept in the state so
        `spillpack resume` can run the job again from its state alone."""
        engine_name, reason = choose_engine(options.get("engine"))
        events.engine = engine_name
        uri = options.get("state") or default_state_uri(name)
        state = JobState(open_store(uri), identity, engine=engine_name)
        state.open()
        if invocation is not None:
            state.save_invocation({**invocation, "options": {**invocation["options"], "state": uri}})
        preemption = Preemption().install()
        notices = start_watcher(options.get("preemption_notice"), preemption)
        return cls(command, name, events, engine_name, reason, state, preemption, notices)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def progress(self, done: int) -> None:
        """How far this process got (steps or rows), written at most every PROGRESS_EVERY_S."""
        now = time.monotonic()
        if now - self._progress_at >= self.PROGRESS_EVERY_S:
            self._progress_at = now
            self.state.note_progress(done)

    def restored(self, count: int, uri: str) -> None:
        self.events.emit("restore", step=count, uri=uri)
        self.state.log("resume", step=count, uri=uri)

    def checkpointed(self, step: int, uri: str, seconds: float, **fields) -> None:
        self.events.emit("checkpoint", step=step, uri=uri, seconds=round(seconds, 3), **fields)

    def preempted(self, step: int, abandoned_quantum: bool) -> int:
        sig = self.preemption.signal_name or "SIGTERM"
        self.state.log("interrupted", signal=sig, step=step, abandoned_quantum=abandoned_quantum)
        self.events.emit("preempted", step=step, signal=sig, abandoned_quantum=abandoned_quantum)
        self.close()
        return EXIT_PREEMPTED

    def done(self, step: int, complete: bool, **summary) -> int:
        self.state.log("done" if complete else "stopped", step=step)
        self.events.emit("done", step=step, complete=complete, stopped_early=not complete,
                         seconds=round(self.elapsed(), 3), **summary)
        self.close()
        return EXIT_OK

    def close(self) -> None:
        self.notices.stop()
        self.preemption.uninstall()
