"""Whether the torch engine loads a model's weights in quantized blocks, and its head dense: decided
once per model (TorchEngine caches it), so the memory plan and the load agree.

A GGUF with quantized weights, on a CPU, is kept in its blocks where quant_linear.keeps_quantized
says so (its layers as fast as a dense copy, its dense copy over half the job's memory, or
SPILLPACK_QUANT_GEMM); a Hugging Face directory is quantized at load with --quantize. The head's
weight is dequantized where the weights still fit half the job's memory (quant_linear.dense_head).
"""

from __future__ import annotations

import torch


def decide(engine, model_dir) -> tuple[bool, str | None, bool]:
    """(kept quantized, why, the head dense) for `model_dir` on `engine` (a TorchEngine)."""
    from runtime.engines.hardware import memory_for
    from runtime.engines.torch.models.quant_linear import dense_head, fast_kernel, keeps_quantized
    from runtime.models.gguf.model import find_gguf, quantized_types, resident_bytes
    from runtime.models.memory import base_params
    from runtime.models.quantize import TYPES, refuse_gguf

    path = find_gguf(model_dir.path) if engine.device.type == "cpu" else None
    if engine.quantize is not None:  # --quantize (runtime.models.quantize)
        if path is not None:
            refuse_gguf(next(k for k, v in TYPES.items() if v == engine.quantize), str(model_dir.path))
        return True, (f"quantized at load to {engine.quantize} blocks (--quantize); the head kept dense, as it "
                      f"multiplies every row of the vocabulary at every step"), True
    if path is None or not quantized_types(path):
        return False, None, False
    size = torch.empty((), dtype=engine.base_dtype).element_size()
    memory = memory_for(engine.name)[0] * 2**30
    head, head_why = dense_head(resident_bytes(path, size, dense_head=True), memory)
    c = model_dir.config
    fast = None
    if not engine.training:  # a tune's frozen base multiplies on the scratch (quant_grad.py): slower than dense
        rows = c.get("intermediate_size") or c.get("moe_intermediate_size") or c["hidden_size"]
        fast = fast_kernel(quantized_types(path, head), rows, c["hidden_size"], engine.base_dtype)
    keeps, why = keeps_quantized(base_params(c) * size, memory, fast)
    return keeps, f"{why}; {head_why}" if keeps else why, keeps and head
