"""Which base dtype a CPU with native bfloat16 generates faster in, for one model's shapes:
measured on a decode step, once per machine, torch version, thread count and shape.

bfloat16 halves the bytes every decode step reads, but a step of a narrow model spends much of
its time outside the big products (norms, rotary, attention over the cache, the conversions
around oneDNN's bfloat16 kernels), where float32 runs on its own faster layout
(layout.cpu_inference_layout). On a 2-core AMD EPYC (Zen 4, AVX512-BF16) SmolLM2-135M (576 wide)
generated 1.2-1.45x faster in float32 over 32 rows, while the products alone were 1.1x faster
in bfloat16: so the products are not what is measured, the model's own decode step is.

The measurement builds the model's architecture from its config with one layer and with a few
(up to DEEP_LAYERS) on random weights (its real width, heads, MLP and vocabulary), lays each out
as the engine would for that dtype, prefills 16 rows of 128 tokens and takes the best of several
decode steps: the difference of the two, per layer added, is one layer's time, the rest the
embedding and head; a step of the real model is the rest plus its layer count times one layer.
A few seconds, once, kept in the rates
cache (runtime.engines.hardware.cached_measurement) so a job's choice does not move with a
noisy minute. bfloat16 is chosen where float32's step takes MARGIN times as long.

The four models are alive at once, their embedding and head at the real vocabulary: for a model
with a large vocabulary that is more than the job's own weights in bfloat16. Where they would
hold more than ROOM of the memory the job may use beyond what the process holds already (a
cgroup limit, --max-mem-gb, the machine), the step is not measured, so a job that fits its
memory is not killed by its first start's measurement: bfloat16 is kept, the dtype that holds
the weights in the least memory, and the start event says why. Nothing is cached then.
"""

from __future__ import annotations

import time

import torch

MARGIN = 1.1
ROWS, PROMPT, ROUNDS = 16, 128, 24
# The deeper of the two models has up to this many layers, and up to this many weights in its
# layers: the difference of the two steps is then several layers' time, not one layer's noise.
DEEP_LAYERS, DEEP_WEIGHTS = 6, 48_000_000
ROOM = 0.25
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "tie_word_embeddings")


def shape_of(config: dict) -> str:
    """What the measurement depends on: the architecture and its widths (not the layer count,
    which only scales one layer's time)."""
    return ", ".join(f"{k}={config.get(k)}" for k in SHAPE_KEYS if config.get(k) is not None)


def _decode_step(config: dict, layers: int, dtype: torch.dtype):
    """A decode step of the model with `layers` layers on random weights in `dtype`, laid out as
    the engine lays that dtype out, its 16 rows prefilled: a function that runs one step."""
    from runtime.engines.torch.models import model_file
    from runtime.engines.torch.models.layout import cpu_inference_layout, join_linears
    from runtime.models.arch import architecture

    arch = architecture(config)
    small = {**arch.effective_config(config), "num_hidden_layers": layers, "layer_types": None}
    torch.manual_seed(0)
    model = model_file(arch).Model(arch.args.from_dict(small)).to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    if dtype == torch.float32:
        cpu_inference_layout(model)
    join_linears(model)
    model.eval()
    decoder = model.make_decoder(ROWS, PROMPT + ROUNDS + 8)
    slots = list(range(ROWS))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        decoder.prefill(slots, [torch.randint(0, int(small["vocab_size"]), (PROMPT,), generator=g).tolist() for _ in slots])

    def step() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            decoder.decode(slots, [1] * ROWS)
            return time.perf_counter() - t0
    return step


def _depths(config: dict) -> tuple[int, int]:
    """(layers of the deep model, weights a layer has)."""
    from runtime.models.arch import architecture
    from runtime.models.memory import base_params

    flat = architecture(config).effective_config(config)
    per_layer = max(base_params({**flat, "num_hidden_layers": 2, "layer_types": None})
                    - base_params({**flat, "num_hidden_layers": 1, "layer_types": None}), 1)
    return max(2, min(DEEP_LAYERS, int(config.get("num_hidden_layers") or 2), DEEP_WEIGHTS // per_layer)), per_layer


def measure_bytes(config: dict) -> int:
    """What the measurement holds at once: the four models' weights (each with the embedding and
    the head) and their KV caches of ROWS rows, and as the last is made its float32 weights
    beside the bfloat16 copy (a model is built in float32, then converted)."""
    from runtime.models.arch import architecture
    from runtime.models.generation_memory import kv_cache_bytes
    from runtime.models.memory import base_params

    flat = architecture(config).effective_config(config)
    deep, _ = _depths(config)
    total = 0
    for size in (4, 2):
        for n in (1, deep):
            shape = {**flat, "num_hidden_layers": n, "layer_types": None}
            total += base_params(shape) * size + kv_cache_bytes(shape, ROWS, PROMPT + ROUNDS + 8, size)
    return total + base_params({**flat, "num_hidden_layers": deep, "layer_types": None}) * 4


class _NoRoom(Exception):
    pass


def measure(config: dict) -> dict:
    """Seconds per decode step of one layer and of the rest (embedding, final norm, head), in
    float32 and in bfloat16. The four models' steps are taken in turn, round after round, each
    its best: a minute of other load falls on all four alike."""
    deep, _ = _depths(config)
    steps = {(name, n): _decode_step(config, n, dtype)
             for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)) for n in (1, deep)}
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(ROUNDS):
        for key, step in steps.items():
            best[key] = min(best[key], step())
    out = {}
    for name in ("float32", "bfloat16"):
        layer = max((best[name, deep] - best[name, 1]) / (deep - 1), 1e-7)
        out[f"{name}_layer_s"], out[f"{name}_rest_s"] = round(layer, 7), round(max(best[name, 1] - layer, 1e-7), 7)
    return out


