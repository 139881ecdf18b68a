"""What this process may use of the machine: the CPUs and memory its container, pod or job
step is allotted, which os.cpu_count() and the host's free memory do not show.

A Kubernetes pod with `limits: {cpu: 2, memory: 16Gi}` on a 64-core, 512 GB node sees all 64
cores and 500 GB free. torch then starts 64 threads that the CPU quota throttles (a step can
run 50x slower than with 2), and a memory plan sized for 500 GB is killed by the OOM killer
at 16. The limits live in the process's cgroup (v2: cpu.max, memory.max; v1: cpu.cfs_quota_us,
memory.limit_in_bytes, on the cgroup and every ancestor) and its CPU affinity mask (Slurm's
cpusets, taskset). Stdlib only: read once per question, no caching, nothing written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Cpus:
    count: int  # CPUs this process may keep busy
    machine: int  # CPUs the machine has
    source: str  # "cores", "CPU affinity" or "cgroup CPU quota"

    def describe(self) -> str:
        if self.count == self.machine:
            return f"{self.count} cores"
        return f"{self.count} of {self.machine} cores ({self.source})"


@dataclass(frozen=True)
class MemoryLimit:
    limit: int  # bytes the cgroup may hold (the tightest of it and its ancestors)
    working_set: int  # bytes it holds now, less the file cache the kernel can drop first

    @property
    def available(self) -> int:
        return max(0, self.limit - self.working_set)


def _cgroup_dirs(controller: str, proc_cgroup: str, root: Path) -> list[Path]:
    """The process's cgroup directory for `controller` and its ancestors, innermost first.
    cgroup v2 lines read `0::/path`; v1 lines `N:cpu,cpuacct:/path`."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            bases = [root, root / "unified"]  # v2, mounted alone or beside v1 (hybrid)
            marker = {"cpu": "cpu.max", "memory": "memory.max"}[controller]
        elif controller in controllers.split(","):
            bases = [root / controllers, root / controller]
            marker = {"cpu": "cpu.cfs_quota_us", "memory": "memory.limit_in_bytes"}[controller]
        else:
            continue
        for base in bases:
            d = base / path.lstrip("/")
            # Inside a container the path may name the host's cgroup while the namespace's root
            # is the container's own: then the limits are at the mount's root.
            start = d if (d / marker).exists() else base if (base / marker).exists() else None
            if start is None:
                continue
            chain = [start]
            while chain[-1] != base and chain[-1].parent != chain[-1]:
                chain.append(chain[-1].parent)
            found.extend(p for p in chain if (p / marker).exists())
            break
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _quota_cpus(d: Path) -> float | None:
    """CPUs' worth of time per period one cgroup directory allows, None without a quota."""
    v2 = _read(d / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def cpus(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> Cpus:
    machine = os.cpu_count() or 1
    count, source = machine, "cores"
    if hasattr(os, "sched_getaffinity"):
        mask = len(os.sched_getaffinity(0))
        if 0 < mask < count:
            count, source = mask, "CPU affinity"
    try:
        proc_cgroup = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return Cpus(count, machine, source)
    for d in _cgroup_dirs("cpu", proc_cgroup, root):
        try:
            quota = _quota_cpus(d)
        except ValueError:
            continue
        if quota is not None and math.ceil(quota) < count:
            count, source = max(1, math.ceil(quota)), "cgroup CPU quota"
    return Cpus(count, machine, source)


def _memory_of(d: Path) -> tuple[int, int] | None:
    """(limit, working set) of one cgroup directory, None without a limit."""
    v2 = _read(d / "memory.max")
    if v2 is not None:
        if v2 == "max":
            return None
        usage, stat_key = _read(d / "memory.current"), "inactive_file"
        limit = int(v2)
    else:
        raw = _read(d / "memory.limit_in_bytes")
        if raw is None or int(raw) >= NO_LIMIT:
            return None
        usage, stat_key = _read(d / "memory.usage_in_bytes"), "total_inactive_file"
        limit = int(raw)
    inactive = 0
    for line in (_read(d / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == stat_key:
            inactive = int(value)
    used = int(usage) if usage else 0
    return limit, max(0, used - inactive)  # the working set, as the kubelet counts it


def memory_limit(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> MemoryLimit | None:
    """The tightest memory limit over the process's cgroup and its ancestors, or None."""
    try:
        proc_cgroup = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    tightest = None
    for d in _cgroup_dirs("memory", proc_cgroup, root):
        try:
            found = _memory_of(d)
        except ValueError:
            continue
        if found is not None and (tightest is None or found[0] - found[1] < tightest.available):
            tightest = MemoryLimit(*found)
    return tightest
