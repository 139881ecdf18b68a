"""The memory planner: the peak memory of a tune step, predicted before any weight is loaded.

Framework-neutral (no torch, no mlx): it counts what a step keeps alive from the model's
config.json, the LoRA spec, AdamW, the base dtype and the micro-batches the job will run
(the batch order is known in advance, so the longest one is known too). The counts follow
what the engines' autograd keeps for backward through a frozen base with LoRA adapters:

- weights: every base parameter in the base dtype (frozen: no gradients, no moments); streamed
  from the file's map (`streamed`), only its 1-D tensors, one layer's mapped bytes and the scratch;
- LoRA: adapter tensors, their gradients and AdamW's two moments, float32;
- activations, per token and decoder layer: the inputs of both norms, q/k/v and the
  attention output kept by the fused attention kernel, the MLP's gate, its activation and
  up projection, and whatever the adapted linears keep (their input, and x A^T; with LoRA
  dropout also the dropped float32 input and its 1-byte mask);
  with checkpointing only each layer's input is kept, plus one layer's activations while
  it is recomputed in backward;
- logits: only the positions with loss are projected, a chunk of them at a time (`loss_chunk`:
  torch takes each chunk's input gradient in forward, MLX recomputes its logits in backward),
  float32, alive together with the log-softmax and its gradient;
- runtime: what the process holds before the model (interpreter, framework, tokenizer, data)
  and what its first step adds, on a host engine; the CUDA context on a GPU.

`fit` then chooses, for --grad-checkpoint auto|on|off, the micro-batch size and whether to
checkpoint so the plan fits the memory available, or says what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.base.errors import SpillpackError
from runtime.models.arch import architecture

GB = 2**30
# Measured on torch-cpu float32 (tests/test_memory.py): what a step allocates beyond the counted activations
# (autograd's bookkeeping, kernel workspaces, the allocator's rounding), as a share of them.
SLACK = 0.05
STEP_RUNTIME_GB = 0.1  # what a host process adds at its first step (thread pools, kernels), measured on torch-cpu
CUDA_CONTEXT_GB = 0.5  # the CUDA context and cuBLAS workspaces, not in the allocator's count
MODES = ("auto", "on", "off")
# The loss projects the positions with loss onto the vocabulary a chunk of positions at a time, each chunk holding at
# most LOSS_CHUNK_BYTES: at a 152k vocabulary 2,048 targets' float32 logits alone are 1.2 GB. MLX keeps a chunk's
# logits, log-softmax and the gradients of both (16 bytes a logit, its logits recomputed in backward); torch computes
# the loss and its gradient in the logits' own buffer (4 bytes a logit on a float32 base, 8 on a 16-bit one: the
# head's output and the gradient handed back to it), so its chunks hold 2-4x the positions in the same bytes, and the
# head's GEMM runs at a better shape (Qwen2.5-0.5B's, 2 threads of an AMD EPYC, float32: 117 GFLOP/s forward at 110
# positions, 162 at 472; 162 and 199 backward).
LOSS_CHUNK_BYTES = 2**28  # 256 MiB
BYTES_PER_LOGIT = 16  # MLX's, and the plan's: an upper bound for torch's
# quant_blocks.py's float32 scratch chunk; a streamed load holds it, its rounded copy and nibbles at most.
SCRATCH_BYTES, STREAM_SCRATCH_BYTES = 4 << 20, 12 << 20


def loss_chunk(vocab_size: int, bytes_per_logit: int = BYTES_PER_LOGIT) -> int:
    """Target positions per chunk of the loss: as many as fit LOSS_CHUNK_BYTES at the engine's bytes a logit."""
    return max(1, LOSS_CHUNK_BYTES // (vocab_size * bytes_per_logit))


@dataclass(frozen=True)
class Batch:
    """A micro-batch as a step runs it: rows x padded length, and the positions with loss."""

    rows: int
    seq: int
    targets: int

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


@dataclass(frozen=True)
class Estimate:
    weights_gb: float
    lora_gb: float
    activations_gb: float  # what the forward keeps for backward
    backward_gb: float  # on top of it at the worst moment of backward: logits or a recomputed layer
    runtime_gb: float

    @property
    def peak_gb(self) -> float:
        return self.weights_gb + self.lora_gb + self.activations_gb + self.backward_gb + self.runtime_gb

    def parts(self) -> dict:
        return {"weights_gb": round(self.weights_gb, 3), "lora_gb": round(self.lora_gb, 3),
                "activations_gb": round(self.activations_gb, 3), "backward_gb": round(self.backward_gb, 3),
                "runtime_gb": round(self.runtime_gb, 3)}


@dataclass
class Plan:
    micro_batch: int  # rows per forward/backward; the job's --batch x --grad-accum is unchanged
    grad_checkpoint: bool
    estimate: Estimate
    longest: Batch  # the micro-batch that sets the peak
    available_gb: float
    available_from: str  # "--max-mem-gb", "free GPU memory", "available host memory"
    batch: int = 0  # the job's --batch and --grad-accum, for the description
    grad_accum: int = 1
    tried: list = field(default_factory=list)
    shards: int = 1  # ranks the base is split across (tune --shard-base)
    shard_why: str = ""  # why it is, or is not
    quantized: bool = False  # the frozen base kept in its quantized blocks (a GGUF's, QLoRA's shape)
    quantized_why: str | None = None  # why it is, or is not (None: not a quantized file)
    # Streamed (mapped.py): the map's bytes (page cache, not in the peak) and the largest layer's with
    # the scratch (in weights_gb, as the 1-D tensors resident are).
    weights: str = "resident"  # or "streamed"
    streamed_gb: float = 0.0
    layer_gb: float = 0.0
    weights_why: str = ""

    @property
    def base_why(self) -> str | None:
        """Why the base lies as it does: streamed, or kept quantized or dense (None: a float base, resident)."""
        return self.weights_why if self.weights == "streamed" else self.quantized_why

    @property
    def split(self) -> bool:
        return self.micro_batch != self.batch

    @property
    def accum(self) -> int:
        """Micro-batches a step runs: the effective batch over the micro-batch size."""
        return -(-self.batch * self.grad_accum // self.micro_batch)

    def describe(self) -> str:
        ckpt = "checkpointing on" if self.grad_checkpoint else "checkpointing off"
        split = (f"micro-batch {self.micro_batch} x {self.accum} (split from {self.batch} x {self.grad_accum})"
                 if self.split else f"micro-batch {self.micro_batch} x {self.accum}")
        if self.shards > 1:
            ckpt += f", the base split across {self.shards} ranks"
        base = f"; the base {self.quantized_why}" if self.quantized else ""
        if self.weights == "streamed":
            base = (f"; the base {self.estimate.weights_gb - self.layer_gb:.2f} GB resident and {self.streamed_gb:.2f} GB "
                    f"streamed from the file (one layer and its scratch {self.layer_gb:.2f} GB at a time)")
        return (f"{split}, {ckpt}: about {self.estimate.peak_gb:.1f} GB at the longest micro-batch "
                f"({self.longest.rows} x {self.longest.seq} tokens) of {self.available_gb:.1f} GB ({self.available_from}){base}")

    def to_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "grad_accum": self.accum, "grad_checkpoint": self.grad_checkpoint,
                "estimated_peak_gb": round(self.estimate.peak_gb, 3), "available_gb": round(self.available_gb, 3),
                "available_from": self.available_from, "longest": [self.longest.rows, self.longest.seq, self.longest.targets],
                "shards": self.shards, "base_quantized": self.quantized, "weights": self.weights,
                "resident_gb": round(self.estimate.weights_gb - self.layer_gb, 3), "streamed_gb": round(self.streamed_gb, 3),
                "layer_gb": round(self.layer_gb, 3), "weights_why": self.weights_why, **self.estimate.parts()}

    def candidates(self) -> list[dict]:
        return [{"micro_batch": p.micro_batch, "grad_checkpoint": p.grad_checkpoint, "estimated_peak_gb": round(p.estimate.peak_gb, 3)}
                for p in self.tried]


def model_args(config: dict):
    return architecture(config).args.from_dict(config)


def base_params(config: dict) -> int:
    """Parameters of the base model from its config (used when no weights are at hand)."""
    a = model_args(config)
    d, hd, L = a.hidden_size, a.head_dim, a.num_hidden_layers
    q, kv = a.num_attention_heads * hd, a.num_key_value_heads * hd
    attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if a.attention_bias else 0)
    experts = getattr(a, "num_experts", 0)
    if experts:
        mlp = experts * 3 * d * a.moe_intermediate_size + experts * d
    else:
        mlp = 3 * d * a.intermediate_size
    embed = a.vocab_size * d * (1 if a.tie_word_embeddings else 2)
    return L * (attn + mlp + 2 * d) + embed + d


