"""A streamed load's weights as torch sees them: views of the file's map, never a copy of a layer.

runtime.models.mapped reads every 2-D weight as a read-only view of its file's map; here each
becomes what the model multiplies:

- a float weight stored in the compute dtype, in its stored row order: the mapped tensor itself,
  the module's weight (its products read the map);
- any other float weight (another dtype, or a llama q/k whose rows are permuted in the file):
  FloatBlocks, converted a chunk of rows at a time into quant_blocks' scratch just before its
  product, as a quantized weight is dequantized;
- a quantized weight: its Blocks over the map (quant_blocks.py), on the scratch kernel (int4pack
  would need a packed copy); a q/k's row order applied as each chunk's rows are gathered
  (OrderedBlocks), so the permuted projections are read from the map too;
- q/k/v and gate/up joined without a copy (JoinedBlocks: one product over the parts' rows);
  dense mapped linears stay separate products (joining them would copy).

Only the 1-D tensors (norms, biases) are read into memory, converted to the compute dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runtime.engines.torch.models.quant_blocks import Blocks, blocks_of, mapped_tensor
from runtime.models.mapped import MappedFloat, is_mapped


class FloatBlocks(Blocks):
    """A float weight in its file's dtype (`w`, (rows, cols), a view of the map), converted to float32
    a range of rows at a time."""

    fields = ("w",)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        out.copy_(self.w[lo:hi])


class OrderedBlocks(Blocks):
    """`base`'s rows read in `order` (row i is base's row order[i]): a chunk's rows gathered (a copy
    of the chunk alone) and dequantized."""

    def __init__(self, base: Blocks, order: np.ndarray):
        super().__init__(base.kind, base.shape, base.mapped)
        self.base, self.order = base, torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))

    def held_bytes(self) -> int:
        return self.base.held_bytes()

    def nbytes(self) -> int:
        return self.base.nbytes() + self.order.nbytes

    def values(self, out: torch.Tensor) -> torch.Tensor:
        return self.base.values(out)

    def rows(self, index) -> Blocks:
        return self.base.rows(self.order[index])

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        gathered = _gathered([(self, lo, hi)])
        (gathered or self.base.rows(self.order[lo:hi])).into(out, 0, hi - lo)


class JoinedBlocks(Blocks):
    """The rows of `parts` (one kind, one width) end to end, without a copy: a range of rows is
    dequantized part by part."""

    def __init__(self, parts: list[Blocks]):
        super().__init__(parts[0].kind, (sum(p.shape[0] for p in parts), parts[0].shape[1]), all(p.mapped for p in parts))
        self.parts = parts
        self.starts = np.cumsum([0] + [p.shape[0] for p in parts])[:-1].tolist()

    def held_bytes(self) -> int:
        return sum(p.held_bytes() for p in self.parts)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        return self.parts[0].values(out)

    def rows(self, index) -> Blocks:
        raise NotImplementedError("a joined group's rows are read by ranges (into)")

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        ranges = [(part, max(lo, start) - start, min(hi, start + part.shape[0]) - start)
                  for part, start in zip(self.parts, self.starts) if max(lo, start) < min(hi, start + part.shape[0])]
        gathered = _gathered(ranges) if len(ranges) > 1 else None
        if gathered is not None:  # the parts' rows as one chunk of bytes: one dequantization, not one per part
            gathered.into(out, 0, hi - lo)
            return
        at = 0
        for part, a, b in ranges:
            part.into(out[at:at + b - a], a, b)
            at += b - a


def _gathered(ranges) -> Blocks | None:
    """The rows (part, lo, hi) of mapped quantized weights of one kind as one Blocks over their bytes
    gathered in one copy (a q/k's rows in their order); None where a part has no bytes to gather."""
    pieces, kind = [], None
    for part, lo, hi in ranges:
        base, index = (part.base, part.order[lo:hi]) if isinstance(part, OrderedBlocks) else (part, slice(lo, hi))
        if base.rows_raw is None:
            return None
        pieces.append(base.rows_raw[index])
        kind = kind or type(base)
    raw = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return kind.over(ranges[0][0].kind, (raw.shape[0], ranges[0][0].shape[1]), raw)


def joined(parts: list[Blocks]) -> Blocks:
    """One Blocks over the rows of `parts`: a view for mapped parts, else a copy in their layout."""
    if all(p.mapped for p in parts):
        return JoinedBlocks(parts)
    return type(parts[0]).cat(parts)


def _ordered(blocks: Blocks, order) -> Blocks:
    return blocks if order is None else OrderedBlocks(blocks, order)


def streamed_tensors(files, dtype, mapped: set):
    """(name, tensor or Blocks) of a streamed load (the module's doc), one at a time; the storage
    of each weight used as the map itself is added to `mapped` (by its address)."""
    from runtime.models.gguf.tensors import QuantTensor
    from runtime.models.weights import read_tensors

    for name, kind, array in read_tensors(files, mapped=True):
        if isinstance(array, QuantTensor):
            yield name, _ordered(blocks_of(array), array.order)
            continue
        order = None
        if isinstance(array, MappedFloat):
            array, order = array.raw, array.order
        t = mapped_tensor(array) if is_mapped(array) else torch.from_numpy(array)
        if kind == "BF16":
            t = t.view(torch.bfloat16)
        if not is_mapped(array):  # read into memory: the 1-D tensors
            yield name, t.to(dtype)
        elif order is None and t.dtype == dtype:
            mapped.add(t.untyped_storage().data_ptr())
            yield name, t  # the weight itself
        else:
            yield name, _ordered(FloatBlocks(kind, tuple(t.shape), True, w=t), order)


def mark_streamed(model: nn.Module, mapped: set) -> None:
    """After the load: dense mapped linears of a joined group stay separate products (joining
    would copy them), and the numpy decode step (which runs on joined copies) is not taken.
    `mapped`: the storages that are the map's (streamed_tensors)."""
    from runtime.engines.torch.models.layout import LAID_OUT, SEPARATE

    model.streamed_weights = frozenset(mapped)
    for module in model.modules():
        if getattr(module, "joined", ()) and (module.__dict__.get("joined_linears") or (None,))[0] is not LAID_OUT:
            module.__dict__["joined_kernel"] = SEPARATE
