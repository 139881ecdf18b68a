"""Engines by name, for the layers above: the engine object, and the opener of a data-parallel
process group where the engine has one. The job core asks here and never names a framework;
each framework is imported only when its engine is asked for.
"""

from __future__ import annotations

from typing import Callable


def get_engine(name: str, dtype: str | None = None, **kw):
    """`dtype`: --dtype, the frozen base's ("auto" or None: the device's policy). kw: the torch
    engine's device and base_dtype (tests and benchmarks run CUDA's arithmetic on a CPU)."""
    asked = dtype if dtype not in (None, "auto") else None
    if name in ("torch-cpu", "torch-cuda"):
        from runtime.engines.torch.engine import TorchEngine

        if asked is not None:
            kw["base_dtype"] = asked  # by name: torch is the engine's to import
        return TorchEngine(name, **kw)
    if name == "mlx":
        from runtime.engines.mlx.engine import MLXEngine

        return MLXEngine(asked)
    raise ValueError(name)


def group_opener(name: str) -> Callable[[], object] | None:
    """What opens a data-parallel process group on engine `name` (its ranks started by torchrun),
    or None when the engine runs one process only."""
    if name in ("torch-cpu", "torch-cuda"):
        def open_torch_group():
            from runtime.engines.torch.distributed import ProcessGroup

            return ProcessGroup(name)
        return open_torch_group
    return None
