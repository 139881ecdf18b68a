"""How a torch model's weights lie in memory for its GEMMs: projections that read the same input
joined into one weight, and a float32 CPU base's weights stored transposed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def store_transposed(model: nn.Module) -> None:
    """Every linear weight (and a tied embedding, the head's weight) kept as the same (out, in)
    tensor, a view of (in, out) memory. F.linear multiplies x by weight.t(), which is then
    contiguous, and MKL's sgemm runs that plain product much faster than the transposed one at a
    decode step's few rows. Measured on a 2-core Intel Xeon, one thread, float32, per call:
    tiny's q/k/v (384 x 128) at 8 rows 23.9 -> 13.2 us, gate/up 39.4 -> 20.9; SmolLM2-135M's
    gate/up (3072 x 576) 1226 -> 668 us, its 49,152-token head 52.8 -> 30.3 ms; at 256 rows (a
    prefill) within 2% either way. A tied embedding's lookup then gathers strided columns (8
    tokens 4.8 -> 62 us, a 2,048-token prefill chunk 0.7 -> 29 ms), far less than the head saves.
    For generation and evaluation on a CPU's float32 base only: bfloat16 (oneDNN) gained at some
    shapes and lost at others, and a tune's backward reads the weight the other way round."""
    with torch.no_grad():
        weights = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if getattr(model, "lm_head", True) is None:  # tied: the head multiplies by the embedding
            weights.append(model.model.embed_tokens)
        for m in weights:
            m.weight = nn.Parameter(m.weight.t().contiguous().t(), requires_grad=m.weight.requires_grad)


def linear(module: nn.Module, x):
    """module(x), for a plain nn.Linear through F.linear without nn.Module's call machinery: a
    small model's decode step is its calls (tiny, 128 rows, one thread, in-process A/B over 10
    rounds with o_proj and down_proj so: 1.12x median, 8 rounds of 10 faster). Anything else
    (a LoRA wrapper) is called as a module. No module of the engine's models carries hooks."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def _transposed(w: torch.Tensor) -> bool:
    return w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous()


def joined_outputs(module: nn.Module, names: tuple[str, ...], x) -> list:
    """The outputs of `module`'s linears `names`, which all read x, from one GEMM over their
    weights laid end to end: q/k/v and gate/up become one call each, which on a small model's
    decode step (calls, not arithmetic, most of its time) saves what the peer spends. Each
    linear keeps its weight, as a view into the joined tensor, so checkpoint names, state_dict
    and LoRA targets are unchanged. A LoRA wrapper (its frozen linear as `.base`) adds its own
    update to its part.

    Only where no gradient flows back through x (generation, evaluation): in a tune the joined
    output's split and the gradients joined again in backward cost more than the one GEMM saves
    (Qwen2.5-0.5B shape, float32, 2-core AMD EPYC: 83.2 tokens/s joined, 87.8 separate)."""
    linears = [getattr(module, n) for n in names]
    bases = [getattr(m, "base", m) for m in linears]
    joined = None if torch.is_grad_enabled() and x.requires_grad else _joined(module, bases)
    if joined is None:
        outs = [b(x) for b in bases]
    else:
        weight, bias, sizes = joined
        outs = list(F.linear(x, weight, bias).split(sizes, dim=-1))
    return [y if m is b else m.add_update(y, x) for y, m, b in zip(outs, linears, bases)]


def _joined(module: nn.Module, bases: list):
    """(weight, bias, sizes) joining `bases`, made on first use and again whenever a weight has
    moved (model.to(), a reload); None where a weight is being trained, whose gradient must
    reach its own parameter (the engine's base is frozen: this is for other callers)."""
    weights = [b.weight for b in bases]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    ptrs = tuple(w.data_ptr() for w in weights)
    cached = module.__dict__.get("joined_linears")
    if cached is not None and cached[0] == ptrs:
        return cached[1]
    with torch.no_grad():
        if all(_transposed(w) for w in weights):  # store_transposed's layout, kept: (out, in) views of (in, out) memory
            weight = torch.cat([w.t() for w in weights], dim=1).t()
        else:
            weight = torch.cat(weights)
        bias = None if bases[0].bias is None else torch.cat([b.bias for b in bases])
    sizes = [w.shape[0] for w in weights]
    for b, part, w in zip(bases, weight.split(sizes), weights):
        b.weight = nn.Parameter(part, requires_grad=w.requires_grad)  # the separate copy is freed
    if bias is not None:
        for b, part in zip(bases, bias.split(sizes)):
            b.bias = nn.Parameter(part, requires_grad=b.bias.requires_grad)
    module.__dict__["joined_linears"] = (tuple(b.weight.data_ptr() for b in bases), (weight, bias, sizes))
    return weight, bias, sizes


def join_linears(model: nn.Module) -> None:
    """Join every module's `joined` linears now, as joined_outputs would on first use: at load,
    so the separate copies are freed before anything else is allocated (the loader then hands
    the freed heap back to the system: SmolLM2-135M in bfloat16, +289 MiB joined untrimmed,
    +263 trimmed, +268 not joined)."""
    with torch.no_grad():
        for module in model.modules():
            for names in getattr(module, "joined", ()):
                _joined(module, [getattr(getattr(module, n), "base", getattr(module, n)) for n in names])
