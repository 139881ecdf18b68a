"""Memory plans before any weight is loaded, handed to the framework-neutral planner
(runtime.models.memory): a tune's from the job's micro-batches (its batch order), the weights'
size from the safetensors headers, the engine's dtype and the memory this machine (or
--max-mem-gb) gives; a row job's from its slots, its longest row and the same weights and dtype."""

from __future__ import annotations

import math

from runtime.engines.hardware import memory_for
from runtime.models.memory import CUDA_CONTEXT_GB, GENERATION_RUNTIME_GB, STEP_RUNTIME_GB, Batch, GenerationPlan, Plan, fit, \
    generation_plan
from runtime.models.weights import tensor_shapes, weight_files


# The steps whose micro-batches are looked at one by one: at least one epoch (the work grows with
# the data, which is read anyway), never with --steps or --epochs, which may be any upper limit.
EXACT_STEPS = 1024


def job_batches(data, order, total: int, size: int) -> list[Batch]:
    """The micro-batches the job runs when each step's examples go `size` at a time, as the
    shapes that can set a peak: those no other one exceeds in tokens, targets and length.
    A job longer than the steps looked at also gets the shape no micro-batch can exceed (its
    `size` longest examples with the most targets), so the plan holds for every step."""
    targets = [sum(e.mask[1:]) for e in data.examples]
    most: dict[tuple[int, int], int] = {}
    looked = min(total, max(order.per_epoch, EXACT_STEPS))
    for step in range(looked):
        for mb in order.micro_batches(step, size):
            key = (len(mb), max(len(data.examples[i].ids) for i in mb))
            most[key] = max(most.get(key, 0), sum(targets[i] for i in mb))
    if looked < total:
        rows = min(size, order.effective, len(data.examples))
        key = (rows, max(len(e.ids) for e in data.examples))
        most[key] = max(most.get(key, 0), sum(sorted(targets, reverse=True)[:rows]))
    shapes = [Batch(r, s, t) for (r, s), t in most.items()]
    return [b for b in shapes if not any(o != b and o.tokens >= b.tokens and o.targets >= b.targets and o.seq >= b.seq
                                         for o in shapes)]


def dtype_bytes(engine) -> int:
    dtype = engine.base_dtype
    return int(getattr(dtype, "itemsize", None) or dtype.size)


def plan_tune(engine_name: str, engine, model_dir, spec, data, order, total: int, o: dict) -> Plan:
    """The plan the job runs under, or NoFit (one line naming what would fit)."""
    mode = o.get("grad_checkpoint") or "auto"
    available, source, held = memory_for(engine_name, o.get("max_mem_gb"))
    runtime_gb = CUDA_CONTEXT_GB if engine_name == "torch-cuda" else held + STEP_RUNTIME_GB
    params = sum(math.prod(shape) for shape in tensor_shapes(weight_files(model_dir.path)).values())
    return fit(model_dir.config, spec.targets, spec.rank, dtype_bytes(engine), lambda m: job_batches(data, order, total, m),
               o["batch"], o["grad_accum"], mode, available, source, runtime_gb, params, o["max_seq"], spec.dropout > 0)


def plan_rows(engine_name: str, engine, model_dir, todo, batch: int) -> GenerationPlan:
    """The peak of generating `todo` (rows with prompt_ids and max_tokens) `batch` at a time, with
    the engine open: what the process holds now (the framework imported) is measured, not guessed."""
    _, _, held = memory_for(engine_name)
    runtime_gb = 0.0 if engine_name == "torch-cuda" else held + GENERATION_RUNTIME_GB  # CUDA: the allocator's count only
    params = sum(math.prod(shape) for shape in tensor_shapes(weight_files(model_dir.path)).values())
    slots = min(batch, len(todo))
    max_len = max(len(r.prompt_ids) + r.max_tokens for r in todo)
    longest = max(len(r.prompt_ids) for r in todo)
    weights_bytes = quantized = None
    if getattr(engine, "keeps_quantized", lambda _: False)(model_dir):  # a GGUF's quantized weights stay in their blocks
        from runtime.models.gguf.model import quantized_types, resident_bytes

        weights_bytes, quantized = resident_bytes(model_dir.path, dtype_bytes(engine)), quantized_types(model_dir.path)
    return generation_plan(model_dir.config, dtype_bytes(engine), slots, max_len, longest, runtime_gb, params,
                           weights_bytes, quantized)
