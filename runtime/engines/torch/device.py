"""What the torch engine needs from its device beyond the model: deterministic kernels, a
record of what ran, and the peak memory a job reached.

Determinism: cuBLAS picks its reduction split from a workspace whose size is fixed only when
CUBLAS_WORKSPACE_CONFIG is set before its first handle exists, and SDPA's flash and
memory-efficient backward kernels accumulate with atomics unless torch's deterministic mode is
on (in strict mode, not warn_only: warn_only keeps the atomic kernels and only warns). So both
are set before the engine puts anything on a CUDA device. With them, a tune repeats bit for bit
on the same GPU model with the same torch, CUDA and cuDNN; on another GPU model or software the
kernels differ and results agree only within rounding (docs/state.md states the tolerance).
"""

from __future__ import annotations

import os
import platform
import resource
import sys

import torch

from runtime.base.allotment import cpus
from runtime.base.place import cpu_model
from runtime.base.threads import job_threads

CUBLAS_WORKSPACE = ":4096:8"  # the setting NVIDIA documents for reproducible cuBLAS results


def before_cuda() -> None:
    """Environment that must exist before CUDA libraries start in this process (no torch call)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def fit_threads(device: torch.device) -> int:
    """On a CPU, one torch thread per CPU this process is allotted and finds free at its start
    (runtime.base.threads: a core another process holds makes every op wait for the thread
    descheduled there; under a pod's CPU quota, threads beyond it wait on each other the same
    way). OMP_NUM_THREADS, when set, is the user's choice and torch already follows it."""
    if device.type == "cpu":
        threads = job_threads(cpus().count)
        if threads.why != "OMP_NUM_THREADS" and torch.get_num_threads() != threads.count:
            torch.set_num_threads(threads.count)
    return torch.get_num_threads()


def make_deterministic(device: torch.device) -> None:
    """Deterministic kernels for everything the engine runs on `device`. On a CPU torch's kernels
    already are (and strict mode would only refuse ops nobody asked about), so only CUDA is set."""
    if device.type != "cuda":
        return
    before_cuda()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False  # autotuning may pick a different kernel per process
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 bases compute in float32, as on a CPU
    torch.backends.cudnn.allow_tf32 = False


def describe(device: torch.device) -> dict:
    """Device model and software versions: what must match for a resume to be bit-identical."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
        software = f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        return {"device": f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GB)", "software": software}
    # threads: a resume keeps the count (runtime.base.threads.keep), its sums split the same way
    return {"device": f"{cpu_model()} ({platform.machine()})", "software": f"torch {torch.__version__}",
            "threads": torch.get_num_threads()}


class PeakMemory:
    """The most memory this job has held on its device, from a reset at the job's start.

    On CUDA it is the caching allocator's reserved memory: what the allocator took from the
    device, which is what an out-of-memory error hits (allocated memory leaves out the cache's
    blocks and fragmentation). The CUDA context (0.3-0.6 GB, outside the allocator) is not in it.
    On a CPU it is the process's peak resident set (VmHWM), reset through /proc/self/clear_refs
    where Linux allows it, so a second job in one process (a build's stages) reports its own.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks an earlier job of this process (a build's stage) left cached are not this job's
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            pass  # not Linux, or not allowed: the peak is then the process's, not the job's

    def gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**30
        hwm = _vm_hwm_kb()
        if hwm is not None:
            return hwm / 2**20
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / (2**30 if sys.platform == "darwin" else 2**20)


def _vm_hwm_kb() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
