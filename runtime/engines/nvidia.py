"""Why torch-cuda is or is not usable on this machine, from facts gathered in one place.

`torch.cuda.is_available()` answers False without a reason, whether the machine has no GPU,
the torch wheel is a CPU build, or the NVIDIA driver is too old for the wheel's CUDA. The last
two look like "no GPU" and would quietly put a job on the CPU of a GPU machine. So the facts
(device nodes, nvidia-smi, the driver's version, torch's CUDA version and the error CUDA gives
when asked to start) are gathered by `gather()`, and `diagnose()` is a pure function of them:
tests give it made-up facts, the probe (runtime.engines.hardware) gives it this machine's.
Standard library only: torch's side of the facts is filled in by the probe.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from dataclasses import dataclass, field

# The oldest Linux driver each CUDA major version runs on (CUDA's minor-version compatibility,
# NVIDIA's CUDA toolkit release notes, table 2). A wheel built for CUDA 12.x needs >= 525.60.13.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


@dataclass
class CudaFacts:
    device_nodes: list[str] = field(default_factory=list)  # /dev/nvidia0, /dev/nvidia1, ...
    smi: str | None = None  # the nvidia-smi executable, when on PATH
    gpus: list[str] = field(default_factory=list)  # GPU names nvidia-smi lists
    driver: str | None = None  # the kernel driver's version, e.g. "470.182.03"
    smi_error: str | None = None  # what nvidia-smi said when it failed
    torch_version: str | None = None  # None: torch is not installed
    torch_cuda: str | None = None  # the CUDA version torch was built for; None for a CPU build
    available: bool = False  # torch.cuda.is_available()
    device_name: str | None = None  # CUDA device 0, when available
    init_error: str | None = None  # why CUDA would not start, in torch's words

    @property
    def has_gpu(self) -> bool:
        """The machine clearly has an NVIDIA GPU: device nodes, or a GPU that nvidia-smi lists."""
        return bool(self.device_nodes or self.gpus)


@dataclass
class Diagnosis:
    usable: bool
    detail: str  # device and versions when usable, the reason when not
    gpu_unusable: bool = False  # a GPU is here but CUDA cannot use it: `auto` must not fall back quietly
    fix: str = ""  # what to do about it


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def diagnose(f: CudaFacts) -> Diagnosis:
    if f.torch_version is None:
        return Diagnosis(False, "torch is not installed")
    if f.available:
        return Diagnosis(True, f"torch {f.torch_version} (CUDA {f.torch_cuda}), {f.device_name}")
    where = ", ".join(f.gpus) if f.gpus else ", ".join(f.device_nodes)
    gpu = f"this machine has an NVIDIA GPU ({where}{f', driver {f.driver}' if f.driver else ''})"
    if f.torch_cuda is None:
        if not f.has_gpu:
            return Diagnosis(False, "this torch has no CUDA support")
        return Diagnosis(False, f"{gpu} but torch {f.torch_version} is a CPU-only build", True,
                         "pip install torch built for CUDA (https://pytorch.org/get-started/locally/), or --engine torch-cpu")
    if not f.has_gpu:
        why = "no CUDA device is visible"
        if f.smi and f.smi_error:
            why += f" (nvidia-smi is installed but says: {f.smi_error})"
        return Diagnosis(False, why)
    needed = MIN_DRIVER.get(_version(f.torch_cuda)[0]) if _version(f.torch_cuda) else None
    if f.driver and needed and _version(f.driver) < _version(needed):
        return Diagnosis(False, f"{gpu} but its driver is older than torch {f.torch_version}'s CUDA {f.torch_cuda} "
                                f"needs (>= {needed})", True,
                         f"update the NVIDIA driver to {needed} or later, or install a torch built for an older CUDA; "
                         f"--engine torch-cpu runs on the CPU instead")
    reason = f.init_error or "torch.cuda.is_available() is False and gave no reason"
    return Diagnosis(False, f"{gpu} but CUDA cannot start: {reason}", True,
                     "nvidia-smi to check the driver and that this process may use the device (a container needs "
                     "the GPU passed through), or --engine torch-cpu")


def machine_facts(f: CudaFacts) -> CudaFacts:
    """This machine's side (device nodes, driver, nvidia-smi) added to torch's side in `f`.
    Never raises: a broken piece is a fact like any other."""
    f.device_nodes = sorted(p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p))
    f.smi = shutil.which("nvidia-smi")
    f.driver = _driver_from_proc()
    if f.smi:
        _ask_smi(f)
    return f


def _driver_from_proc() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as fh:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", fh.read())
            return m.group(1) if m else None
    except OSError:
        return None


def _ask_smi(f: CudaFacts) -> None:
    try:
        r = subprocess.run([f.smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        f.smi_error = str(e)
        return
    if r.returncode != 0:
        f.smi_error = (r.stdout + r.stderr).strip().splitlines()[0] if (r.stdout + r.stderr).strip() else f"exit {r.returncode}"
        return
    for line in r.stdout.strip().splitlines():
        name, _, driver = line.rpartition(",")
        if name.strip():
            f.gpus.append(name.strip())
            f.driver = f.driver or driver.strip()