def mlp_width(a) -> int:
    """The MLP's hidden width a token goes through (the routed experts' for a MoE)."""
    if getattr(a, "num_experts", 0):
        return a.num_experts_per_tok * a.moe_intermediate_size
    return a.intermediate_size


def layer_bytes_per_token(config: dict, targets: tuple, rank: int, act_bytes: int, checkpointed: bool,
                          dropout: bool = False) -> tuple[float, float]:
    """(kept for backward, transient in backward) bytes per token of one decoder layer."""
    a = model_args(config)
    d, hd = a.hidden_size, a.head_dim
    q, kv = a.num_attention_heads * hd, a.num_key_value_heads * hd
    inter = mlp_width(a)
    lin = a.lora_linears()
    adapted = {n: shape for n, shape in lin.items() if n.split(".")[-1] in targets}
    names = {n.split(".")[-1] for n in adapted}
    kept = (q + 2 * kv) + q + 3 * inter  # q/k/v, attention output, MLP
    if names & {"q_proj", "k_proj", "v_proj", "qkv_proj"}:
        kept += d  # the normed input the adapters read
    if "o_proj" in names:
        kept += q  # the attention output reshaped for o_proj
    if names & {"gate_proj", "up_proj", "gate_up_proj"}:
        kept += d
    if "down_proj" in names:
        kept += inter
    if getattr(a, "num_experts", 0):
        kept += a.num_experts  # router logits
    # x A^T, and the input A reads: a float32 copy of a lower-precision input; with dropout the
    # dropped float32 input and the mask (bool) it multiplied by.
    lora_input = (lambda i: 5 * i) if dropout else (lambda i: 4 * i if act_bytes != 4 else 0)
    # The two norms' inputs: the residual stream, float32 on every base (the torch decoder's).
    kept_bytes = kept * act_bytes + 2 * d * 4 + sum(4 * rank + lora_input(i) for i, _ in adapted.values())
    transient = 3 * inter * act_bytes + 2 * d * 4  # gradients of the MLP's intermediates and of the residual
    return kept_bytes, transient


