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

from runtime.errors import SpillpackError
from runtime.paths import spillpack_home

ENGINE_NAMES = ("mlx", "torch-cuda", "torch-cpu")


@dataclass
class EngineProbe:
    name: str
    usable: bool
    detail: str  # version and device when usable, the reason when not


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def probe(name: str) -> EngineProbe:
    if name == "torch-cpu":
        if importlib.util.find_spec("torch") is None:
            return EngineProbe(name, False, "torch is not installed (pip install torch)")
        import torch

        return EngineProbe(name, True, f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if name == "torch-cuda":
        if importlib.util.find_spec("torch") is None:
            return EngineProbe(name, False, "torch is not installed")
        import torch

        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            return EngineProbe(name, False, why)
        return EngineProbe(name, True, f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
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


def measure(name: str, seconds: float = 1.0) -> dict:
    """A short measured rate of a usable engine: float32 matmul GFLOP/s and copy bandwidth GB/s
    (bytes read + written), each the best of repeats within about seconds/2. The matmul grows
    from 512 until one multiply takes a visible time, so a GPU is not measured on launch
    overhead and a slow CPU build (mlx's on Linux) is not kept waiting."""
    import time

    if name == "mlx":
        import mlx.core as mx

        def ops(n, mb):
            a, buf = mx.random.normal((n, n)), mx.zeros((mb * 2**18,))
            mx.eval(a, buf)
            return (lambda: mx.eval(a @ a)), (lambda: mx.eval(buf * 1))
    else:
        import torch

        dev = "cuda" if name == "torch-cuda" else "cpu"
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def ops(n, mb):
            a, buf = torch.randn(n, n, device=dev), torch.zeros(mb * 2**18, device=dev)
            out = torch.empty_like(buf)
            return (lambda: (torch.mm(a, a), sync())), (lambda: (out.copy_(buf), sync()))

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
    return {"matmul_gflops": round(2 * n**3 / best(matmul) / 1e9, 1), "mem_gbps": round(2 * mb * 2**20 / best(copy) / 1e9, 1)}


def choose_engine(requested: str | None = "auto") -> tuple[str, str]:
    """The engine to use here and why."""
    requested = requested or "auto"
    env = os.environ.get("SPILLPACK_ENGINE")
    if requested == "auto" and env:
        requested, source = env, "SPILLPACK_ENGINE"
    else:
        source = "--engine"
    if requested != "auto":
        if requested not in ENGINE_NAMES:
            raise SpillpackError(f"unknown engine {requested!r} from {source}", "--engine mlx|torch-cuda|torch-cpu")
        p = probe(requested)
        if not p.usable:
            raise SpillpackError(f"engine {requested} is not usable here: {p.detail}", "spillpack doctor")
        return requested, f"asked for by {source}"
    if is_apple_silicon() and probe("mlx").usable:
        return "mlx", "Apple silicon with mlx installed"
    cuda = probe("torch-cuda")
    if cuda.usable:
        return "torch-cuda", f"a CUDA device is visible ({cuda.detail.split(', ', 1)[-1]})"
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


def memory_for(engine: str, cap_gb: float | None = None) -> tuple[float, str, float]:
    """(GB a job may plan for, where that figure comes from, GB the process already holds that
    the plan must count). A host engine's plan counts this process's resident memory (interpreter,
    framework, tokenizer, data) and may use it plus what the machine has available; a GPU's plan
    is its free memory, with the CUDA context counted by the planner."""
    import psutil

    rss = psutil.Process().memory_info().rss / 2**30
    if engine == "torch-cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        available, source, held = free / 2**30, "free GPU memory", 0.0
    else:
        available, source, held = psutil.virtual_memory().available / 2**30 + rss, "available memory", rss
        if engine == "mlx":
            import mlx.core as mx

            if mx.default_device() == mx.gpu:  # unified memory: Metal's working-set limit is the ceiling
                limit = mx.device_info().get("max_recommended_working_set_size")
                if limit:
                    available, source = min(available, limit / 2**30), "Metal working set"
    if cap_gb is not None:
        available, source = cap_gb, "--max-mem-gb"
    return available, source, held
