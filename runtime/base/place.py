"""Where this process runs, for the job's history and `spillpack status`: the machine (host,
device), and what the scheduler or cloud says about it (zone, instance type, job id).

Everything here is read from the environment and local files, without waiting on anything:
the cloud's metadata (zone, instance type) is read by the notice watcher's thread, which
already asks that server (runtime/core/notices.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

from runtime.base.allotment import cpus, memory_limit


def device(engine: str | None) -> str:
    """The accelerator or CPU a job computes on, with its memory: 'NVIDIA H100 80GB HBM3, 79.6 GB'."""
    if engine == "torch-cuda":
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return f"{props.name}, {props.total_memory / 2**30:.1f} GB"
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=5).stdout.splitlines()
            if out:
                name, mem = (x.strip() for x in out[0].split(",", 1))
                return f"{name}, {mem}"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
        return "a CUDA device"
    limit, total = memory_limit(), _memory_gb()
    memory = f"{total:.1f} GB" if limit is None or limit.limit / 2**30 >= total else \
        f"{limit.limit / 2**30:.1f} of {total:.1f} GB (cgroup memory limit)"
    return f"{cpu_model()}, {cpus().describe()}, {memory}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "CPU"


def _memory_gb() -> float:
    """The machine's physical memory (sysconf: Linux and macOS alike, no third-party package)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def scheduler(env=None) -> dict:
    """What SkyPilot, Slurm or Kubernetes say about this process (absent keys: not known)."""
    env = os.environ if env is None else env
    out: dict = {}
    if env.get("SKYPILOT_TASK_ID") or env.get("SKYPILOT_CLUSTER_INFO"):
        out["scheduler"] = "skypilot"
        try:
            info = json.loads(env.get("SKYPILOT_CLUSTER_INFO") or "{}")
        except ValueError:
            info = {}
        for key in ("cloud", "region", "zone"):
            if info.get(key):
                out[key] = str(info[key])
        if env.get("SKYPILOT_TASK_ID"):
            out["job_id"] = env["SKYPILOT_TASK_ID"]
    elif env.get("SLURM_JOB_ID"):
        out["scheduler"] = "slurm"
        out["job_id"] = env["SLURM_JOB_ID"] + (f"_{env['SLURM_ARRAY_TASK_ID']}" if env.get("SLURM_ARRAY_TASK_ID") else "")
        if env.get("SLURM_JOB_PARTITION"):
            out["partition"] = env["SLURM_JOB_PARTITION"]
        if env.get("SLURM_RESTART_COUNT"):
            out["restart"] = int(env["SLURM_RESTART_COUNT"]) if env["SLURM_RESTART_COUNT"].isdigit() else env["SLURM_RESTART_COUNT"]
    elif env.get("KUBERNETES_SERVICE_HOST"):
        out["scheduler"] = "kubernetes"
        out["pod"] = env.get("HOSTNAME", "")
    return out


def describe(engine: str | None) -> dict:
    """The fields of a process's `open` record beyond host and engine (a data-parallel group
    adds its world and hosts: runtime/core/job.py)."""
    return {"device": device(engine), **scheduler()}