def weights_per_rank(config: dict, params: int, shards: int = 1) -> float:
    """Base parameters one rank holds at a step's peak. Sharded across `shards` ranks (FSDP2, one
    unit per decoder layer and the root for the rest): its share of every tensor, the root's
    weights (embedding, final norm, an untied head) gathered whole for the step, and two layers
    gathered whole at once (the one running and the one fetched ahead of it)."""
    if shards <= 1:
        return params
    a = model_args(config)
    root = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2) + a.hidden_size
    layer = max(0, params - root) / a.num_hidden_layers
    return params / shards + root + 2 * layer


def estimate(config: dict, targets: tuple, rank: int, act_bytes: int, batch: Batch, grad_checkpoint: bool,
             runtime_gb: float, params: int | None = None, dropout: bool = False, shards: int = 1,
             streamed: tuple[int, int, int] | None = None) -> Estimate:
    """The predicted peak of one forward/backward over `batch` (plus the optimizer's state), on
    one of `shards` ranks that split the base (weights_per_rank); `streamed`: the base streamed
    from the file, its bytes (weights.stream_bytes: resident, mapped, the largest layer's mapped)."""
    a = model_args(config)
    weights = weights_per_rank(config, params if params is not None else base_params(config), shards) * act_bytes
    if streamed is not None:
        weights = streamed[0] + streamed[2] + STREAM_SCRATCH_BYTES
    lora_params = sum(rank * (i + o) for name, (i, o) in a.lora_linears().items() if name.split(".")[-1] in targets)
    lora = lora_params * a.num_hidden_layers * 4 * 4  # tensors, gradients, two moments
    kept, transient = layer_bytes_per_token(config, targets, rank, act_bytes, grad_checkpoint, dropout)
    n, L = batch.tokens, a.num_hidden_layers
    # Sliding layers shorter than the sequence go through an explicit mask: their scores are kept.
    windowed = sum(1 for i in range(L) if a.window(i) is not None and a.window(i) < batch.seq)
    scores = batch.rows * a.num_attention_heads * batch.seq * batch.seq * (act_bytes + 1)
    # One chunk of the loss: MLX's logits, log-softmax and the gradients of both (float32), and its
    # logits in the base dtype first. torch's in-place loss holds the same bytes in a full chunk
    # (more positions, fewer bytes each) and less in a short one: an upper bound there.
    logits = min(batch.targets, loss_chunk(a.vocab_size)) * a.vocab_size * (4 * 4 + (act_bytes if act_bytes != 4 else 0))
    logits += batch.targets * a.hidden_size * 4 * 2  # gathered hidden states and their gradient
    if grad_checkpoint:
        forward = L * n * a.hidden_size * 4  # each layer's input: the float32 residual stream
        backward = n * (kept + transient) + (scores if windowed else 0)  # one layer recomputed and its gradients
    else:
        forward = L * n * kept + windowed * scores
        backward = n * transient
    # At the start of backward the logits, their log-softmax and its gradient are alive; they are
    # freed before the layers' own backward runs, so the larger of the two sits on top of `forward`.
    backward = max(logits, backward)
    k = (1 + SLACK) / GB
    return Estimate(weights / GB, lora / GB, forward * k, backward * k, runtime_gb)


