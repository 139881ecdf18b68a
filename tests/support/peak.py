"""A CLI process's peak resident memory, sampled from /proc/PID/status (VmHWM) until it exits.

Not ru_maxrss: across fork and exec Linux carries the parent's high water mark into the child's,
so a child of a big pytest process reports at least the parent's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

GB = 2**30


def vm_hwm_kb(pid="self") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc: these tests need Linux")


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str
    peak_gb: float


def run_with_peak(args, tmp_path, env=None, cwd=None, timeout: float = 300) -> Measured:
    """`python -m spillpack *args` as a user runs it (headless, one thread), with its peak RSS;
    killed past `timeout` seconds (returncode -9)."""
    from conftest import REPO

    out, err = tmp_path / "peak.stdout", tmp_path / "peak.stderr"
    full_env = {**os.environ, "SPILLPACK_HEADLESS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    peak, t0 = 0, time.monotonic()
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=o, stderr=e, env=full_env, cwd=cwd or REPO)
        while proc.poll() is None:
            try:
                peak = max(peak, vm_hwm_kb(proc.pid))  # monotone: the last reading is the peak but for the last moments
            except (OSError, AssertionError):
                pass  # exited between poll and read
            if time.monotonic() - t0 > timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.02)
    return Measured(proc.returncode, out.read_text(), err.read_text(), peak * 1024 / GB)
