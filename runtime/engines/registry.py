"""Engines by name, for the layers above: the engine object, and the opener of a data-parallel
process group where the engine has one. The job core asks here and never names a framework;
each framework is imported only when its engine is asked for.
"""

from __future__ import annotations

import os
from typing import Callable

DTYPES = ("float32", "bfloat16")  # what --dtype and SPILLPACK_DTYPE may name besides auto


def base_dtype(asked: str | None, kept: str | None = None, environ=os.environ) -> tuple[str | None, str | None]:
    """The frozen base's dtype by name and why, or (None, None) for the engine's own policy (the
    device's, and on a CPU the model's width). First --dtype (`asked`, unless auto), then
    SPILLPACK_DTYPE (a site's or a user's standing choice), then `kept`: the dtype this job's
    earlier starts on this engine ran (a resume stays bit-identical on the same machine, and a
    state begun before the policy changed keeps its float32)."""
    from runtime.base.errors import SpillpackError

    if asked not in (None, "auto"):
        return asked, f"{asked}: --dtype {asked}"
    env = environ.get("SPILLPACK_DTYPE", "").strip()
    if env and env != "auto":
        if env not in DTYPES:
            raise SpillpackError(f"SPILLPACK_DTYPE={env!r} is not one of auto, {', '.join(DTYPES)}",
                                 "SPILLPACK_DTYPE=float32, or unset it")
        return env, f"{env}: SPILLPACK_DTYPE={env}"
    if kept in DTYPES:
        return kept, f"{kept}: kept from this job's earlier starts (another dtype changes the results)"
    return None, None


def kept_base_dtype(history: list[dict], engine: str) -> str | None:
    """The base dtype the job's last process on `engine` recorded (`history`: the state's records,
    oldest first; each process's `engine` record carries its `dtype`), or None."""
    ran = [r["dtype"] for r in history if r.get("what") == "engine" and r.get("engine") == engine and r.get("dtype") in DTYPES]
    return ran[-1] if ran else None


def made_with(history: list[dict]) -> list[dict]:
    """Each engine and base dtype the job's processes ran ({"engine", "dtype"}, distinct, oldest
    first): what made the rows or steps a state holds."""
    seen: list[dict] = []
    for r in history:
        if r.get("what") == "engine":
            ran = {"engine": r.get("engine"), "dtype": r.get("dtype")}
            if ran not in seen:
                seen.append(ran)
    return seen


def dtype_fields(engine) -> dict:
    """What a job's `start` event says of its base dtype: the dtype and why (None: no engine opened)."""
    if engine is None:
        return {}
    d = engine.describe()
    return {"dtype": d.get("dtype"), "dtype_why": d.get("precision")}


def get_engine(name: str, dtype: str | None = None, width: int | None = None, kept: str | None = None,
               training: bool = False, shape: dict | None = None, quantize: str | None = None,
               max_mem_gb: float | None = None, layer_types: dict | None = None, **kw):
    """`dtype`: --dtype, the frozen base's ("auto" or None: base_dtype above); `width`: the
    model's hidden size; `kept`: the dtype this job ran on this engine before; `training`: the
    engine is a tune's (a CPU's policy may differ); `shape`: the config of the model a row job
    generates with; `quantize`: --quantize (runtime.models.quantize, torch-cpu only); `max_mem_gb`:
    --max-mem-gb, the memory the torch engine decides its weights' placement for; `layer_types`: a
    quantized GGUF's types of its layers (the torch engine's dtype may keep them). kw: the torch
    engine's device and base_dtype (tests and benchmarks run CUDA's arithmetic on a CPU)."""
    from runtime.models.quantize import block_type

    if (block := block_type(quantize, name)) is not None:
        kw["quantize"] = block
    asked, why = base_dtype(dtype, kept) if "base_dtype" not in kw else (None, None)
    if name in ("torch-cpu", "torch-cuda"):
        from runtime.engines.torch.engine import TorchEngine

        if asked is not None:
            kw["base_dtype"] = asked  # by name: torch is the engine's to import
        return TorchEngine(name, width=width, why=why, training=training, shape=shape, max_mem_gb=max_mem_gb,
                           layer_types=layer_types, **kw)
    if name == "mlx":
        from runtime.engines.mlx.engine import MLXEngine

        return MLXEngine(asked, why)
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


def sharded_session(engine, group, model_dir, spec, tensors: dict, opt, seed: int = 0):
    """A tune's train session with the frozen base split across `group`'s ranks (tune --shard-base),
    on an engine whose group_opener opened `group`."""
    from runtime.engines.torch.shard import ShardedTrainSession

    return ShardedTrainSession(engine, model_dir, spec, tensors, opt, seed, group)


def group_launcher(name: str) -> Callable[..., int] | None:
    """What starts this node's ranks of a multi-process group on engine `name` (torch's elastic
    agent, as torchrun runs it), or None when the engine runs one process only. An ImportError
    from it means the framework lacks torch.distributed."""
    if name in ("torch-cpu", "torch-cuda"):
        def run_torch_group(*args, **kw) -> int:
            from runtime.engines.torch.launcher import run_group

            return run_group(*args, **kw)
        return run_torch_group
    return None
