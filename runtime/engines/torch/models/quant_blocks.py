"""A quantized GGUF weight's blocks as torch tensors, and the scratch they are dequantized into.

Each kind keeps what its products need: Q8_0 its int8 values and scales, Q4_0/Q4_1 their nibbles,
scales (and minimums), a K-quant its raw bytes (dequantized by gguf's reference). `dequantized`
turns a range of rows into one reused, thread-local buffer of the compute dtype, so no float copy
of a whole layer exists at any time; `scratch_product` multiplies by a weight a chunk of rows at a
time; `int4pack` lays Q4_0/Q4_1 out for torch's int4 kernel (quant_linear.py says when each runs).

A streamed load's blocks (runtime.models.mapped) are not copies: each field is a strided view of
the file's map as the blocks lie there interleaved (a Q8_0 weight's (rows, blocks, 34) bytes,
its scale the first two of each block), and `into` converts the scales of the rows it reads.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from runtime.models.memory import SCRATCH_BYTES  # a chunk of dequantized rows (the planner counts it)

GROUP = 32  # values a block of Q8_0, Q4_0 and Q4_1 (and the int4pack group size)
INT4PACK_TYPES = ("Q4_0", "Q4_1")


# ---- blocks: a QuantTensor held as torch tensors, dequantized a range of rows at a time


class Blocks:
    """A quantized weight's blocks as torch tensors (its `fields`, each (rows, ...)), of `kind` and
    (rows, cols) `shape`; `into` dequantizes a range of rows into a float32 buffer. `mapped`: the
    fields are views of a file's map (resident bytes: none)."""

    fields: tuple[str, ...] = ()

    def __init__(self, kind: str, shape: tuple[int, int], mapped: bool = False, rows_raw: torch.Tensor | None = None,
                 **tensors):
        """`rows_raw`: a mapped weight's bytes (rows, bytes a row), its fields' views; `over(kind, shape, rows of raw)` makes
        the blocks of rows gathered from them in one copy (a permuted weight's chunk)."""
        self.kind, self.shape, self.mapped, self.rows_raw = kind, tuple(shape), mapped, rows_raw
        for name in self.fields:
            setattr(self, name, tensors.get(name))

    def held_bytes(self) -> int:
        """The bytes of the fields' data, in memory or in the map."""
        return sum(_extent(t) for t in (getattr(self, f) for f in self.fields) if t is not None)

    def nbytes(self) -> int:
        """The bytes held in memory."""
        return 0 if self.mapped else self.held_bytes()

    def rows(self, index) -> "Blocks":
        """The blocks of some rows (an embedding's lookups)."""
        picked = {f: getattr(self, f) for f in self.fields}
        return type(self)(self.kind, (-1, self.shape[1]), **{f: None if t is None else t[index] for f, t in picked.items()})

    @classmethod
    def cat(cls, parts: list["Blocks"]) -> "Blocks":
        """The rows of `parts` (one kind, one width) end to end."""
        tensors = {f: None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]) for f in cls.fields}
        return cls(parts[0].kind, (sum(p.shape[0] for p in parts), parts[0].shape[1]), **tensors)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """`out` (rows, cols) viewed as into() writes it."""
        return out.view(out.shape[0], -1, GROUP)


