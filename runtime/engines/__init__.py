"""Engines: the one interface through which jobs train and generate.

`get_engine(name)` returns an object with:
    name, device
    train_session(model_dir, spec, init_tensors, opt) -> a session with
        step(micro_batches: list[(ids, labels)], lr) -> (loss_sum, target_tokens, tokens)
        export() -> dict[str, np.ndarray]   engine-neutral float32 (adapter + optimizer)
        load(tensors, step)                 the reverse
        adapter() -> dict[str, np.ndarray]  canonical LoRA tensors
        merged_weights() -> dict[str, np.ndarray]  base + B@A*scale, HF names
    generator(model_dir, adapter, slots, max_len) -> runtime.generate-style Generator
    peak_mem_gb() -> float
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimSpec:
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8


def get_engine(name: str):
    if name in ("torch-cpu", "torch-cuda"):
        from .torch_engine import TorchEngine

        return TorchEngine(name)
    if name == "mlx":
        from .mlx_engine import MLXEngine

        return MLXEngine()
    raise ValueError(name)
