"""What this machine is, and which engine a job should use on it.

Apple silicon uses MLX, a visible CUDA device uses torch-cuda, anything else
torch-cpu; --engine or SPILLPACK_ENGINE overrides. Probing never imports a
framework that is not installed and never fails: it reports why an engine is not usable.
"""

import importlib.util
import os
import platform
import shutil
from dataclasses import dataclass

from runtime.base.allotment import memory_limit
from runtime.engines.nvidia import CudaFacts, diagnose, machine_facts
from runtime.base.errors import SpillpackError
from runtime.base.heap import glibc
from runtime.base.paths import spillpack_home

ENGINE_NAMES = ("mlx", "torch-cuda", "torch-cpu")


@dataclass
class EngineProbe:
    name: str
    usable: bool
    detail: str  # version and device when usable, the reason when not
    gpu_unusable: bool = False  # torch-cuda only: a GPU is here but CUDA cannot use it
    fix: str = ""  # what to do about it, when not usable


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def cuda_facts() -> CudaFacts:
    """torch's side of whether CUDA works here, then the machine's (runtime.engines.nvidia)."""
    f = CudaFacts()
    if importlib.util.find_spec("torch") is not None:
        from runtime.engines.torch.device import before_cuda

        before_cuda()  # the probe is the first thing in a job to touch CUDA
        import torch

        f.torch_version, f.torch_cuda = torch.__version__, torch.version.cuda
        f.available = torch.cuda.is_available()
        if f.available:
            f.device_name = torch.cuda.get_device_name(0)
            return f
        if f.torch_cuda is not None:
            try:
                torch.cuda.init()  # raises with the reason is_available() keeps to itself
            except Exception as e:  # any failure here is the diagnosis, not a crash
                f.init_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return machine_facts(f)


def probe(name: str, cuda: CudaFacts | None = None) -> EngineProbe:
    """Whether engine `name` is usable here. `cuda`: the facts torch-cuda is judged from
    (gathered from this machine when not given; tests give made-up ones)."""
    if name == "torch-cpu":
        if importlib.util.find_spec("torch") is None:
            return EngineProbe(name, False, "torch is not installed (pip install torch)")
        import torch

        from runtime.engines.torch.device import fit_threads

        threads = fit_threads(torch.device("cpu"))  # before anything measures or runs on the CPU
        return EngineProbe(name, True, f"torch {torch.__version__}, {threads} threads")
    if name == "torch-cuda":
        d = diagnose(cuda if cuda is not None else cuda_facts())
        return EngineProbe(name, d.usable, d.detail, d.gpu_unusable, d.fix)
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None:
            return EngineProbe(name, False, "mlx is not installed (pip install mlx, or mlx[cpu] on Linux)")
        try:
            import mlx.core as mx

            device = mx.default_device()
        except Exception as e:  # a broken mlx install must not break doctor
            return EngineProbe(name, False, f"mlx does not load: {e}")
        return EngineProbe(name, True, f"mlx {getattr(mx, '__version__', '?')}, {device}")
    raise ValueError(name)


def measure(name: str, seconds: float = 1.0, dtype: str | None = None) -> dict:
    """A short measured rate of a usable engine: matmul GFLOP/s in the dtype the engine's base
    computes in (bfloat16 on a recent GPU, not float32 with TF32 off, which is ~1/15 of it on an
    H100) and copy bandwidth GB/s (bytes read + written), each the best of repeats within about
    seconds/2. The matmul grows from 512 until one multiply takes a visible time, so a GPU is
    not measured on launch overhead and a slow CPU build (mlx's on Linux) is not kept waiting.
    `dtype` ("float32", "bfloat16"): measure in that dtype instead (a job whose base takes it)."""
    import time

    if name == "mlx":
        import mlx.core as mx

        dtype = getattr(mx, dtype) if dtype else mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32

        def ops(n, mb):
            a, buf = mx.random.normal((n, n)).astype(dtype), mx.zeros((mb * 2**18,))
            mx.eval(a, buf)
            return (lambda: mx.eval(a @ a)), (lambda: mx.eval(buf * 1))
    else:
        import torch

        from runtime.engines.torch.precision import device_precision

        dev = torch.device("cuda" if name == "torch-cuda" else "cpu")
        dtype = getattr(torch, dtype) if dtype else device_precision(dev).base
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        from runtime.engines.torch.models.gemm import gemm, onednn_linear, pack

        # A float32 CPU base's large linears run on oneDNN (runtime/engines/torch/models/gemm.py):
        # its rate is the engine's, not MKL's (2-core AMD EPYC: 155 against 128 GFLOP/s).
        onednn = dev.type == "cpu" and dtype == torch.float32 and onednn_linear()

        def ops(n, mb):
            a, buf = torch.randn(n, n, device=dev).to(dtype), torch.zeros(mb * 2**18, device=dev)
            out = torch.empty_like(buf)
            packed = pack(a) if onednn else None
            product = (lambda: gemm(a, packed)) if onednn else (lambda: torch.mm(a, a))
            return (lambda: (product(), sync())), (lambda: (out.copy_(buf), sync()))

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def best(fn) -> float:
        fn()  # warm-up: allocation, kernel choice
        times, t_end = [], time.perf_counter() + seconds / 2
        while not times or (time.perf_counter() < t_end and len(times) < 100):
            times.append(timed(fn))
        return min(times)

    mb = 256 if name == "torch-cuda" else 64
    for n in (512, 1024, 2048, 4096):
        matmul, copy = ops(n, mb)
        matmul()
        if timed(matmul) > seconds / 20:
            break
    return {"matmul_gflops": round(2 * n**3 / best(matmul) / 1e9, 1), "mem_gbps": round(2 * mb * 2**20 / best(copy) / 1e9, 1),
            "matmul_dtype": str(dtype).rsplit(".", 1)[-1]}


