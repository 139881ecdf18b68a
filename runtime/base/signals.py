"""Preemption: SIGTERM, SIGHUP or SIGINT means "commit a checkpoint and exit 75 within the grace".

The handler is installed first thing in the process (`install_process_handler`, called by
the entry points before any heavy import), so a stop is never the default action's exit 143.
From the CLI's `start_up()` until a job opens its state (`Job.open` calls `started()`) nothing needs saving, so a stop
abandons whatever start-up is doing at once (reading data, planning memory, fetching wheels
for `pack`), however long that work would have taken (its writes are atomic: whole or absent).
After that, a download or a load in progress (`setup()`) is abandoned at once.

Inside the job, a stop is asked for between quanta (`stop_requested`). The quantum in flight
is finished when it fits in the budget (its expected length, from the job's own timings) and
abandoned when it does not: the handler (or an alarm set for the latest moment) raises
`Abandon` inside the quantum, which the job catches and then commits the last finished state.
Only code inside `abandonable()` can be interrupted, so an optimizer update or a state write
is never torn. A second signal abandons at once.

The budget is the platform's grace period: `--grace-s`, else SPILLPACK_GRACE_S, else 30 s
(spill's promise and a GCP spot notice); the reserve kept for the commit scales with it.
"""

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

PROMISE_S = 30.0  # the default grace: checkpoint committed and exit within 30 seconds
GRACE_MAX_S = 365 * 86400.0  # a longer grace overflows the alarm that bounds a quantum (runtime.config.options)
RESERVE_SHARE = 1 / 3  # of the grace, kept for committing the checkpoint after the quantum
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # SIGHUP: an ssh session dropping


