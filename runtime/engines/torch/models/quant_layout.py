"""A model's modules over a quantized GGUF's weights: each linear (and the embedding) whose
weight came as a QuantTensor replaced by its quantized module (quant_linear.py), and q/k/v and
gate/up joined as their quantized rows laid end to end, so joined_outputs runs each group as
one product as it does for dense weights."""

from __future__ import annotations

import torch
from torch import nn

from runtime.base.heap import trim_heap
from runtime.engines.torch.models.layout import LAID_OUT
from runtime.engines.torch.models.quant_blocks import Blocks, blocks_of, dense_copy
from runtime.engines.torch.models.quant_linear import HollowLinear, QuantEmbedding, QuantLinear


HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight")  # the head: its own weight, else the tied embedding


def head_key(weights) -> str:
    """The weight the logits multiply by: the head's own, else the embedding it is tied to."""
    return next(k for k in HEAD_KEYS if k in weights)


def quantized_modules(model: nn.Module, weights: dict, dtype, dense_head: bool = False, tune: bool = False) -> dict:
    """Put the quantized modules in `model` (built on the meta device) for the Blocks of `weights`
    (load_weights' quantized tensors), taking each out of `weights` as its module is made (so the
    blocks are held once: a joined group's or int4pack's layout replaces them); returns the dense tensors left for
    load_state_dict (the quantized linears' biases taken into their modules). A quantized weight
    of a module that is neither an nn.Linear nor an nn.Embedding (a family's own) is dequantized:
    nothing is left unloaded. With `dense_head` the head's weight is dequantized (head_key): the
    logits' product runs over every row of the vocabulary at every step, where the scratch's
    dequantization costs several times the product (SmolLM2's Q8_0 49152 x 576 head, bfloat16,
    32 rows: 93-107 ms a step against 15-22 ms dense). `tune`: for a tune's frozen base
    (quant_grad.py), each linear on its own, on the scratch, whose blocks its input's gradient is
    taken through (joined_outputs runs a group apart where a gradient flows back)."""
    if dense_head and isinstance(weights.get(key := head_key(weights)), Blocks):
        qt = weights[key]
        weights[key] = dense_copy(qt, *qt.shape, dtype)
        del qt  # its blocks are not held through the joins below
        trim_heap()
    freed = Freed()
    quant = {k: weights.pop(k) for k in [k for k, v in weights.items() if isinstance(v, Blocks)]}
    rest = weights
    for parent_name, parent in list(model.named_modules()):
        for names in () if tune else getattr(parent, "joined", ()):
            full = [f"{parent_name}.{n}" for n in names]
            if not all(f"{f}.weight" in quant and type(parent._modules[n]) is nn.Linear for f, n in zip(full, names)):
                continue
            qts = [quant[f"{f}.weight"] for f in full]
            one = join(qts, [rest.get(f"{f}.bias") for f in full], dtype)
            if one is None:  # types or widths differ: each linear its own quantized module
                continue
            for f, n, qt in zip(full, names, qts):
                rest.pop(f"{f}.bias", None)
                del quant[f"{f}.weight"]
                parent._modules[n] = HollowLinear(qt.shape, dtype, qt.kind)
            parent.__dict__["joined_linears"] = (LAID_OUT, (one, None, [qt.shape[0] for qt in qts]))
            freed.add(sum(qt.nbytes() for qt in qts))
            del qts, one, qt
    for key in list(quant):
        qt = quant.pop(key)
        name = key.removesuffix(".weight")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = parent._modules[child]
        if isinstance(old, nn.Embedding):
            parent._modules[child] = QuantEmbedding(qt, dtype)
        elif type(old) is nn.Linear:
            parent._modules[child] = QuantLinear(qt, rest.pop(f"{name}.bias", None), dtype, "scratch" if tune else _kernel(qt))
        else:
            rest[key] = dense_copy(qt, *qt.shape, dtype)
        freed.add(qt.nbytes())
        del qt
    return rest


class Freed:
    """glibc's free pages handed back after every TRIM_BYTES of blocks laid out (some replaced by
    their layout, some kept by it): glibc keeps what a load frees for later allocations, so without
    it the load's peak holds every block replaced so far beside the layouts made from them."""

    TRIM_BYTES = 16 * 2**20

    def __init__(self):
        self.pending = 0

    def add(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.TRIM_BYTES:
            trim_heap()
            self.pending = 0


def kernels(model: nn.Module) -> dict[str, int]:
    """"<type> on <kernel>" -> how many quantized products of `model` run so (a joined group counts once)."""
    out = {}
    for m in model.modules():
        found = [m] if isinstance(m, QuantLinear) else []
        cached = m.__dict__.get("joined_linears")
        if cached and cached[0] is LAID_OUT and isinstance(cached[1][0], QuantLinear):
            found.append(cached[1][0])
        if isinstance(m, QuantEmbedding):
            key = f"{m.kind} embedding and head on scratch"
            out[key] = out.get(key, 0) + 1
        for q in found:
            key = f"{q.kind} on {q.kernel}"
            out[key] = out.get(key, 0) + 1
    return out


def join(qts: list, biases: list, dtype) -> QuantLinear | None:
    """One QuantLinear over the rows of `qts` (QuantTensors or their Blocks) laid end to end
    (q/k/v, gate/up: same type and input width), or None where they cannot be joined."""
    if len({q.kind for q in qts}) != 1 or len({q.shape[1] for q in qts}) != 1:
        return None
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    from runtime.engines.torch.models.streamed import joined as join_blocks

    parts = [blocks_of(q) for q in qts]
    one = join_blocks(parts)
    del parts
    bias = None if biases[0] is None else torch.cat(biases)
    return QuantLinear(one, bias, dtype, _kernel(one))


def _kernel(blocks) -> str | None:
    """A mapped weight's kernel: the scratch, which reads the map (int4pack would pack a copy);
    None: measured as ever."""
    return "scratch" if getattr(blocks, "mapped", False) else None


def quantized_blocks(model: nn.Module) -> list:
    """The Blocks of `model`'s quantized modules (a joined group's once)."""
    out = []
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.blocks is not None:
            out.append(m.blocks)
        joined = (m.__dict__.get("joined_linears") or (None, (None,)))[1][0]
        if isinstance(joined, QuantLinear) and joined.blocks is not None:
            out.append(joined.blocks)
    return out


def resident_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s weights as they lie: dense parameters and buffers, and each quantized
    module's layout (a meta placeholder counts nothing)."""
    total = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if not t.is_meta)
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            total += m.nbytes()
        joined = (m.__dict__.get("joined_linears") or (None, (None,)))[1][0]  # a joined group's one QuantLinear
        if isinstance(joined, QuantLinear):
            total += joined.nbytes()
    return total


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(resident, mapped) bytes of `model`'s weights: what it holds in memory, and what are views
    of a map (held by the page cache, dropped and read again as memory requires)."""
    maps = getattr(model, "streamed_weights", frozenset())
    resident = mapped = 0
    for b in quantized_blocks(model):
        resident += b.nbytes()
        mapped += b.held_bytes() if b.mapped else 0
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        if t.untyped_storage().data_ptr() in maps:
            mapped += t.nbytes
        else:
            resident += t.nbytes
    return resident, mapped