class Q8Blocks(Blocks):
    """Q8_0: per block of 32, an f16 scale d and 32 int8 values; w = d * q."""

    fields = ("q", "d")  # (rows, blocks, 32) int8; (rows, blocks, 1) float32

    @classmethod
    def of(cls, qt) -> "Q8Blocks":
        if qt.mapped:
            return cls.over(qt.kind, qt.shape, mapped_tensor(qt.raw))
        b = qt.raw.reshape(qt.shape[0], qt.shape[1] // GROUP, 34)
        return cls(qt.kind, qt.shape, q=torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)), d=_f16(b[..., :2]))

    @classmethod
    def over(cls, kind: str, shape, raw: torch.Tensor) -> "Q8Blocks":
        """Views of `raw`, uint8 (rows, bytes a row) as the blocks lie in a GGUF (a map, or rows gathered from it)."""
        b = raw.view(shape[0], shape[1] // GROUP, 34)
        return cls(kind, shape, True, rows_raw=raw, q=b[..., 2:].view(torch.int8), d=b[..., :2].view(torch.float16))

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """Rows lo..hi dequantized into `out` (hi - lo, blocks, 32), float32: the values converted,
        then scaled (the same products as int8 times float32, measured 1.5x faster than that one op)."""
        out.copy_(self.q[lo:hi])
        out.mul_(self.d[lo:hi].float())


class Q4Blocks(Blocks):
    """Q4_0 (d, 16 bytes of nibbles: w = d * (q - 8)) and Q4_1 (d, m, nibbles: w = d * q + m); value
    j < 16 of a block is the low nibble of byte j, value j + 16 its high nibble."""

    fields = ("qs", "d", "m")  # (rows, blocks, 16) uint8; (rows, blocks, 1) float32 (m: Q4_1's only)

    @classmethod
    def of(cls, qt) -> "Q4Blocks":
        if qt.mapped:
            return cls.over(qt.kind, qt.shape, mapped_tensor(qt.raw))
        with_min = qt.kind == "Q4_1"
        size = 20 if with_min else 18
        b = qt.raw.reshape(qt.shape[0], qt.shape[1] // GROUP, size)
        return cls(qt.kind, qt.shape, qs=torch.from_numpy(np.ascontiguousarray(b[..., size - 16:])), d=_f16(b[..., 0:2]),
                   m=_f16(b[..., 2:4]) if with_min else None)

    @classmethod
    def over(cls, kind: str, shape, raw: torch.Tensor) -> "Q4Blocks":
        """As Q8Blocks.over: views of a GGUF's interleaved (d[, m], nibbles) blocks."""
        with_min = kind == "Q4_1"
        size = 20 if with_min else 18
        b = raw.view(shape[0], shape[1] // GROUP, size)
        return cls(kind, shape, True, rows_raw=raw, qs=b[..., size - 16:], d=b[..., 0:2].view(torch.float16),
                   m=b[..., 2:4].view(torch.float16) if with_min else None)

    def nibbles(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """(rows, blocks, 32) uint8: each block's 32 values, 0..15."""
        qs = self.qs[lo:hi]
        return torch.cat([qs & 15, qs >> 4], dim=-1)

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        qs = self.qs[lo:hi]
        if not qs.is_contiguous():  # mapped: the nibbles lie between their blocks' scales; gathered once (2x faster)
            qs = _buffer("strided", qs.numel(), torch.uint8).view(qs.shape).copy_(qs)
        nibble = _nibble_buffer(qs.shape)
        torch.bitwise_and(qs, 15, out=nibble)
        out[..., :16].copy_(nibble)
        torch.bitwise_right_shift(qs, 4, out=nibble)
        out[..., 16:].copy_(nibble)
        if self.m is None:  # in gguf's order: (q - 8) first, then the scale
            out.sub_(8).mul_(self.d[lo:hi].float())
        else:
            out.mul_(self.d[lo:hi].float()).add_(self.m[lo:hi].float())


class RawBlocks(Blocks):
    """A K-quant (Q4_K, Q5_K, Q6_K): its bytes as they lie in the file, dequantized by gguf's reference."""

    fields = ("raw",)  # (rows, bytes a row) uint8

    @classmethod
    def of(cls, qt) -> "RawBlocks":
        if qt.mapped:
            return cls.over(qt.kind, qt.shape, mapped_tensor(qt.raw))
        return cls(qt.kind, qt.shape, raw=torch.from_numpy(np.ascontiguousarray(qt.raw)))

    @classmethod
    def over(cls, kind: str, shape, raw: torch.Tensor) -> "RawBlocks":
        return cls(kind, shape, True, rows_raw=raw, raw=raw)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def into(self, out: torch.Tensor, lo: int, hi: int) -> None:
        import gguf

        values = gguf.quants.dequantize(self.raw[lo:hi].numpy(), gguf.GGMLQuantizationType[self.kind])
        out.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(out.shape))


def mapped_tensor(a: np.ndarray) -> torch.Tensor:
    """A read-only numpy view of a map as a torch tensor of the same memory (torch warns that it
    could be written: nothing writes a weight)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _extent(t: torch.Tensor) -> int:
    """The bytes a (possibly strided) field spans: a view's own elements, not its base's."""
    return t.numel() * t.element_size()


def _f16(a: np.ndarray) -> torch.Tensor:
    """A block field of 2 bytes, the float16 scale it is, as float32 (exactly): a float32 buffer
    times float16 scales takes torch's mixed-dtype path, measured 200x slower than float32 times
    float32 (2.4 million values: 32 ms against 0.14)."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.float16).astype(np.float32))


def blocks_of(qt) -> Blocks:
    """A QuantTensor (runtime.models.gguf.tensors) as the torch blocks of its kind; its bytes can
    then be dropped (the blocks are a copy in their own layout, of the same size), unless it is
    mapped (the blocks are views of the same map)."""
    if isinstance(qt, Blocks):
        return qt
    if qt.kind == "Q8_0":
        return Q8Blocks.of(qt)
    if qt.kind in INT4PACK_TYPES:
        return Q4Blocks.of(qt)
    return RawBlocks.of(qt)


# ---- the scratch: one buffer per thread and dtype, reused by every layer's product

_scratch = threading.local()


def _buffer(name: str, numel: int, dtype) -> torch.Tensor:
    bufs = _scratch.__dict__.setdefault(name, {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor, written in place inside inference mode and out
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _nibble_buffer(shape) -> torch.Tensor:
    return _buffer("nibbles", int(np.prod(shape)), torch.uint8).view(shape)


def chunk_rows(cols: int, dtype) -> int:
    return max(1, SCRATCH_BYTES // (cols * dtype.itemsize))


def dequantized(blocks, lo: int, hi: int, cols: int, dtype) -> torch.Tensor:
    """Rows lo..hi of the weight as a (hi - lo, cols) tensor of the scratch (valid until its next
    use). A 16-bit dtype's values are dequantized in float32 and rounded once, as the dense load
    rounds them: the product is then the dense model's, bit for bit."""
    n = (hi - lo) * cols
    out = _buffer("weights", n, torch.float32)
    blocks.into(blocks.values(out.view(hi - lo, cols)), lo, hi)
    if dtype != torch.float32:
        out = _buffer("rounded", n, dtype).copy_(out)
    return out.view(hi - lo, cols)


def dense_copy(blocks, rows: int, cols: int, dtype) -> torch.Tensor:
    """The whole weight as a dense (rows, cols) tensor of `dtype`, filled a chunk of rows at a time
    through the scratch (never a float32 copy of the whole): the values a dense load gives."""
    out = torch.empty(rows, cols, dtype=dtype)
    step = chunk_rows(cols, torch.float32)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        out[lo:hi] = dequantized(blocks, lo, hi, cols, dtype)
    return out


def scratch_product(x: torch.Tensor, blocks, rows: int, cols: int, linear=F.linear) -> torch.Tensor:
    """x (M, cols) @ W^T for W (rows, cols) in `blocks`, dequantized a chunk of rows at a time;
    `linear(x, chunk)` multiplies each (a tune's float32 CPU base: gemm.frozen_product)."""
    step = chunk_rows(cols, x.dtype)
    if rows <= step:
        return linear(x, dequantized(blocks, 0, rows, cols, x.dtype))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        out[:, lo:hi] = linear(x, dequantized(blocks, lo, hi, cols, x.dtype))
    return out


# Rows packed at a time: the kernel takes int32 values (8 times their packed bytes), so a whole 7B
# gate/up pair would pass through 360 MB of them. Its rows pack in tiles of 64 (the last may be
# any multiple of 16, as for the whole), each alone as in the whole weight.
PACK_ROWS_VALUES = 2**20


def int4pack(blocks: Q4Blocks, rows: int, cols: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales and zeros (blocks, rows, 2)) for _weight_int4pack_mm_for_cpu."""
    packed, step = None, max(64, PACK_ROWS_VALUES // cols // 64 * 64)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        part = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.nibbles(lo, hi).reshape(hi - lo, cols).to(torch.int32), 1)
        if packed is None:
            packed = torch.empty(rows, *part.shape[1:], dtype=part.dtype)
        packed[lo:hi] = part
    d = blocks.d.float()[..., 0]  # (rows, blocks)
    zero = torch.zeros_like(d) if blocks.m is None else blocks.m.float()[..., 0] + 8 * d
    return packed, torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


def random_tensor(kind: str, rows: int, cols: int, seed: int = 0):
    """A QuantTensor of random blocks with small positive scales (what the measurement multiplies)."""
    from runtime.models.gguf.tensors import QuantTensor

    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, cols // GROUP, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    raw[..., 0:2] = scale
    if kind == "Q4_1":
        raw[..., 2:4] = scale
    return QuantTensor(kind, (rows, cols), raw.reshape(rows, -1))