RATES_FILE = "cache/rates.json"


def _rates_key(name: str, dtype: str | None = None) -> str:
    # version and device: another GPU or torch is measured anew; "kernels" marks rates measured on
    # the engine's own GEMM (oneDNN's on a float32 CPU), so one cached from MKL's is measured again
    return f"{name}: {probe(name).detail}, kernels 2" + (f" [{dtype}]" if dtype else "")


def remember_rate(name: str, rate: dict, dtype: str | None = None) -> None:
    """Keep a measured rate under SPILLPACK_HOME for later jobs' estimates (doctor's, or a job's own)."""
    import orjson

    from runtime.base.fileio import atomic_write

    path = spillpack_home() / RATES_FILE
    try:
        rates = orjson.loads(path.read_bytes()) if path.exists() else {}
    except (OSError, orjson.JSONDecodeError):
        rates = {}
    rates[_rates_key(name, dtype)] = rate
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, orjson.dumps(rates, option=orjson.OPT_INDENT_2))
    except OSError:
        pass  # an estimate's cache must never fail a job


def _cached_rates() -> dict:
    """The rates cache's entries by key ({} where it is missing or unreadable)."""
    import orjson

    try:
        rates = orjson.loads((spillpack_home() / RATES_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return rates if isinstance(rates, dict) else {}


def cached_measurement(name: str, what: str, measure_now) -> dict:
    """A measurement of engine `name` on this machine (`what` names it), remembered in the rates
    cache: the cached one where its every figure is a positive number, else `measure_now()`'s,
    kept for later jobs. The choices made from it (runtime/engines/torch/models/small_gemm.py)
    stay put between jobs; a damaged entry is measured again, never a failed job."""
    cached = _cached_rates().get(_rates_key(name, what))
    if isinstance(cached, dict) and cached and all(isinstance(v, (int, float)) and v > 0 for v in cached.values()):
        return cached
    measured = measure_now()
    remember_rate(name, measured, what)
    return measured


def engine_rate(name: str, dtype: str | None = None) -> dict:
    """This engine's measured rate here (in `dtype`, the job's base dtype, where given):
    remembered from doctor or an earlier job, else measured now (a quarter of a second) and
    remembered."""
    rates = _cached_rates()
    cached = rates.get(_rates_key(name, dtype))
    if not cached and dtype:  # doctor's measurement, when it was in this dtype
        cached = rates.get(_rates_key(name))
        cached = cached if isinstance(cached, dict) and cached.get("matmul_dtype") == dtype else None
    if isinstance(cached, dict) and cached.get("matmul_gflops"):
        return cached
    return_freed_memory()
    rate = measure(name, seconds=0.25, dtype=dtype)
    return_freed_memory()
    remember_rate(name, rate, dtype)
    return rate


TRAIN_MMAP_THRESHOLD = 4 << 20  # a tune step's (return_freed_memory)


def return_freed_memory(threshold: int = 1 << 20) -> None:
    """Have glibc give blocks of `threshold` bytes or more their own mappings, returned to the
    system when freed, and hand back what its heap already holds free. By default glibc raises
    that threshold to the size of the last freed block, up to 32 MB; fixing it stops the raise,
    so the process behaves the same from its first step (a tune's memory plan counts the
    process's resident memory, and the rate measurement's freed buffers, about 70 MB, would
    otherwise leave the first job on a machine planning with less memory than every later one).
    Generation keeps 1 MB (its memory plan is held to 10% of the measured peak; at 32 MB a
    64-slot run on tiny peaked 11% over the budget the plan is held to). Training takes 4 MB
    (TRAIN_MMAP_THRESHOLD, set when a torch train session starts): every block under it that a
    step frees is reused by the next instead of mapped, faulted in and zeroed page by page again
    (1.7 million page faults a step at 1 MB). Measured on the Qwen2.5-0.5B shape, batch 4 x 178
    tokens, 2 threads of an Intel Xeon with AMX, a bfloat16 step: 103-106 tokens/s at 1 MB, 145
    at 4 MB, 152 at 16 MB, 156-167 at 32 MB (float32: 68 at 1 MB, 83 at 32 MB); peak RSS 2.46 ->
    2.77 GB at 4 MB. 32 MB would be faster still, but its freed blocks stay on the heap: at
    4 x 528 tokens in float32 the peak rose to 8.0 GB (6.3 at 4 MB) and with checkpointing to
    4.0 GB (2.75 at 4 MB), 19% and 33% over the memory plan, which 4 MB keeps within 3%.
    Elsewhere (macOS, musl) a no-op."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (fixing it also stops the dynamic raise)
        libc.malloc_trim(0)


def choose_engine(requested: str | None = "auto", cuda: CudaFacts | None = None) -> tuple[str, str]:
    """The engine to use here and why. `auto` refuses to put a job on the CPU of a machine whose
    GPU CUDA cannot use (a driver too old for the wheel, a CPU-only torch, a device not passed
    into a container): such a job would run 10-100x slower on a machine rented for its GPU, and
    headless, nobody would read a warning before the hours are spent. Exit 1 names the cause and
    the fix; `--engine torch-cpu` (or SPILLPACK_ENGINE) runs it on the CPU knowingly."""
    requested = requested or "auto"
    env = os.environ.get("SPILLPACK_ENGINE")
    if requested == "auto" and env:
        requested, source = env, "SPILLPACK_ENGINE"
    else:
        source = "--engine"
    if requested != "auto":
        if requested not in ENGINE_NAMES:
            raise SpillpackError(f"unknown engine {requested!r} from {source}", "--engine mlx|torch-cuda|torch-cpu")
        p = probe(requested, cuda)
        if not p.usable:
            raise SpillpackError(f"engine {requested} is not usable here: {p.detail}", p.fix or "spillpack doctor")
        why = f"asked for by {source}"
        if requested == "torch-cpu":
            gpu = probe("torch-cuda", cuda)
            if gpu.gpu_unusable:
                why += f" (not torch-cuda: {gpu.detail})"
        return requested, why
    if is_apple_silicon() and probe("mlx").usable:
        return "mlx", "Apple silicon with mlx installed"
    gpu = probe("torch-cuda", cuda)
    if gpu.usable:
        return "torch-cuda", f"a CUDA device is visible ({gpu.detail.split(', ', 1)[-1]})"
    if gpu.gpu_unusable:
        raise SpillpackError(f"{gpu.detail}; --engine auto does not fall back to the CPU on a GPU machine", gpu.fix)
    cpu = probe("torch-cpu")
    if cpu.usable:
        return "torch-cpu", "no Apple silicon or CUDA device" if not is_apple_silicon() else "mlx is not installed"
    if probe("mlx").usable:
        return "mlx", "torch is not installed; mlx is"
    raise SpillpackError("no engine is usable here: neither torch nor mlx is installed", "pip install torch==2.13.0")


def memory_gb() -> tuple[float, float]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.total / 2**30, vm.available / 2**30


def disk_free_gb(path=None) -> float:
    path = path or spillpack_home()
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return shutil.disk_usage(path).free / 2**30


def load_framework(engine: str) -> None:
    """Import the engine's framework now, so what this process holds (memory_for) counts it: a plan
    made before the engine is (a row job's floor, runtime/jobs/sizing.py)."""
    if engine.startswith("torch"):
        import torch  # noqa: F401
    elif engine == "mlx":
        import mlx.core  # noqa: F401


def memory_for(engine: str, cap_gb: float | None = None) -> tuple[float, str, float]:
    """(GB a job may plan for, where that figure comes from, GB the process already holds that
    the plan must count). A host engine's plan counts this process's resident memory (interpreter,
    framework, tokenizer, data) and may use it plus what the machine (or its cgroup's memory limit:
    a Kubernetes pod, a Slurm job step, a container) has available; a GPU's plan
    is its free memory, with the CUDA context counted by the planner."""
    import psutil

    rss = psutil.Process().memory_info().rss / 2**30
    if engine == "torch-cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        available, source, held = free / 2**30, "free GPU memory", 0.0
    else:
        available, source, held = psutil.virtual_memory().available / 2**30 + rss, "available memory", rss
        limit = memory_limit()  # a pod's or job step's limit, which the host's free memory does not show
        if limit is not None:
            # What others in the cgroup do not hold; never more than the limit (this process's
            # resident size counts mapped library pages the cgroup may count as dropable cache).
            within = min(limit.limit, limit.available + rss * 2**30) / 2**30
            if within < available:
                available, source = within, "cgroup memory limit"
        if engine == "mlx":
            import mlx.core as mx

            if mx.default_device() == mx.gpu:  # unified memory: Metal's working-set limit is the ceiling
                limit = mx.device_info().get("max_recommended_working_set_size")
                if limit:
                    available, source = min(available, limit / 2**30), "Metal working set"
    if cap_gb is not None:
        available, source = cap_gb, "--max-mem-gb"
    return available, source, held