def measured(config: dict, max_mem_gb: float | None = None) -> dict | str:
    """The measurement for this model's shapes here, cached; or, where it would not fit ROOM of
    the memory the job may use (`max_mem_gb`: --max-mem-gb), why it was not made."""
    from runtime.engines.hardware import cached_measurement, memory_for

    def measure_now() -> dict:
        available, source, held = memory_for("torch-cpu", max_mem_gb)
        need = measure_bytes(config) / 2**30
        if need > ROOM * (available - held):
            raise _NoRoom(f"measuring its decode step would hold {need:.2f} GB, more than {ROOM:.0%} of the "
                          f"{max(available - held, 0):.2f} GB the {'--max-mem-gb' if max_mem_gb is not None else source} "
                          f"leaves this job")
        return measure(config)

    try:
        return cached_measurement("torch-cpu", f"decode dtype 1, {torch.get_num_threads()} threads, {shape_of(config)}",
                                  measure_now)
    except _NoRoom as e:
        return str(e)


def step_seconds(m: dict, dtype: str, layers: int) -> float:
    return m[f"{dtype}_rest_s"] + layers * m[f"{dtype}_layer_s"]


def choice(config: dict, max_mem_gb: float | None = None, kept: str | None = None) -> tuple[str, str]:
    """("float32" or "bfloat16", why), for generating with the model `config` describes. `kept`:
    how a quantized file's layers stay in their blocks in bfloat16 (quant_linear.fast_kernel),
    where float32 would hold a dense copy of them: then bfloat16 unless float32 is the faster by
    MARGIN, the other way round."""
    m = measured(config, max_mem_gb=max_mem_gb)
    if isinstance(m, str):
        return "bfloat16", f"bfloat16, not measured: {m}; bfloat16 holds the weights in the least memory"
    layers = int(config.get("num_hidden_layers") or 1)
    f32, bf16 = step_seconds(m, "float32", layers), step_seconds(m, "bfloat16", layers)
    measured_why = f"a decode step of this model's shapes measured {f32 * 1e3:.1f} ms in float32 and {bf16 * 1e3:.1f} ms in bfloat16 here"
    if kept is not None:
        chosen = "float32" if bf16 >= MARGIN * f32 else "bfloat16"
        return chosen, (f"{chosen}: its layers stay in their blocks in bfloat16 ({kept}), where float32 would hold "
                        f"them dequantized, several times the file; {measured_why} (float32 where bfloat16 takes {MARGIN}x as long)")
    chosen = "bfloat16" if f32 >= MARGIN * bf16 else "float32"
    return chosen, f"{chosen}: {measured_why} (bfloat16 where float32 takes {MARGIN}x as long)"


def generation_precision(policy, config: dict, max_mem_gb: float | None = None, layer_types: dict | None = None):
    """The policy's precision (runtime.engines.torch.precision) for generating with the model
    `config` describes: where the policy took bfloat16 on a native-bfloat16 CPU, the faster of
    the two on this model's decode step. `layer_types`: a quantized GGUF's types of its layers
    (the head aside), whose blocks bfloat16 may keep (choice's `kept`)."""
    from runtime.engines.torch.precision import Precision, cpu_bf16_native

    if policy.base != torch.bfloat16:
        return policy  # no native bfloat16, or a model too narrow: float32 without measuring
    chosen, why = choice(config, max_mem_gb, kept_in_bfloat16(config, layer_types))
    return Precision(getattr(torch, chosen), False, f"{why}; this CPU multiplies bfloat16 natively ({cpu_bf16_native()})")


def kept_in_bfloat16(config: dict, layer_types: dict | None) -> str | None:
    """How a quantized file's layers multiply in their blocks in bfloat16 at about the dense copy's
    speed (quant_linear.fast_kernel), unless SPILLPACK_QUANT_GEMM dequantizes them; else None."""
    if not layer_types:
        return None
    from runtime.engines.torch.models.quant_linear import fast_kernel, forced_kernel

    if forced_kernel() == "dense":
        return None
    rows = config.get("intermediate_size") or config.get("moe_intermediate_size") or config["hidden_size"]
    return fast_kernel(layer_types, rows, config["hidden_size"], torch.bfloat16)


def cached_choices() -> dict[str, str]:
    """doctor's lines: each shape measured here (at this thread count) and what it measured."""
    from runtime.engines.hardware import _cached_rates

    prefix = f"decode dtype 1, {torch.get_num_threads()} threads, "
    out = {}
    for key, m in _cached_rates().items():
        if prefix in key and isinstance(m, dict) and all(f"{d}_{p}_s" in m for d in ("float32", "bfloat16") for p in ("layer", "rest")):
            out[key.split(prefix, 1)[1].rstrip("]")] = ("per layer float32 {:.2f} ms, bfloat16 {:.2f} ms; embedding and head float32 {:.2f} ms, "
                                            "bfloat16 {:.2f} ms").format(m["float32_layer_s"] * 1e3, m["bfloat16_layer_s"] * 1e3,
                                                                         m["float32_rest_s"] * 1e3, m["bfloat16_rest_s"] * 1e3)
    return out
