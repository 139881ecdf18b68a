"""Memory plans before any weight is loaded, handed to the framework-neutral planner
(runtime.models.memory): a tune's from the job's micro-batches (its batch order), the weights'
size from the safetensors headers, the engine's dtype and the memory this machine (or
--max-mem-gb) gives; a row job's from its slots, its longest row and the same weights and dtype."""

from __future__ import annotations

import dataclasses
import math

from runtime.base import ranks
from runtime.engines.hardware import load_framework, memory_for
from runtime.base.errors import SpillpackError, UsageError
from runtime.engines.registry import group_opener
from runtime.models.generation_memory import GENERATION_RUNTIME_GB, GenerationPlan, generation_plan
from runtime.models.memory import CUDA_CONTEXT_GB, STEP_RUNTIME_GB, Batch, NoFit, Plan, fit
from runtime.models.mapped import forced
from runtime.models.weights import stream_bytes, tensor_shapes, weight_files


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


def resident(engine, model_dir) -> tuple[int, dict]:
    """(bytes the weights hold in their quantized blocks, the rest dense; quantized type -> how
    many tensors): a quantized GGUF's, or a directory's quantized at load (--quantize)."""
    if getattr(engine, "quantize", None) is not None and not model_dir.is_gguf:
        from runtime.models.quantize import resident_bytes

        held, count = resident_bytes(tensor_shapes(weight_files(model_dir.path)), engine.quantize, dtype_bytes(engine))
        return held, {engine.quantize: count}
    from runtime.models.gguf.model import quantized_types, resident_bytes

    head = engine.dense_head(model_dir)
    return resident_bytes(model_dir.path, dtype_bytes(engine), head), quantized_types(model_dir.path, head)


