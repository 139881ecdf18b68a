"""Experiment trackers (`--report-to tensorboard,mlflow,wandb`): one tracker run per job,
across every process and machine that runs it.

The job core feeds a `Reporter` (runtime/trackers/reporter.py) the events it already emits;
the reporter turns them into metrics, params and notes for each tracker on a background
thread, so a slow or dead tracker never slows or fails the job. Each tracker is one small
module with the same few members (see `Tracker`); its run (log dir, run id) is decided by the
first process and recorded in the job's state (`trackers/<name>.json`), so every later
process, on any machine, continues the same run.

Nothing here imports a tracker's library until a job asks for that tracker.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Protocol

from runtime.base.errors import SpillpackError, UsageError

# name -> (its module here, the library it imports, the distribution that installs it)
TRACKERS = {
    "tensorboard": ("runtime.trackers.tensorboard", "tensorboardX", "tensorboardX"),
    "mlflow": ("runtime.trackers.mlflow", "mlflow", "mlflow-skinny"),
    "wandb": ("runtime.trackers.wandb", "wandb", "wandb"),
}
ENV = "SPILLPACK_REPORT_TO"
# How long the trackers get to catch up at the end of a process that was not stopped (a stopped
# one gets what is left of its grace): a tracking server on a busy host can take seconds a call.
WAIT_ENV, WAIT_S, WAIT_MAX_S = "SPILLPACK_TRACKER_WAIT_S", 30.0, 3600.0


class Tracker(Protocol):
    """One tracker's run, opened in the reporter's thread."""

    name: str
    # True: it cannot take a value back, so it is given a step only once that step is committed
    # (a hard kill's redone steps are then logged once). False: it is given steps as they
    # happen and drops the redone ones itself (TensorBoard's purge_step).
    committed_only: bool

    def params(self, params: dict) -> None: ...

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Each (step, {name: value}) of `rows`, in step order (a checkpoint's steps come at once)."""

    def note(self, kind: str, text: str, step: int | None) -> None:
        """The seam of a preemption (interrupted, resumed, hard_kill) in the tracker's own words."""

    def close(self) -> None: ...


def parse(value, command: str = "tune") -> list[str]:
    """The tracker names in `value` (comma-separated text, or a list of such), checked; a usage
    error names the unknown one. "none": no tracker (not even SPILLPACK_REPORT_TO's)."""
    if value is None or value == "none":
        return []
    parts = value if isinstance(value, (list, tuple)) else [value]
    names: list[str] = []
    for part in parts:
        for name in str(part).split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in TRACKERS:
                raise UsageError(f"--report-to {name!r} is not a tracker spillpack reports to (one of {', '.join(TRACKERS)})",
                                 f"spillpack {command} ... --report-to tensorboard")
            if name not in names:
                names.append(name)
    return names


def wanted(option, command: str) -> list[str]:
    """The trackers this process reports to: --report-to, else SPILLPACK_REPORT_TO."""
    return parse(option if option is not None else os.environ.get(ENV) or None, command)


def module(name: str):
    return importlib.import_module(TRACKERS[name][0])


def close_wait_s() -> float:
    """SPILLPACK_TRACKER_WAIT_S in seconds (default 30); `check` refuses a bad one before the job."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= WAIT_MAX_S:  # NaN fails both
        raise SpillpackError(f"{WAIT_ENV}={raw!r} is not a number of seconds from 0 to {WAIT_MAX_S:.0f}", f"export {WAIT_ENV}={WAIT_S:.0f}")
    return value


def check(names: list[str], state_uri: str, job_name: str, command: str) -> None:
    """Before the job starts: each tracker's library is installed and where it writes is writable,
    else one line with what to do."""
    if names:
        close_wait_s()
    for name in names:
        _, library, dist = TRACKERS[name]
        try:
            found = importlib.util.find_spec(library) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SpillpackError(f"--report-to {name} needs {dist}, which is not installed here",
                                 f"pip install 'spillpack[{name}]' (a bundle: spillpack pack ... --report-to {name})")
        module(name).check(state_uri, job_name, command)


def writable_dir(path: str, name: str, variable: str, command: str) -> None:
    """`path` is a directory this process can write in (made if missing), else one line."""
    from pathlib import Path

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".spillpack-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SpillpackError(f"--report-to {name}: cannot write its log dir {path} ({e.strerror})",
                             f"{variable}=/a/writable/dir spillpack {command} ... --report-to {name}")


def local_root(state_uri: str, job_name: str):
    """Where a tracker's files go by default: under a local state, else (an s3:// state) under
    SPILLPACK_HOME/trackers/NAME on this machine (the run ids still travel with the state)."""
    from runtime.base.paths import spillpack_home
    from runtime.state.store import local_file

    path = local_file(state_uri)
    return path.absolute() if path is not None else spillpack_home() / "trackers" / job_name
