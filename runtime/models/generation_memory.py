"""The memory planner of a row job (run, eval, distill): the peak of generating, predicted before
the model is loaded, from its config.json, the rows and the batch (runtime/jobs/sizing.py makes
it with what the open engine holds; the tune's planner is runtime/models/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.models.memory import GB, STREAM_SCRATCH_BYTES, base_params, mlp_width, model_args

# A row job's peak is what it holds before the model (the interpreter, the framework once imported, the tokenizer and
# the rows: measured, not guessed, because the engine is open when the plan is made), the base weights in the compute
# dtype, the KV cache the decoder preallocates for every slot at the longest row (and the prefix cache's one prompt,
# prefill.py), and the largest forward on top of them. On a CPU the widest forward is a prefill (every slot at once,
# right-padded, in chunks of at most PREFILL_CHUNK_TOKENS tokens); a decode step is one token a slot.

# The tokens of one prefill forward (rows x width; both engines' decoders): activations grow with them, so longer
# prefills run in chunks, each appending to the KV cache. 2,048 tokens keep the matmuls large enough that a forward's
# fixed cost is noise (vLLM's chunked prefill budgets forwards in the same thousands of tokens), while one forward's
# activations stay about 0.1 GB for a 0.5B model and a few tenths for a 7B.
PREFILL_CHUNK_TOKENS = 2048


# What a host process adds at its first forward beyond the tensors counted (thread pools, the
# kernels' code pages and workspaces), measured on torch-cpu float32 (tests/test_memory_run.py).
GENERATION_RUNTIME_GB = 0.015


@dataclass(frozen=True)
class GenerationPlan:
    weights_gb: float
    kv_cache_gb: float  # every slot's, and the prefix cache's one prompt
    activations_gb: float  # the widest forward's transient tensors and its logits
    runtime_gb: float
    slots: int
    max_len: int  # tokens a slot holds: the longest prompt + its max_tokens
    prefill: tuple[int, int]  # (rows, width) of the widest prefill forward counted (one chunk)
    quantized: dict = field(default_factory=dict)  # quantized type -> weights resident in their blocks (a GGUF's)
    # Streamed (mapped.py): weights_gb stays resident (1-D tensors), streamed_gb is the map's (page
    # cache, not in the peak), layer_gb the largest layer's mapped bytes and the scratch (in the peak).
    streamed_gb: float = 0.0
    layer_gb: float = 0.0
    weights: str = "resident"  # or "streamed"
    weights_why: str = ""
    adapters_gb: float = 0.0  # the LoRA adapters' float32 tensors, resident whatever the weights do

    @property
    def peak_gb(self) -> float:
        return self.weights_gb + self.layer_gb + self.adapters_gb + self.kv_cache_gb + self.activations_gb + self.runtime_gb

    def describe(self) -> str:
        kept = ", ".join(f"{n} {kind}" for kind, n in sorted(self.quantized.items()))
        weights = f"weights {self.weights_gb:.2f} GB" + (f" ({kept} kept quantized)" if kept else "")
        if self.weights == "streamed":
            weights = (f"weights {self.weights_gb:.2f} GB resident and {self.streamed_gb:.2f} GB streamed from the file "
                       f"(one layer and its scratch {self.layer_gb:.2f} GB at a time)")
        weights += f", adapters {self.adapters_gb:.2f} GB" if self.adapters_gb else ""
        return (f"about {self.peak_gb:.2f} GB at the peak: {weights}, KV cache {self.kv_cache_gb:.2f} GB "
                f"({self.slots} slots and a prefix cache x {self.max_len} tokens), activations {self.activations_gb:.2f} GB, "
                f"runtime {self.runtime_gb:.2f} GB")

    def to_dict(self) -> dict:
        return {"estimated_peak_gb": round(self.peak_gb, 3), "weights_gb": round(self.weights_gb, 3),
                "kv_cache_gb": round(self.kv_cache_gb, 3), "activations_gb": round(self.activations_gb, 3),
                "runtime_gb": round(self.runtime_gb, 3), "slots": self.slots, "max_len": self.max_len,
                "prefill": list(self.prefill), "quantized": dict(self.quantized), "weights": self.weights,
                "resident_gb": round(self.weights_gb, 3), "streamed_gb": round(self.streamed_gb, 3),
                "layer_gb": round(self.layer_gb, 3), "weights_why": self.weights_why, "adapters_gb": round(self.adapters_gb, 6)}  # rank-r adapters of a small model: a few MB


def kv_cache_bytes(config: dict, slots: int, max_len: int, act_bytes: int) -> int:
    """Keys and values of every layer for `slots` rows of `max_len` tokens (the decoders' one cache)."""
    a = model_args(config)
    return 2 * a.num_hidden_layers * slots * a.num_key_value_heads * max_len * a.head_dim * act_bytes


def generation_plan(config: dict, act_bytes: int, slots: int, max_len: int, longest_prompt: int, runtime_gb: float,
                    params: int | None = None, weights_bytes: int | None = None,
                    quantized: dict | None = None, streamed: tuple[int, int, int] | None = None) -> GenerationPlan:
    """The predicted peak of generating with `slots` rows at once, each slot up to `max_len` tokens;
    `weights_bytes`: the weights as they will lie (a GGUF's quantized ones in their blocks,
    `quantized` counting them by type), else every parameter dense at `act_bytes`; `streamed`: a
    streamed load's bytes (mapped.stream_bytes)."""
    a = model_args(config)
    weights = weights_bytes if weights_bytes is not None else (params if params is not None else base_params(config)) * act_bytes
    weights, quantized = (weights, quantized) if streamed is None else (streamed[0], None)
    kv_slots = kv_cache_bytes(config, slots, max_len, act_bytes)
    kv = kv_slots + kv_cache_bytes(config, 1, max_len, act_bytes)  # and the prefix cache's one prompt
    d, hd = a.hidden_size, a.head_dim
    q, kv_width = a.num_attention_heads * hd, a.num_key_value_heads * hd
    # A forward has at least one token a row, so more slots than a chunk's tokens pass it.
    tokens = min(slots * longest_prompt, max(PREFILL_CHUNK_TOKENS, slots))
    # Alive at once in a layer, per token: the residual and its sum, the normed input, and the
    # larger of attention (q/k/v, the rotated q and k, the output and its reshaped copy) and the
    # MLP (the gate's activation, up and their product; the gate itself is freed once activated).
    attention = q + 2 * kv_width + (q + kv_width) + 2 * q
    mlp = 3 * mlp_width(a)
    per_token = (3 * d + max(attention, mlp)) * act_bytes
    # The layer's keys and values gathered for the rows of a view (one layer's worth of the cache).
    gathered = kv_slots // a.num_hidden_layers
    # A chunk after the first, or a prompt resuming from the prefix cache, attends through an
    # explicit mask over the keys: boolean, and the attention kernel's copy in the compute dtype
    # (measured on torch-cpu; on CUDA, where SDPA with a mask and grouped kv heads runs its math
    # kernel, the scores of a chunk would come on top: not counted, not measured yet).
    mask = tokens * max_len * (1 + act_bytes)
    # A sliding window shorter than the prefill goes through the mask too, its scores kept.
    windowed = any(a.window(i) is not None and a.window(i) < longest_prompt for i in range(a.num_hidden_layers))
    scores = tokens * a.num_attention_heads * longest_prompt * (act_bytes + 1) if windowed else 0
    # Logits: one row per slot, float32 for sampling (a copy when the base is not float32).
    logits = slots * a.vocab_size * (4 + (act_bytes if act_bytes != 4 else 0))
    activations = tokens * per_token + gathered + mask + scores + logits
    rows = max(min(slots, tokens), 1)
    extra = {} if streamed is None else {"streamed_gb": streamed[1] / GB, "weights": "streamed",
                                         "layer_gb": (streamed[2] + STREAM_SCRATCH_BYTES) / GB}
    return GenerationPlan(weights / GB, kv / GB, activations / GB, runtime_gb, slots, max_len, (rows, tokens // rows),
                          dict(quantized or {}), **extra)