def plan_tune(engine_name: str, engine, model_dir, spec, data, order, total: int, o: dict, shards: int = 1) -> Plan:
    """The plan one rank runs under, or NoFit (one line naming what would fit). `shards`: the
    ranks the base is split across (runtime/engines/torch/shard.py). A host's memory is shared
    by the ranks it runs: each plans for its part (--max-mem-gb is already one rank's). Where the
    engine can stream (stream_why, as plan_rows decides), a whole base is resident if a plan with
    it resident fits the memory the job may use, else streamed from the file, and the plan is the
    streamed one (its NoFit: too small even to stream)."""
    mode = o.get("grad_checkpoint") or "auto"
    available, source, held = memory_for(engine_name, o.get("max_mem_gb"))
    local = ranks.local_world_size()
    if local > 1 and engine_name != "torch-cuda" and source != "--max-mem-gb":
        available, source = available / local, f"{source} / {local} ranks"
    runtime_gb = CUDA_CONTEXT_GB if engine_name == "torch-cuda" else held + STEP_RUNTIME_GB
    params = sum(math.prod(shape) for shape in tensor_shapes(weight_files(model_dir.path)).values())
    if shards == 1 and getattr(engine, "keeps_quantized", lambda _: False)(model_dir):  # the frozen base in its blocks
        params = -(-resident(engine, model_dir)[0] // dtype_bytes(engine))  # as dense parameters' bytes
    plan_at = lambda **kw: fit(model_dir.config, spec.targets, spec.rank, dtype_bytes(engine),
                               lambda m: job_batches(data, order, total, m), o["batch"], o["grad_accum"], mode, available,
                               source, runtime_gb, params, o["max_seq"], spec.dropout > 0, shards, **kw)
    decide = getattr(engine, "stream_why", None) if shards == 1 else None
    if decide is None:
        return plan_at()
    plan = refusal = None
    try:
        plan = plan_at()
    except NoFit as e:  # resident, even its least candidate is over the memory the job may use
        refusal = e
    streamed, why = decide(model_dir, (plan or refusal.last).estimate.peak_gb, available, source)
    if refusal is not None and not streamed:
        raise refusal
    if streamed:
        plan = plan_at(streamed=stream_bytes(weight_files(model_dir.path), dtype_bytes(engine)))
    plan.weights_why = why
    return plan


def plan_shards(engine_name: str, engine, model_dir, spec, data, order, total: int, o: dict) -> Plan:
    """plan_tune's plan with --shard-base decided: its `shards` (the ranks the base is split
    across, or 1) and `shard_why`. auto splits the base where the whole of it does not fit one
    rank's memory and the ranks can share it."""
    mode, world = o.get("shard_base") or "off", ranks.world_size()
    plan_at = lambda shards: plan_tune(engine_name, engine, model_dir, spec, data, order, total, o, shards)
    # A rank that retries a step at a smaller loss scale would gather its layers alone.
    scaled = getattr(getattr(engine, "precision", None), "loss_scaling", False)
    if mode == "on":
        if scaled:
            raise SpillpackError(f"--shard-base on does not run a {engine.precision.name} base with loss scaling",
                                 "the same command with --dtype bfloat16 or float32, or --shard-base off")
        if group_opener(engine_name) is None:
            raise SpillpackError(f"--shard-base on splits the base across the ranks of a process group, and the {engine_name} "
                                 f"engine has none", "the same command with --engine torch-cpu (or torch-cuda) and --nproc 2, "
                                                     "or --shard-base off")
        if world == 1:
            raise UsageError("--shard-base on splits the base across the ranks of a tune, and this one runs as one process",
                             "the same command with --nproc 2 (or under torchrun), or --shard-base off")
        shards, why = world, f"--shard-base on: the base split across {world} ranks"
        plan = plan_at(shards)
    elif mode == "auto" and world > 1 and group_opener(engine_name) is not None and not scaled:
        try:
            shards, why = 1, "--shard-base auto: the whole base fits one rank's memory"
            plan = plan_at(shards)
        except NoFit as e:
            shards, why = world, f"--shard-base auto: the whole base does not fit one rank ({e.what}), so it is split across {world} ranks"
            plan = plan_at(shards)
    else:
        shards, why = 1, ("--shard-base off" if mode == "off" else "--shard-base auto: one process") + ", the whole base on each rank"
        plan = plan_at(shards)
    plan.shards, plan.shard_why = shards, why
    if shards == 1 and plan.weights == "resident":  # a split base is dense (shard.py), a streamed one the map's blocks;
        # a whole resident one quantized by the rule run follows (plan_tune)
        plan.quantized, plan.quantized_why = getattr(engine, "quantized_why", lambda _: (False, None))(model_dir)
    return plan


def plan_rows(engine_name: str, engine, model_dir, todo, batch: int, adapter=None) -> GenerationPlan:
    """The peak of generating `todo` (rows with prompt_ids and max_tokens) `batch` at a time, with
    the engine open: what the process holds now (the framework imported) is measured, not guessed.
    Where the engine can stream (stream_why), the weights are resident if that plan fits the
    memory the job may use, else streamed from the file, and the plan is the streamed one.
    `adapter`: what the engine loads (adapters.for_engine), counted as the engines hold it, float32."""
    adapters_gb = sum(4 * t.size for tensors, _ in ([] if adapter is None else adapter if isinstance(adapter, list) else [adapter])
                      for t in tensors.values()) / 2**30
    available, source, held = memory_for(engine_name, getattr(engine, "max_mem_gb", None))
    runtime_gb = 0.0 if engine_name == "torch-cuda" else held + GENERATION_RUNTIME_GB  # CUDA: the allocator's count only
    files = weight_files(model_dir.path)
    params = sum(math.prod(shape) for shape in tensor_shapes(files).values())
    slots, max_len, longest = _shape(todo, batch)
    weights_bytes = quantized = None
    if getattr(engine, "keeps_quantized", lambda _: False)(model_dir):  # a GGUF's quantized weights stay in their blocks
        weights_bytes, quantized = resident(engine, model_dir)
    plan = dataclasses.replace(generation_plan(model_dir.config, dtype_bytes(engine), slots, max_len, longest, runtime_gb, params,
                                               weights_bytes, quantized), adapters_gb=adapters_gb)
    decide = getattr(engine, "stream_why", None)
    if decide is None:
        return plan
    streamed, why = decide(model_dir, plan.peak_gb, available, source)
    if streamed:
        plan = generation_plan(model_dir.config, dtype_bytes(engine), slots, max_len, longest, runtime_gb,
                               streamed=stream_bytes(files, dtype_bytes(engine)))
    return dataclasses.replace(plan, weights_why=why, adapters_gb=adapters_gb)


def _shape(todo, batch: int) -> tuple[int, int, int]:
    """(slots, max_len, longest prompt) of generating `todo` `batch` at a time."""
    return (min(batch, len(todo)), max(len(r.prompt_ids) + r.max_tokens for r in todo),
            max(len(r.prompt_ids) for r in todo))


# What importing torch may add to a process at most (220 MB measured for torch 2.13 on a CPU):
# a floor within this much of the limit imports it first and counts what it really holds.
FRAMEWORK_BOUND_GB = 1.0


def check_streaming_floor(command: str, engine_name: str, model_dir, rows, batch: int, cap_gb: float | None = None) -> None:
    """Before the job's state is opened: a row job on torch-cpu whose memory cannot hold even a
    streamed load (the framework, the tokenizer and rows, the KV cache, the activations, and one
    layer with its scratch) is the one line naming the minimum, and nothing is written. Counted
    at 2 bytes a value, the least any dtype takes, so it never refuses a job that would fit."""
    forced()  # a bad SPILLPACK_WEIGHTS is refused before anything is written
    todo = [r for r in rows if not r.error]
    if engine_name != "torch-cpu" or not todo:
        return
    files = weight_files(model_dir.path)
    streamed = stream_bytes(files, 2)

    def floor(held: float, slots_at: int) -> GenerationPlan:
        slots, max_len, longest = _shape(todo, slots_at)
        return generation_plan(model_dir.config, 2, slots, max_len, longest, held + GENERATION_RUNTIME_GB,
                               streamed=streamed)

    available, source, held = memory_for(engine_name, cap_gb)
    if floor(held + FRAMEWORK_BOUND_GB, batch).peak_gb <= available:
        return
    load_framework(engine_name)
    available, source, held = memory_for(engine_name, cap_gb)
    plan = floor(held, batch)
    if plan.peak_gb <= available:
        return
    smaller = next((b for b in range(min(batch, len(todo)) - 1, 0, -1) if floor(held, b).peak_gb <= available), None)
    need = math.ceil(plan.peak_gb * 100) / 100
    raise SpillpackError(
        f"{command} needs at least {need:.2f} GB even with its weights streamed from the file (the process with torch "
        f"and the tokenizer {plan.runtime_gb:.2f} GB, KV cache {plan.kv_cache_gb:.2f} GB, activations "
        f"{plan.activations_gb:.2f} GB, one layer and its scratch {plan.layer_gb:.2f} GB); "
        f"{'--max-mem-gb' if cap_gb is not None else 'the ' + source} allows {available:.2f} GB",
        f"the same command with --batch {smaller}" if smaller else
        f"the same command with --max-mem-gb {need:.2f}" if cap_gb is not None else f"a memory limit of at least {need:.2f} GB for this job")
