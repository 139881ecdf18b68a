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


def head_key(names) -> str:
    """The weight the logits multiply by: the head's own, else the embedding it is tied to."""
    return next(k for k in HEAD_KEYS if k in names)


def quantized_modules(model: nn.Module, weights, dtype, head: str, dense_head: bool = False, tune: bool = False) -> dict:
    """Put the quantized modules in `model` (built on the meta device) for the Blocks among
    `weights` ((name, tensor) pairs in the file's order, as the load reads them), each laid out as
    soon as all its module takes has come: a joined group's weights (q/k/v, gate/up: their rows
    end to end, one product) and every bias. So the load holds the layouts made so far and the
    blocks of one group, never the file's blocks beside their layouts. Returns the dense tensors
    left for load_state_dict (the quantized linears' biases taken into their modules). A
    quantized weight of a module that is neither an nn.Linear nor an nn.Embedding (a family's
    own) is dequantized: nothing is left unloaded. With `dense_head` the weight `head` (head_key)
    is dequantized: the logits' product runs over every row of the vocabulary at every step,
    where the scratch's dequantization costs several times the product (SmolLM2's Q8_0 49152 x
    576 head, bfloat16, 32 rows: 93-107 ms a step against 15-22 ms dense). `tune`: for a tune's
    frozen base (quant_grad.py), each linear on its own, on the scratch, whose blocks its input's
    gradient is taken through (joined_outputs runs a group apart where a gradient flows back)."""
    groups = {} if tune else joinable_groups(model)
    rest, pending = {}, {}
    for key, t in weights:
        if isinstance(t, Blocks) and dense_head and key == head:
            rest[key] = dense_copy(t, *t.shape, dtype)
            del t  # its blocks are not held through the layers' layouts
            trim_heap()
            continue
        (pending if isinstance(t, Blocks) else rest)[key] = t
        del t
        name = key.rpartition(".")[0]
        group = groups.get(name, (name,))
        if all(f"{f}.weight" in pending and (f"{f}.bias" in rest or not _has_bias(model, f)) for f in group):
            if len(group) == 1 or not _join_group(model, group, pending, rest, dtype):
                for f in group:
                    _lay_out(model, f"{f}.weight", pending.pop(f"{f}.weight"), rest, dtype, tune)
            # glibc keeps what a layout frees (the file's bytes, the blocks it replaced, int4pack's
            # int32 values: about 12 bytes a weight) for later allocations: handed back at once,
            # the load's high-water mark stays that of the layouts held, not of all it freed.
            trim_heap()
    for key in list(pending):  # a group one of whose weights came dense: each linear its own module
        _lay_out(model, key, pending.pop(key), rest, dtype, tune)
    return rest


def joinable_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Module name -> the full names of the nn.Linear group it is joined in (a family's `joined`)."""
    out = {}
    for parent_name, parent in model.named_modules():
        for names in getattr(parent, "joined", ()):
            if all(type(parent._modules.get(n)) is nn.Linear for n in names):
                full = tuple(f"{parent_name}.{n}" for n in names)
                out.update(dict.fromkeys(full, full))
    return out


def _has_bias(model: nn.Module, name: str) -> bool:
    module = model.get_submodule(name)
    return type(module) is nn.Linear and module.bias is not None


def _join_group(model: nn.Module, full: tuple[str, ...], pending: dict, rest: dict, dtype) -> bool:
    """The group's linears as one QuantLinear (its members hollow), their blocks and biases taken
    out of `pending` and `rest`; False where their types or widths differ."""
    qts = [pending[f"{f}.weight"] for f in full]
    one = join(qts, [rest.get(f"{f}.bias") for f in full], dtype)
    if one is None:
        return False
    parent = model.get_submodule(full[0].rpartition(".")[0])
    for f, qt in zip(full, qts):
        rest.pop(f"{f}.bias", None)
        del pending[f"{f}.weight"]
        parent._modules[f.rpartition(".")[2]] = HollowLinear(qt.shape, dtype, qt.kind)
    parent.__dict__["joined_linears"] = (LAID_OUT, (one, None, [qt.shape[0] for qt in qts]))
    return True


def _lay_out(model: nn.Module, key: str, qt, rest: dict, dtype, tune: bool) -> None:
    """One quantized weight's module: a QuantLinear (its bias taken from `rest`), a QuantEmbedding,
    or, for any other module, the weight dequantized into `rest`."""
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
