"""How a torch model's weights lie in memory for its GEMMs: projections that read the same input
joined into one weight, and a float32 CPU base's layouts for inference (large weights packed for
oneDNN, small ones stored transposed for MKL) and for a tune (large frozen linears on oneDNN):
the kernels are runtime/engines/torch/models/gemm.py's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.base.heap import trim_heap
from runtime.engines.torch.models.gemm import BlasLinear, FrozenLinear, PackedLinear, frozen_product, gemm, onednn_linear, pack
from runtime.engines.torch.models.small_gemm import blas_is_faster


# A float32 CPU base's linear of at least this many weights runs on oneDNN with its weight packed
# once at load (PackedLinear); a smaller one on MKL with its weight stored transposed. Measured on
# a 2-core AMD EPYC (AVX2), 8 rows, per call, MKL against packed oneDNN: SmolLM2-135M's gate/up
# (3072 x 576) 974 -> 597 us at one thread and 974 -> 288 us at two (MKL runs a few rows on one
# thread), its down (576 x 1536) 352 -> 229 / 366 -> 152 us; a 512-token prefill chunk of gate/up
# 94 -> 153 GFLOP/s at two threads. At tiny's shapes (128 x 384 and smaller) a oneDNN call costs
# more than it saves (22 -> 41 us), and the measured crossover lies near 128 x 1003.
PACK_MIN_WEIGHTS = 1 << 18


def cpu_inference_layout(model: nn.Module) -> None:
    """Lay a float32 CPU base's weights out for generation and evaluation (no gradient reaches
    them): linears of PACK_MIN_WEIGHTS or more packed for oneDNN, the dense copies freed (q/k/v
    and gate/up packed joined, as joined_outputs runs them); a tied head over a large vocabulary
    multiplied with the embedding as it lies (`head`).

    Smaller weights, and a small tied head, are kept as the same (out, in) tensors, views of
    (in, out) memory: F.linear multiplies x by weight.t(), which is then contiguous, and MKL runs
    that plain product faster at a decode step's few rows (2-core Intel Xeon, one thread: tiny's
    q/k/v at 8 rows 23.9 -> 13.2 us, gate/up 39.4 -> 20.9; on the AMD EPYC above, within 10%).
    A tied embedding so stored gathers strided columns for its lookups (8 tokens 4.8 -> 62 us),
    which only a small vocabulary's head repays.

    Where numpy's BLAS multiplies such small products faster than MKL (small_gemm.blas_is_faster,
    measured per machine), the smaller linears, joined groups and head run on it, over the same
    transposed memory (BlasLinear; joined_outputs; gemm.head's "blas"), and so do the attention
    layers' decode steps (decode_blas)."""
    packs = onednn_linear()
    blas = blas_is_faster()
    joined_bases = set()
    with torch.no_grad():
        for module in list(model.modules()):
            if blas and hasattr(module, "decode_blas"):
                module.decode_blas = True  # its decode steps' attention products (attention.decode_attention)
            for names in getattr(module, "joined", ()):
                bases = [base_linear(getattr(module, n)) for n in names]
                if any(type(b) is not nn.Linear for b in bases):  # quantized (quant_layout.py): laid out already
                    continue
                joined_bases.update(map(id, bases))
                small = not (packs and sum(b.weight.numel() for b in bases) >= PACK_MIN_WEIGHTS)
                if small:
                    if blas:  # _joined lays the joined weight out for numpy's BLAS
                        module.__dict__["joined_kernel"] = BLAS
                    continue
                bias = None if bases[0].bias is None else torch.cat([b.bias for b in bases])
                weight = pack(torch.cat([b.weight for b in bases]))
                module.__dict__["joined_linears"] = (LAID_OUT, (weight, bias, [b.weight.shape[0] for b in bases]))
                for b in bases:
                    _free_dense(b)
                trim_heap()  # the dense copy's pages back before the next is packed beside it
        for m in list(model.modules()):
            if type(m) is not nn.Linear or m.weight.is_meta:
                continue
            if packs and m.weight.numel() >= PACK_MIN_WEIGHTS:
                m.packed = pack(m.weight)
                _free_dense(m)
                m.__class__ = PackedLinear
                trim_heap()
            else:
                m.weight = nn.Parameter(m.weight.t().contiguous().t(), requires_grad=m.weight.requires_grad)
                if blas and id(m) not in joined_bases:  # a joined one runs through its group's weight
                    m.weight_t = m.weight.detach().t().numpy()
                    m.__class__ = BlasLinear
        tied = getattr(model, "lm_head", True) is None
        if tied and not model.model.embed_tokens.weight.is_meta:  # (a quantized embedding multiplies its own head)
            embed = model.model.embed_tokens
            if embed.weight.numel() >= PACK_MIN_WEIGHTS:
                model.head_kernel = "by_rows"
            else:
                embed.weight = nn.Parameter(embed.weight.t().contiguous().t(), requires_grad=embed.weight.requires_grad)
                if blas:
                    model.head_kernel = "blas"


def cpu_training_layout(model: nn.Module) -> None:
    """A tune's frozen linears of PACK_MIN_WEIGHTS or more, on a float32 CPU base, as FrozenLinear:
    forward on oneDNN over the dense weight (no copy), the input's gradient on MKL; a large tied
    head so too (gemm.head's "frozen"). A quantized base's products on the same kernels, so its
    tune is the dense base's bit for bit (quant_grad.py)."""
    if not onednn_linear():
        return
    grouped = {id(base_linear(getattr(mod, n))) for mod in model.modules() for names in getattr(mod, "joined", ()) for n in names}
    for m in model.modules():
        if type(m) is nn.Linear and not m.weight.requires_grad and m.weight.numel() >= PACK_MIN_WEIGHTS:
            m.__class__ = FrozenLinear
        elif hasattr(m, "grad_linear") and m.weight.numel() >= PACK_MIN_WEIGHTS:
            # A quantized linear (quant_linear.py): its chunks on the kernel the dense one would take,
            # FrozenLinear's; a joined group's on MKL where no gradient flows, as joined_outputs' one GEMM.
            m.grad_linear = frozen_product
            if id(m) not in grouped:
                m.chunk_linear = frozen_product
    embed = model.model.embed_tokens
    if getattr(model, "lm_head", True) is None and not embed.weight.requires_grad and embed.weight.numel() >= PACK_MIN_WEIGHTS:
        model.head_kernel = "frozen"
        if hasattr(embed, "grad_linear"):  # a quantized embedding's head, so too
            embed.chunk_linear = embed.grad_linear = frozen_product


# joined_linears' key for a joined weight laid out for inference (packed, or a numpy view for BLAS):
# no dense weights' addresses to compare at each call.
LAID_OUT = "laid out"
BLAS = "blas"  # joined_kernel's value: the joined weight handed to gemm as its (in, out) numpy view
# joined_kernel's value where the weights must stay apart: FSDP gathers each into its own tensor
# for every call (runtime/engines/torch/shard.py), so a joined copy would be a second, stale one.
SEPARATE = "separate"


def _free_dense(m: nn.Linear) -> None:
    """The dense weight dropped for a placeholder of its shape and dtype on the meta device: the
    memory is the packed copy's alone, and any use of the dense weight fails loudly."""
    m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta"), requires_grad=False)


def base_linear(m: nn.Module) -> nn.Module:
    return getattr(m, "base", m)  # a LoRA wrapper's frozen linear


def linear(module: nn.Module, x):
    """module(x) without nn.Module's call machinery: a small model's decode step is its calls
    (tiny, 128 rows, one thread, in-process A/B over 10 rounds with o_proj and down_proj through
    F.linear: 1.12x median, 8 rounds of 10 faster). A plain nn.Linear runs as F.linear, anything
    else (a BlasLinear, a PackedLinear, a LoRA wrapper) by its forward. No module of the engine's
    models carries hooks."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module.forward(x)


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
    linears = [module._modules[n] for n in names]
    bases = [m._modules.get("base", m) for m in linears]  # a LoRA wrapper's frozen linear is its `base`
    joined = None if torch.is_grad_enabled() and x.requires_grad else _joined(module, bases)
    if joined is None:
        outs = [b(x) for b in bases]
    else:
        weight, bias, sizes = joined
        outs = gemm(x, weight, bias).split_with_sizes(sizes, -1)
    if linears == bases:  # no LoRA wrapper among them (list equality: identity first)
        return outs
    return [y if m is b else m.add_update(y, x) for y, m, b in zip(outs, linears, bases)]


def _joined(module: nn.Module, bases: list):
    """(weight, bias, sizes) joining `bases`, made on first use and again whenever a weight has
    moved (model.to(), a reload); None where a weight is being trained, whose gradient must
    reach its own parameter (the engine's base is frozen: this is for other callers)."""
    if module.__dict__.get("joined_kernel") == SEPARATE:
        return None
    cached = module.__dict__.get("joined_linears")
    if cached is not None and cached[0] is LAID_OUT:
        return cached[1]
    weights = [b.weight for b in bases]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    if any(w.is_meta for w in weights):  # quantized linears that could not be joined: each runs its own product
        return None
    ptrs = tuple(w.data_ptr() for w in weights)
    if cached is not None and cached[0] == ptrs:
        return cached[1]
    with torch.no_grad():
        if all(_transposed(w) for w in weights):  # cpu_inference_layout's transposed weights, kept: (out, in) views of (in, out) memory
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
    key = tuple(b.weight.data_ptr() for b in bases)
    if module.__dict__.get("joined_kernel") == BLAS and _transposed(weight):
        # The same memory, as gemm's numpy BLAS takes it: laid out for inference once, as a packed
        # weight is, and not checked again at every call (the numpy view holds its memory).
        weight, key = weight.t().numpy(), LAID_OUT
    module.__dict__["joined_linears"] = (key, (weight, bias, sizes))
    return weight, bias, sizes


def joined_weight(module: nn.Module, names: tuple[str, ...]):
    """(weight, bias) of `module`'s joined linears `names`, as gemm takes them (joined_outputs' one GEMM)."""
    weight, bias, _ = _joined(module, [base_linear(module._modules[n]) for n in names])
    return weight, bias


def join_linears(model: nn.Module) -> None:
    """Join every module's `joined` linears now, as joined_outputs would on first use: at load,
    so the separate copies are freed before anything else is allocated (the loader then hands
    the freed heap back to the system: SmolLM2-135M in bfloat16, +289 MiB joined untrimmed,
    +263 trimmed, +268 not joined)."""
    with torch.no_grad():
        for module in model.modules():
            for names in getattr(module, "joined", ()):
                _joined(module, [getattr(getattr(module, n), "base", getattr(module, n)) for n in names])
