"""The frozen base's dtype per device, and the loss scaling float16 needs.

LoRA weights, their gradients, AdamW moments and checkpoints are float32 on every device; only
the frozen base (and so the activations) takes the device's dtype:

- a CPU that multiplies bfloat16 natively (AMX, AVX512-BF16), for a model at least
  BF16_MIN_WIDTH wide: bfloat16. Measured with torch 2.13 on 2 threads of an Intel Xeon with
  AMX, a d x 4d linear at 512 rows (a tune's micro-batch): bfloat16 2.3-2.5x float32 at d = 64
  to 896; at 8-32 rows (decoding) 0.07-0.7x at d = 64-128, 1.1-4.4x at d = 576-896; a whole
  tune step on tiny (d = 64) 0.55x, on the Qwen2.5-0.5B shape (d = 896) 2.0x: below a few
  hundred features the conversions and oneDNN's packing cost more than the multiply saves;
  For training on AVX512-BF16 without AMX the bfloat16 multiply is measured first (about a
  third of a second, once per process): an Intel Xeon with AVX512-BF16 and no AMX ran it at
  0.55-0.70x float32 (124-142 against 197-232 GFLOP/s at a step's shapes; the 0.5B tune 57
  against 85 tokens/s), so there a tune keeps float32 while generation, which reads every
  weight once a step and gains from half the bytes, still takes bfloat16 (SmolLM2-135M, 32
  rows: 94-101 against 75 tokens/s);
- for generation (run, eval, distill) on such a CPU, a model at least BF16_MIN_WIDTH wide takes
  whichever dtype its own decode step measures faster there (runtime/engines/torch/decode_dtype.py):
  on a 2-core AMD EPYC with AVX512-BF16, SmolLM2-135M generated 1.2-1.45x faster in float32;
- other CPUs, and narrower models: float32 (bfloat16 there is emulated, or does not pay);
- CUDA with native bfloat16 (compute capability 8.0 and up: A100, L4, H100, ...): bfloat16,
  which has float32's range, so gradients need no scaling;
- CUDA with float16 tensor cores but no native bfloat16 (7.x: V100, T4): float16 with dynamic
  loss scaling. `torch.cuda.is_bf16_supported()` says yes there too, by counting emulation,
  which runs bfloat16 several times slower than float16. Without scaling, float16's range
  loses small activation gradients (the loss is divided by the step's target count): measured
  4.2% LoRA-gradient error at 65,536 targets against 0.99% for bfloat16;
- older CUDA devices: float32.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Precision:
    base: torch.dtype
    loss_scaling: bool
    why: str

    @property
    def name(self) -> str:
        return str(self.base).removeprefix("torch.")


BF16_MIN_WIDTH = 512  # the model's hidden size from which a native-bfloat16 CPU gets a bfloat16 base
# A tune on a CPU without AMX takes bfloat16 where its bfloat16 matmul is at least this much
# faster than float32's: below it the conversions around each multiply eat the gain.
TRAIN_BF16_MIN_SPEEDUP = 1.2


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(seconds: float = 0.15) -> float:
    """This CPU's bfloat16 matmul rate over its float32 one, at a LoRA step's shape (512 tokens
    of a 896-wide model into a 2048-wide projection), on torch's threads; measured once."""
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(512, 896).to(dtype), torch.randn(896, 2048).to(dtype)
        torch.mm(a, b)  # warm-up: oneDNN makes its kernel
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
            torch.mm(a, b)
            n += 1
        rates.append(n / elapsed)
    return rates[1] / rates[0]

# oneDNN (which runs torch's bfloat16 matmuls on a CPU) capped by ONEDNN_MAX_CPU_ISA below
# these emulates bfloat16 with float32 arithmetic.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
                     "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


def cpu_bf16_native(environ=os.environ) -> str | None:
    """The instructions this CPU multiplies bfloat16 with, as torch will use them ("AMX",
    "AVX512-BF16"), or None where bfloat16 is emulated: no such instructions, or torch's kernels
    capped below them (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)."""
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap not in _ONEDNN_BF16_ISAS:
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX") and environ.get("ATEN_CPU_CAPABILITY"):
        return None
    cpu = getattr(torch, "cpu", None)
    if cpu is None:
        return None
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)() and not cap.startswith("AVX512_CORE_BF16"):
        return "AMX"
    return "AVX512-BF16" if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() else None


