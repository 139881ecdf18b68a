"""How many CPU threads a job's torch runs, and how OpenMP's idle threads wait.

torch-cpu's kernels run on OpenMP threads (libgomp in torch's Linux wheels). By default an idle
OpenMP thread spins for a while before it sleeps, and every op ends at a barrier where each
thread waits for the slowest. On a core another process holds (a laptop's browser, a shared
node without CPU limits, other jobs), one thread is descheduled and the others spin at every
barrier for it: measured on a 2-core machine with one core kept busy, a 135M model generated
0.3 tokens/s with two threads against 5.1 with one. So, before torch is loaded:

- OpenMP's passive wait policy (`OMP_WAIT_POLICY=PASSIVE`: an idle thread sleeps at once;
  read by libgomp and by Intel's OpenMP alike) unless the user set one;
- one thread per CPU that is actually free when the job starts (per-CPU idle time over a short
  sample, within the CPUs the process is allotted: runtime.base.allotment), not per core.

`SPILLPACK_THREADS=N` sets the count; `OMP_NUM_THREADS`, OpenMP's own, wins over both.

A job that already ran keeps the count its state records (`keep`): torch's CPU kernels split
their sums by thread, so another count changes the last bits of every result (measured: all 32
tensors of a 6-step tiny tune differ, by up to 8.8e-7, between 1 and 2 threads), and a resumed
job would no longer end bit-identical to one that was never stopped. It is chosen again only
where the CPUs allotted now are fewer than it.
Standard library only: every entry point calls `quiet_openmp()` before anything imports torch.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Set before torch loads unless the user set them (each library reads its variable once): OpenMP's
# idle threads sleep instead of spinning, and oneDNN's primitive cache and ideep's (torch's
# bfloat16 matmuls on a CPU) keep 16 shapes instead of 1,024. Each shape kept holds 1-4 MB: a
# bfloat16 `run` of 128 rows on SmolLM2-135M peaked at 676 MB with the defaults, 636 MB with 16
# (a plan of 610), at the same speed; a bfloat16 tune step of the Qwen2.5-0.5B shape, 57 and 59
# tokens/s (measured on 2 threads of an Intel Xeon with AVX512-BF16).
# numpy's OpenBLAS (the small products of inference where it is faster: runtime/engines/torch/
# models/small_gemm.py) runs on one thread: its idle threads spin beside torch's, and a decode
# step's products are too small to split.
BEFORE_TORCH = {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16",
                "OPENBLAS_NUM_THREADS": "1"}
SAMPLE_S = 0.1  # per-CPU idle time is sampled this long at a job's start (10 clock ticks per CPU)


def quiet_openmp(environ=os.environ) -> None:
    """OpenMP's idle threads sleep instead of spinning, and oneDNN keeps few shapes (BEFORE_TORCH),
    unless the user chose otherwise. Must run before torch is imported (its OpenMP runtime reads
    the variable once, as it loads)."""
    for key, value in BEFORE_TORCH.items():
        environ.setdefault(key, value)


@dataclass(frozen=True)
class Threads:
    count: int
    why: str


def _cpu_ticks(allowed: set[int] | None) -> tuple[int, int] | None:
    """(idle, total) clock ticks summed over the allowed CPUs since boot, from /proc/stat (Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    idle = total = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if allowed is not None and int(name[3:]) not in allowed:
            continue
        ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        total += sum(ticks)
    return (idle, total) if total else None


def idle_cpus(cpus: int, sample_s: float = SAMPLE_S) -> float | None:
    """How many of the allowed CPUs sat idle over the last `sample_s` seconds (None: unknown)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    first = _cpu_ticks(allowed)
    if first is None:
        try:
            return max(0.0, cpus - os.getloadavg()[0])  # macOS: the 1-minute load, coarser
        except OSError:
            return None
    time.sleep(sample_s)
    second = _cpu_ticks(allowed)
    if second is None or second[1] <= first[1]:
        return None
    n = len(allowed) if allowed is not None else cpus
    return n * (second[0] - first[0]) / (second[1] - first[1])


def choose(allotted: int, environ=os.environ, idle: float | None = None) -> Threads:
    """The thread count for a job on `allotted` CPUs and why. `idle`: the CPUs found idle (sampled
    here when not given)."""
    if environ.get("OMP_NUM_THREADS"):
        return Threads(_positive(environ["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), "OMP_NUM_THREADS")
    if environ.get("SPILLPACK_THREADS"):
        return Threads(_positive(environ["SPILLPACK_THREADS"], "SPILLPACK_THREADS"), "SPILLPACK_THREADS")
    if allotted <= 1:
        return Threads(1, "1 CPU allotted")
    idle = idle_cpus(allotted) if idle is None else idle
    if idle is None:
        return Threads(allotted, f"{allotted} CPUs allotted")
    free = max(1, min(allotted, int(idle + 0.5)))
    if free == allotted:
        return Threads(free, f"{allotted} CPUs allotted, all free")
    return Threads(free, f"{idle:.1f} of {allotted} allotted CPUs idle at start (other processes hold the rest)")


def _positive(value: str, name: str) -> int:
    from runtime.base.errors import SpillpackError

    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise SpillpackError(f"{name}={value!r} is not a positive whole number of threads", f"{name}=2, or unset it")
    return n


_kept: Threads | None = None
_width: int | None = None  # the hidden size of the model this process's job runs (for_model)
_splits_rows = False  # the job is a tune, whose engine splits rows, not ops, across its threads (for_model)

# A model narrower than this runs on one thread whatever is free: its ops are too small to split,
# and under the passive wait policy every op split across threads also wakes a sleeping one.
# Measured on a 2-core AMD EPYC (Zen 4), tiny (128 wide), one thread against two: a tune 10.4k
# against 6.9k tokens/s, `run` of 128 rows 1.97 against 2.79 s in one process, alternating;
# SmolLM2-135M (576 wide) generated at 7.43 against 7.26 s (even). A tune is exempt: torch-cpu
# splits its micro-batches by rows across the threads, one thread per op (runtime/engines/torch/
# row_threads.py: tiny at two row threads, 17.4k tokens/s).
NARROW_WIDTH = 256


def for_model(width: int | None, splits_rows: bool = False) -> None:
    """The hidden size of the model the job runs, known before its engine takes up its threads
    (runtime.core.job.open_engine): a model narrower than NARROW_WIDTH runs on one thread, unless
    the job splits rows across its threads (`splits_rows`: a tune)."""
    global _width, _splits_rows
    _width, _splits_rows = width, splits_rows


def keep(history: list[dict], allotted: int, environ=os.environ) -> Threads | None:
    """Use the thread count the job's last torch-cpu process recorded (`history`: the state's
    records, oldest first; an `engine` record carries `threads`), when the user named none and
    this process is allotted at least that many CPUs. Call before the engine is made."""
    global _kept, _width, _splits_rows
    _kept = _width = None  # a build's stages are jobs of their own, in one process
    _splits_rows = False
    if environ.get("OMP_NUM_THREADS") or environ.get("SPILLPACK_THREADS"):
        return None
    ran = [r["threads"] for r in history if r.get("what") == "engine" and r.get("engine") == "torch-cpu"
           and isinstance(r.get("threads"), int) and r["threads"] > 0]
    if not ran or ran[-1] > allotted:
        return None
    _kept = Threads(ran[-1], "kept from this job's earlier starts (another count changes the results' last bits)")
    return _kept


def job_threads(allotted: int) -> Threads:
    """This process's choice, made once (the start event, the engine and doctor say the same)."""
    if _kept is not None:
        return _kept
    t = _chosen(allotted)
    if _width is not None and _width < NARROW_WIDTH and not _splits_rows and t.count > 1 and t.why not in ("OMP_NUM_THREADS", "SPILLPACK_THREADS"):
        return Threads(1, f"a model {_width} wide runs on one thread: its ops are too small to split ({t.why})")
    return t


@functools.cache
def _chosen(allotted: int) -> Threads:
    return choose(allotted)


def start_fields(engine_name: str, allotted: int) -> dict:
    """What a job's `start` event says of its threads (torch-cpu only: other engines' threads are not ours to pick)."""
    if engine_name != "torch-cpu":
        return {}
    t = job_threads(allotted)
    return {"threads": t.count, "threads_why": t.why}
