"""First guesses of a row job's length for the `start` event's estimated_seconds, from the
model's shape alone: rough by design (a conservative 20 GFLOP/s a core and 10 GB/s of memory on
CPU); the row and step events' eta_s replace them with measurements. Training's one formula is
training_seconds: a tune gives it the engine's measured rate, a build (before it has measured
anything) the conservative CPU rate."""

from runtime.base.allotment import cpus

FLOPS_PER_CORE = 20e9
MEMORY_BPS = 10e9


def params(config: dict) -> int:
    h, L, i, v = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
    return L * (4 * h * h + 3 * h * i) + h * v


def cpu_flops() -> float:
    return FLOPS_PER_CORE * cpus().count


def generation_seconds(config: dict, prompt_tokens: int, new_tokens: int, batch: int) -> float:
    """Prefill and decode FLOPs (2 x params a token), plus reading the float32 weights once per
    decode step of `batch` rows (decode is bound by memory as much as by arithmetic)."""
    p = params(config)
    flops = 2 * p * (prompt_tokens + new_tokens) / cpu_flops()
    reads = (new_tokens / max(1, batch)) * 4 * p / MEMORY_BPS
    return round(flops + reads, 1)


def training_seconds(config: dict, tokens: int, flops_per_s: float) -> float:
    """`tokens` trained tokens: ~4 x params FLOPs a token (the forward, and the backward through
    activations only: the frozen base needs no weight gradients) at `flops_per_s`."""
    return round(4 * params(config) * tokens / flops_per_s, 1)