def precision_for(device_type: str, capability: tuple[int, int] | None = None, width: int | None = None,
                  bf16_native: str | None = None, train_speedup: float | None = None) -> Precision:
    """The policy above; `capability` is the CUDA device's (major, minor); `width` the model's
    hidden size (None: not known, float32 on a CPU); `bf16_native` what cpu_bf16_native() says;
    `train_speedup` for a tune on a CPU without AMX, what cpu_bf16_speedup() measured."""
    if device_type != "cuda":
        if not bf16_native:
            return Precision(torch.float32, False, "float32: this CPU has no native bfloat16 matmul")
        if width is None or width < BF16_MIN_WIDTH:
            return Precision(torch.float32, False, f"float32: the model is {width} wide, below the {BF16_MIN_WIDTH} "
                                                   f"where this CPU's bfloat16 ({bf16_native}) is faster")
        if train_speedup is not None and train_speedup < TRAIN_BF16_MIN_SPEEDUP:
            return Precision(torch.float32, False, f"float32: this CPU's bfloat16 matmul ({bf16_native}) measured "
                                                   f"{train_speedup:.2f}x float32's, too slow to train on")
        return Precision(torch.bfloat16, False, f"bfloat16: this CPU multiplies it natively ({bf16_native}) and the model "
                                                f"is {width} wide (bfloat16 pays from {BF16_MIN_WIDTH})")
    major, minor = capability or (0, 0)
    if (major, minor) >= (8, 0):
        return Precision(torch.bfloat16, False, f"native bfloat16 (compute capability {major}.{minor})")
    if (major, minor) >= (7, 0):
        return Precision(torch.float16, True, f"float16 with dynamic loss scaling: no native bfloat16 on compute capability {major}.{minor}")
    return Precision(torch.float32, False, f"float32: no float16 tensor cores on compute capability {major}.{minor}")


def precision_of(dtype: torch.dtype, why: str | None = None) -> Precision:
    """The policy for a base dtype chosen by the caller (--dtype, SPILLPACK_DTYPE, a resume's
    earlier starts, tests, benchmarks)."""
    return Precision(dtype, dtype == torch.float16, why or f"{str(dtype).removeprefix('torch.')} asked for")


def device_precision(device: torch.device, width: int | None = None, training: bool = False) -> Precision:
    """`width`: the model's hidden size (a CPU's choice depends on it); `training`: for a tune
    (a CPU without AMX measures its bfloat16 first). A row job's generation may then measure
    its own decode step (runtime/engines/torch/decode_dtype.generation_precision)."""
    if device.type != "cuda":
        native = cpu_bf16_native()
        measure = training and native == "AVX512-BF16" and width is not None and width >= BF16_MIN_WIDTH
        return precision_for(device.type, width=width, bf16_native=native, train_speedup=cpu_bf16_speedup() if measure else None)
    return precision_for("cuda", torch.cuda.get_device_capability(device))


class LossScaler:
    """Dynamic loss scaling as torch.amp.GradScaler does it (start at 2^16, halve on an
    overflow, double after 2000 clean steps), with one difference that keeps a step a step: an
    overflowing step is recomputed at half the scale instead of skipped, so every step applies
    one update and the losses and batch order stay those of an unscaled run.

    The scale changes only when a step is applied (never in an abandoned quantum), and it is
    part of the checkpoint, so a resumed run scales exactly as an uninterrupted one.
    """

    INIT, GROWTH_INTERVAL, MIN = 2.0**16, 2000, 1.0

    def __init__(self):
        self.scale, self.clean_steps = self.INIT, 0
        self.pending: float | None = None  # the scale the step in flight ended up using

    def step_done(self) -> None:
        if self.pending is not None and self.pending != self.scale:  # this step overflowed
            self.scale, self.clean_steps = self.pending, 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.GROWTH_INTERVAL:
                self.scale, self.clean_steps = self.scale * 2, 0
        self.pending = None

    def discard(self) -> None:
        self.pending = None

    def export(self) -> dict[str, np.ndarray]:
        return {"precision.loss_scale": np.array([self.scale], dtype=np.float32),
                "precision.clean_steps": np.array([self.clean_steps], dtype=np.float32)}

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        """A checkpoint from an engine that did not scale starts at the initial scale."""
        if "precision.loss_scale" in tensors:
            self.scale = float(tensors["precision.loss_scale"][0])
            self.clean_steps = int(tensors["precision.clean_steps"][0])
        self.pending = None


def grads_finite(params) -> bool:
    """One host sync per step: every gradient finite."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True
