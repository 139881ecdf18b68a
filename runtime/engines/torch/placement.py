"""How the torch engine's weights lie in memory: resident, in quantized blocks (and the head dense),
or streamed from the file's map. Decided once per model (TorchEngine caches it, WeightPlacement), so
the memory plan and the load agree.

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
    from runtime.engines.torch.models.quant_linear import ENV, dense_head, fast_kernel, forced_kernel, keeps_quantized, not_on_blocks
    from runtime.models.gguf.model import find_gguf, float_types, quantized_types, resident_bytes
    from runtime.models.gguf.tensors import QUANTIZED
    from runtime.models.memory import base_params
    from runtime.models.quantize import TYPES, refuse_gguf

    path = find_gguf(model_dir.path) if engine.device.type == "cpu" else None
    if engine.quantize is not None:  # --quantize (runtime.models.quantize)
        if path is not None:
            refuse_gguf(next(k for k, v in TYPES.items() if v == engine.quantize), str(model_dir.path))
        return True, (f"quantized at load to {engine.quantize} blocks (--quantize); the head kept dense, as it "
                      f"multiplies every row of the vocabulary at every step"), True
    if path is None:
        return False, None, False
    if not quantized_types(path):  # a float file: nothing to keep in blocks (said where a kernel was forced)
        forced = forced_kernel()
        if forced in (None, "dense"):
            return False, None, False
        return False, (f"dense: its weights are {', '.join(sorted(float_types(path)))}, float types with no blocks to "
                       f"keep ({ENV}={forced} applies to {', '.join(QUANTIZED)})"), False
    size = torch.empty((), dtype=engine.base_dtype).element_size()
    memory = memory_for(engine.name, engine.max_mem_gb)[0] * 2**30
    head, head_why = dense_head(resident_bytes(path, size, dense_head=True), memory)
    c = model_dir.config
    fast = None
    if not engine.training:  # a tune's frozen base multiplies on the scratch (quant_grad.py): slower than dense
        rows = c.get("intermediate_size") or c.get("moe_intermediate_size") or c["hidden_size"]
        fast = fast_kernel(quantized_types(path, head), rows, c["hidden_size"], engine.base_dtype)
    keeps, why = keeps_quantized(base_params(c) * size, memory, fast)
    if keeps:  # the types without a kernel of their own (a forced int4pack's others, float weights) say how they run
        why += not_on_blocks(quantized_types(path), float_types(path), engine.base_dtype)
    return keeps, f"{why}; {head_why}" if keeps else why, keeps and head


class WeightPlacement:
    """TorchEngine's decisions on how a model's weights lie (`_quantized`, `_streamed`: its caches)."""

    def keeps_quantized(self, model_dir) -> bool:
        """Whether load_model keeps this model's weights quantized: a GGUF with quantized weights, on
        a CPU, where its dense copy would not fit half the memory the job may use, or as
        SPILLPACK_QUANT_GEMM says (quant_linear.keeps_quantized). Decided once per model (plan and load agree)."""
        return self.quantized_why(model_dir)[0]

    def quantized_why(self, model_dir) -> tuple[bool, str | None]:
        return self._quantized_load(model_dir)[:2]

    def dense_head(self, model_dir) -> bool:
        """Whether a quantized load dequantizes the head's weight (quant_linear.dense_head)."""
        return self._quantized_load(model_dir)[2]

    def _quantized_load(self, model_dir) -> tuple[bool, str | None, bool]:
        key = str(model_dir.path)
        if key not in self._quantized:
            self._quantized[key] = decide(self, model_dir)
        return self._quantized[key]

    def stream_why(self, model_dir, resident_peak_gb: float | None = None, available_gb: float = 0.0,
                   source: str = "") -> tuple[bool, str]:
        """(streamed from the file's map, why): resident where the plan with the weights resident fits
        the memory the job may use, as runtime.models.mapped.choice says; decided once per model by
        the job's plan (sizing.plan_rows, sizing.plan_tune), so plan and load agree (unplanned:
        SPILLPACK_WEIGHTS). A tune with --quantize stays resident: its base's blocks are made at load,
        and the file's map holds only the float weights, which would train another adapter."""
        from runtime.models.mapped import choice

        key = str(model_dir.path)
        if key not in self._streamed and self.training and self.quantize is not None:
            self._streamed[key] = (False, "resident: --quantize makes the base's blocks at load, and the file holds "
                                          "its float weights")
        if key not in self._streamed:
            if resident_peak_gb is None:
                resident_peak_gb, available_gb, source = 0.0, float("inf"), "no plan"
            self._streamed[key] = choice(resident_peak_gb, available_gb, source, self.device.type == "cpu", self.name)
        return self._streamed[key]