class NoFit(SpillpackError):
    last: "Plan | None" = None  # the least candidate tried, which did not fit either


def fit(config: dict, targets: tuple, rank: int, act_bytes: int, batches_at, batch: int, grad_accum: int, mode: str,
        available_gb: float, available_from: str, runtime_gb: float, params: int | None = None,
        max_seq: int | None = None, dropout: bool = False, shards: int = 1, streamed: tuple | None = None) -> Plan:
    """The plan a step runs under. `batches_at(m)` lists the job's micro-batches (as Batch) when
    each step's examples run m rows at a time. auto: the job's micro-batch as given, then with
    checkpointing, then micro-batches halved (4 x 1, 2 x 2, 1 x 4) until it fits; on: always
    checkpointing; off: never. Raises NoFit naming what would fit. `streamed`: as estimate's."""
    assert mode in MODES, mode
    est = lambda b, ckpt: estimate(config, targets, rank, act_bytes, b, ckpt, runtime_gb, params, dropout, shards, streamed)
    extra = {} if streamed is None else {"weights": "streamed", "streamed_gb": streamed[1] / GB,
                                         "layer_gb": (streamed[2] + STREAM_SCRATCH_BYTES) / GB}
    sizes, m = [], batch
    while True:
        sizes.append(m)
        if m == 1:
            break
        m = (m + 1) // 2
    # auto: the job as given, then checkpointing, then checkpointing with ever smaller micro-batches.
    order = {"auto": [(batch, False)] + [(m, True) for m in sizes], "on": [(m, True) for m in sizes],
             "off": [(m, False) for m in sizes]}[mode]
    tried, shapes = [], {}  # every candidate, in the order preferred (shown by --plan)
    for m, ckpt in order:
        if m not in shapes:
            shapes[m] = batches_at(m)
        worst = max(((est(b, ckpt), b) for b in shapes[m]), key=lambda eb: eb[0].peak_gb)
        tried.append(Plan(m, ckpt, worst[0], worst[1], available_gb, available_from, batch, grad_accum, **extra))
    for plan in tried:
        if plan.estimate.peak_gb <= available_gb:
            plan.tried = tried
            return plan
    last = tried[-1]
    e = NoFit(_no_fit_line(last, mode), _suggestion(est, last, max_seq))
    e.last = last
    raise e


def _no_fit_line(last: Plan, mode: str) -> str:
    how = "with checkpointing" if last.grad_checkpoint else "without checkpointing (--grad-checkpoint off)"
    where = "this machine has" if last.available_from != "--max-mem-gb" else "--max-mem-gb allows"
    streamed = " even with its base streamed from the file" if last.weights == "streamed" else ""
    return f"tune needs about {last.estimate.peak_gb:.1f} GB at micro-batch 1 {how}{streamed}; {where} {last.available_gb:.1f} GB"


def _suggestion(est, last: Plan, max_seq) -> str:
    """The longest --max-seq that would fit at micro-batch 1 with checkpointing, else the memory needed
    (`est(batch, checkpointing)`: fit's estimate)."""
    longest = last.longest
    seq = min(max_seq or longest.seq, longest.seq)
    while seq >= 32:
        seq //= 2
        shorter = Batch(1, seq, max(1, longest.targets * seq // max(1, longest.seq)))
        if est(shorter, True).peak_gb <= last.available_gb:
            return f"spillpack tune ... --max-seq {seq}"
    floor = est(Batch(1, 32, 16), True).peak_gb
    weights = (f"the streamed weights alone need {last.estimate.weights_gb:.2f} GB" if last.weights == "streamed"
               else f"the weights alone need {last.estimate.weights_gb:.1f} GB")
    return f"a machine with at least {floor:.1f} GB free ({weights}), or a smaller model"
