"""Running a job as a user does, and interrupting it with real signals."""

import json
import os
import signal
import subprocess
import sys

from conftest import REPO


def start(args, env=None, cwd=None) -> subprocess.Popen:
    full_env = {**os.environ, "SPILLPACK_HEADLESS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=cwd or REPO)


def run_until(args, when, sig=signal.SIGTERM, env=None, timeout=300) -> tuple[int, list[dict], str]:
    """Start the job, send `sig` at the first event for which when(event) is true, and
    return (exit code, events, stderr). The job may be a few steps past that event when
    the signal lands: nothing in the tests depends on where exactly it stops."""
    p = start(args, env)
    events, sent = [], False
    for line in p.stdout:
        e = json.loads(line)
        events.append(e)
        if not sent and when(e):
            p.send_signal(sig)
            sent = True
    rc = p.wait(timeout=timeout)
    err = p.stderr.read()
    assert sent, f"the job ended before the signal was sent: {err}"
    return rc, events, err


def handler_installed(pid: int, sig=signal.SIGTERM) -> bool:
    """Whether process `pid` catches `sig` yet (SigCgt in /proc): before that moment, no code
    of ours runs in it, and the kernel's default action is all a signal can meet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (int(sig) - 1) & 1)


def signal_after(p: subprocess.Popen, seconds: float, sig=signal.SIGTERM) -> None:
    """Send `sig` `seconds` after the start, or, on a machine so loaded that the interpreter
    has not reached our handler by then, at the first moment it has (the promise begins there)."""
    import time

    t0 = time.monotonic()
    time.sleep(seconds)
    while not handler_installed(p.pid, sig) and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    p.send_signal(sig)
