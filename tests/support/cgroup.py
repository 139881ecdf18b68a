"""A real memory limit for a test's CLI processes: a cgroup the test makes (v2 `memory.max`, or v1
`memory.limit_in_bytes` where that is what the machine mounts), under the test process's own cgroup,
with the command started inside it. The kernel then enforces the limit as a Kubernetes pod's or a
Slurm job step's is: past it, pages are reclaimed and, where nothing can be, the process is
OOM-killed (reported by `oom_kills`).

    limit = MemoryLimit.make(700 * 2**20)     # None where none can be made: limit_unavailable() says why
    r = limit.run(["run", ...], env=...)      # as conftest.run_cli, inside the cgroup (limit.popen for signals)
    limit.oom_kills(), limit.peak_bytes()
    limit.close()
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


def _own_dir(version: int) -> Path | None:
    """This process's cgroup directory of the memory controller (v1) or of the unified tree (v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if version == 2 and controllers == "":
            base = ROOT if (ROOT / "cgroup.controllers").exists() else ROOT / "unified"
            return base / path.lstrip("/")
        if version == 1 and "memory" in controllers.split(","):
            return ROOT / "memory" / path.lstrip("/")
    return None


def _candidates() -> list[tuple[int, Path]]:
    out = []
    own2 = _own_dir(2)
    if own2 is not None and "memory" in _read(own2.parent / "cgroup.subtree_control").split() + _read(own2 / "cgroup.controllers").split():
        out.append((2, own2))
    own1 = _own_dir(1)
    if own1 is not None and (own1 / "memory.limit_in_bytes").exists():
        out.append((1, own1))
    return out


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def limit_unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None."""
    for version, parent in _candidates():
        probe = parent / f"spillpack-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return None
        except OSError as e:
            last = f"cgroup v{version} {parent} is not writable ({e.strerror})"
    return last if _candidates() else "no memory cgroup controller is mounted (neither v2 memory.max nor v1 memory.limit_in_bytes)"


class MemoryLimit:
    def __init__(self, version: int, path: Path, limit: int):
        self.version, self.path, self.limit = version, path, limit

    @classmethod
    def make(cls, limit_bytes: int) -> "MemoryLimit | None":
        for version, parent in _candidates():
            path = parent / f"spillpack-test-{os.getpid()}-{next(_names)}"
            try:
                path.mkdir()
            except OSError:
                continue
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                if (path / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit either
                    try:
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                    except OSError:
                        pass
            return cls(version, path, limit_bytes)
        return None

    def argv(self, args: list[str]) -> list[str]:
        """The argv of `python -m spillpack *args` run inside this cgroup: the interpreter writes its
        pid into cgroup.procs, then execs the CLI, so everything the CLI maps is counted."""
        boot = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
                "os.execv(sys.executable, [sys.executable, '-m', 'spillpack', *sys.argv[2:]])")
        return [sys.executable, "-c", boot, str(self.path / "cgroup.procs"), *args]

    def popen(self, args: list[str], env=None, **kw) -> subprocess.Popen:
        """As conftest.run_cli starts the CLI (headless, JSON lines), inside this cgroup; a Popen."""
        from conftest import REPO

        full_env = {**os.environ, "SPILLPACK_HEADLESS": "1", **(env or {})}
        return subprocess.Popen(self.argv(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, cwd=kw.pop("cwd", REPO), **kw)

    def run(self, args: list[str], env=None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        """conftest.run_cli, inside this cgroup."""
        proc = self.popen(args, env, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def oom_kills(self) -> int:
        if self.version == 2:
            for line in _read(self.path / "memory.events").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        for line in _read(self.path / "memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0  # an older kernel without the counter: the process's -9 exit says it

    def peak_bytes(self) -> int:
        """The most the cgroup held (page cache included), as the kernel counted it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int(_read(self.path / name) or 0)

    def close(self) -> None:
        for _ in range(50):
            pids = [int(p) for p in _read(self.path / "cgroup.procs").split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)