def grace_from_env(strict: bool = False) -> float | None:
    """SPILLPACK_GRACE_S as seconds, None when unset. `strict`: a value that is not a positive
    finite number is one error line (the job checks it; the early handler just uses 30 s)."""
    raw = os.environ.get("SPILLPACK_GRACE_S", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if 0 < value <= GRACE_MAX_S:
        return value
    if strict:
        from runtime.base.errors import SpillpackError

        raise SpillpackError(f"SPILLPACK_GRACE_S={raw!r} is not a positive number of seconds up to a year", "export SPILLPACK_GRACE_S=30")
    return None


# How soon a stop that landed inside an import looks again (see Preemption._abandon).
IMPORT_RECHECK_S = 0.02


def _importing(frame) -> bool:
    """Whether the interrupted code runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class Abandon(BaseException):
    """Raised inside an abandonable step when it cannot finish in time. BaseException so
    that no `except Exception` in model or library code can swallow it."""


class Preemption:
    def __init__(self, promise_s: float = PROMISE_S, reserve_s: float | None = None):
        self.promise_s = promise_s
        self.reserve_s = promise_s * RESERVE_SHARE if reserve_s is None else reserve_s
        self.signal_name: str | None = None
        self.t_signal: float | None = None
        self.count = 0
        self.expected_step_s = 0.0  # updated by the job from its own step timings
        self._in_step = False
        self._step_started = 0.0
        self._previous = {}
        self._notice_name: str | None = None
        self.starting = False  # from start_up() until a job opens its state: a stop abandons at once
        self._lock = threading.Lock()  # a notice thread's request never races uninstall()

    @property
    def stop_requested(self) -> bool:
        return self.count > 0

    def set_grace(self, seconds: float) -> None:
        """The platform's grace period: the promise, and the commit reserve in proportion."""
        self.promise_s = float(seconds)
        self.reserve_s = self.promise_s * RESERVE_SHARE

    def install(self) -> "Preemption":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def uninstall(self) -> None:
        with self._lock:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def check(self) -> None:
        """Stop here if a stop was asked for (a point where nothing needs saving)."""
        if self.stop_requested:
            raise Abandon()

    def request(self, name: str, within_s: float | None = None) -> None:
        """A stop asked for without a signal (a cloud's preemption notice): same as SIGTERM.

        From another thread (the notice watcher) a real SIGTERM is sent to the main thread,
        so the one handler runs where it can abandon a step, and a blocking call there wakes
        up. Once uninstalled (the job is over) the request is dropped rather than let the
        default SIGTERM action kill the process. `within_s`: the notice names a deadline (Azure's
        NotBefore) closer than the grace, which then ends there."""
        if within_s is not None and within_s < self.seconds_left():
            self.set_grace(max(within_s, 0.1))
        if threading.current_thread() is threading.main_thread():
            self._on_signal(signal.SIGTERM, None, name=name)
            return
        with self._lock:
            if not self._previous:
                return
            self._notice_name = name
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def seconds_left(self) -> float:
        return self.promise_s if self.t_signal is None else self.promise_s - (time.monotonic() - self.t_signal)

    def _on_signal(self, signum, frame, name: str | None = None):
        self.count += 1
        if self.count == 1:
            self.signal_name = name or self._notice_name or signal.Signals(signum).name
            self.t_signal = time.monotonic()
        if not self._in_step:
            if self.starting:
                self._abandon(frame)
            return
        if self.count > 1:
            self._abandon(frame)
            return
        step_left = max(0.0, self.expected_step_s - (time.monotonic() - self._step_started))
        room = self.seconds_left() - self.reserve_s
        if step_left > room:
            self._abandon(frame)
            return
        # It should fit; make sure it does.
        signal.setitimer(signal.ITIMER_REAL, max(room, 0.01))

    def _on_alarm(self, signum, frame):
        if self.stop_requested and (self._in_step or self.starting):
            self._abandon(frame)

    def _abandon(self, frame) -> None:
        """Raise Abandon where the interrupted code is, unless it is inside an import: there a
        module's body may be running under a C extension's initializer (torch runs its own
        Python modules through pybind11 while it loads), where an exception cannot unwind and
        the process ends with std::terminate (SIGABRT, not 75: seen once in a full suite, a
        stop one second into a tune on a loaded machine). Then it is raised once the import
        is over, on an alarm a few milliseconds later."""
        if _importing(frame):
            signal.setitimer(signal.ITIMER_REAL, IMPORT_RECHECK_S)
            return
        raise Abandon()

    def start_up(self) -> None:
        """The CLI is starting a command (inside its one error handler): a stop from here until a
        job opens its state abandons at once, one already asked for right now."""
        self.starting = True
        self.check()

    def started(self) -> None:
        """A job is opening its state: from here a stop is answered between quanta, with a commit."""
        self.starting = False

    def stand_down(self) -> None:
        """The stop has been taken (Abandon caught, the exit being told): no later alarm (an
        import's recheck, a step's deadline) may raise Abandon again while the preemption is told."""
        self.starting = self._in_step = False
        signal.setitimer(signal.ITIMER_REAL, 0)

    @contextmanager
    def abandonable(self):
        """Marks a step that may be thrown away (forward/backward, one generation step)."""
        self._step_started = time.monotonic()
        if self.stop_requested and self.count > 1:
            raise Abandon()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            signal.setitimer(signal.ITIMER_REAL, 0)

    @contextmanager
    def setup(self):
        """Loading a model and restoring state: nothing new to save yet, so a stop request
        (now or already pending) abandons at once instead of waiting for a long load."""
        if self.stop_requested:
            raise Abandon()
        saved, self.expected_step_s = self.expected_step_s, float("inf")
        try:
            with self.abandonable():
                yield
        finally:
            self.expected_step_s = saved


_process: Preemption | None = None


def install_process_handler() -> Preemption:
    """The process's one handler, installed once by each entry point before heavy imports;
    every job (and a build's stages) in this process shares it."""
    global _process
    if _process is None:
        _process = Preemption(grace_from_env() or PROMISE_S).install()
        # A stop the bundle's zipapp recorded before this handler existed (runtime/bootstrap/early.py).
        for name in getattr(sys.modules.get("_spillpack_early"), "stopped", ())[:1]:
            _process.request(name)
    return _process


def process_handler() -> Preemption | None:
    """The process's handler, or None where no entry point installed one (a library caller)."""
    return _process
