"""Linears and embeddings whose GGUF weights stay quantized in memory (inference on a CPU).

A quantized GGUF's 2-D weights (runtime.models.gguf.tensors.QuantTensor) are laid out once for
one of two kernels, chosen per type and shape:

- "int4pack" (Q4_0, Q4_1): torch's `_weight_int4pack_mm_for_cpu` over the weight packed by
  `_convert_weight_to_int4pack_for_cpu`, group size 32, one (scale, zero) a block: that kernel
  reads a weight as (q - 8) * scale + zero, so Q4_0's d * (q - 8) is zero 0 and Q4_1's d * q + m
  is zero m + 8 d. It runs where the input is bfloat16 (float32 inputs take a scalar path,
  measured 10-30x slower than the alternative below).
- "scratch" (every type): the weight kept in its blocks (int8 or nibbles and their scales, or the
  raw K-quant bytes) and dequantized, a chunk of rows at a time, into one reused buffer of the
  compute dtype just before its product (F.linear). No full float copy of a layer exists at any
  time. Q8_0 has no torch kernel: `_weight_int8pack_mm` takes one scale per row, and Q8_0 has one
  per 32 values; that product taken block by block (18 calls at 576 inputs) measured 2-4x slower
  than dequantizing into the scratch. The K-quants are dequantized by gguf's own reference.

Where both kernels apply, the choice is measured once per machine, torch version, thread count,
type, shape and dtype at a decode step's rows (DECODE_ROWS), and kept in the rates cache as
small_gemm's choice is (runtime.engines.hardware.cached_measurement); `SPILLPACK_QUANT_GEMM`
= int4pack | scratch | dense | quantized chooses instead (dense: the whole model dequantized at
load; quantized: kept in blocks, each shape on its measured kernel).

Unset, a file stays in its blocks where its layers multiply on int4pack in bfloat16 (fast_kernel:
about as fast as the dense copy), or where its dense copy would take over half the job's memory;
else it is dequantized at load, which runs faster on the scratch's types (float32 SmolLM2 Q4_1, 32
rows, one thread: 18.3 against 11.7 CPU seconds). The head's weight (its own, or the embedding it is
tied to) is dequantized where the weights still fit half the job's memory (dense_head): the logits'
product runs over the whole vocabulary at every step; else a tied head multiplies on the scratch
over the same blocks the embedding's lookups read, so the embedding is held once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.torch.models.quant_blocks import (GROUP, INT4PACK_TYPES, blocks_of, dequantized, int4pack,
                                                       random_tensor, scratch_product)
from runtime.engines.torch.models.quant_grad import QuantProduct, needs_grad

KERNELS = ("int4pack", "scratch", "dense", "quantized")
INT4PACK_ROWS = 16  # the int4pack layout packs output rows 16 at a time: other row counts take the scratch
DECODE_ROWS = 8  # the rows the kernels are measured at: a decode step's, which dominates a run
MEASURE_MAX_ROWS = 4096  # a larger weight is measured on this many of its rows (both kernels scale with rows)
ENV = "SPILLPACK_QUANT_GEMM"


# ---- the modules


class QuantLinear(nn.Module):
    """An inference linear over a quantized weight (no gradient reaches it). `weight` is a meta
    tensor of the weight's shape and dtype: what it would be dense, for code that asks; any use
    of it as numbers fails loudly. The bias, if any, is dense. `chunk_linear`: what multiplies each
    chunk of the scratch, `grad_linear` where a gradient flows back (a tune's layout may set them:
    layout.cpu_training_layout)."""

    chunk_linear = grad_linear = staticmethod(F.linear)

    def __init__(self, qt, bias: torch.Tensor | None, dtype, kernel: str | None = None):
        """`qt`: a QuantTensor, or its Blocks."""
        super().__init__()
        self.out_features, self.in_features = qt.shape
        self.kind, self.dtype = qt.kind, dtype
        self.weight = torch.empty(qt.shape, dtype=dtype, device="meta")  # a plain attribute, not a parameter
        self.bias = None if bias is None else bias.to(dtype)
        self.kernel = kernel or choose_kernel(qt.kind, *qt.shape, dtype)
        blocks = blocks_of(qt)
        if self.kernel == "int4pack":
            self.packed, self.scales_zeros = int4pack(blocks, *qt.shape, dtype)
            self.blocks = None
        else:
            self.blocks = blocks

    def nbytes(self) -> int:
        """The bytes this linear holds (its layout and its bias)."""
        held = self.blocks.nbytes() if self.blocks is not None else self.packed.nbytes + self.scales_zeros.nbytes
        return held + (self.bias.nbytes if self.bias is not None else 0)

    def forward(self, x):
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        y = QuantProduct.apply(flat, self) if needs_grad(flat) else self.product(flat)  # a tune's: quant_grad.py
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, flat, linear=None):
        """flat (M, in) @ W^T on this layer's kernel, no gradient (`linear`: the scratch's chunks' instead of chunk_linear)."""
        if self.kernel == "int4pack":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, GROUP, self.scales_zeros)
        return scratch_product(flat, self.blocks, self.out_features, self.in_features, linear or self.chunk_linear)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind} on {self.kernel}"


class HollowLinear(nn.Module):
    """A linear whose weight lives in its group's joined QuantLinear (layout.joined_outputs runs
    the group as one product); called alone it fails loudly."""

    def __init__(self, shape, dtype, kind: str):
        super().__init__()
        self.out_features, self.in_features = shape
        self.kind = kind
        self.weight = torch.empty(shape, dtype=dtype, device="meta")
        self.bias = None

    def forward(self, x):
        raise RuntimeError("a quantized linear joined with its group runs only through joined_outputs")


class QuantEmbedding(nn.Module):
    """An embedding over a quantized table: a lookup dequantizes the rows it gathers; `head`
    multiplies by the whole table (a tied head) on the scratch kernel over the same blocks."""

    chunk_linear = grad_linear = staticmethod(F.linear)

    def __init__(self, qt, dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qt.shape
        self.kind, self.dtype = qt.kind, dtype
        self.weight = torch.empty(qt.shape, dtype=dtype, device="meta")
        self.blocks = blocks_of(qt)

    def nbytes(self) -> int:
        return self.blocks.nbytes()

    def forward(self, ids):
        flat = ids.reshape(-1)
        out = dequantized(self.blocks.rows(flat), 0, flat.numel(), self.embedding_dim, self.dtype)
        return out.to(self.dtype, copy=True).view(*ids.shape, self.embedding_dim)  # its own memory, not the scratch's

    def head(self, hidden):
        flat = hidden.reshape(-1, self.embedding_dim).to(self.dtype)
        out = QuantProduct.apply(flat, self) if needs_grad(flat) else self.product(flat)  # a tune's: quant_grad.py
        return out.view(*hidden.shape[:-1], self.num_embeddings)

    def product(self, flat, linear=None):
        return scratch_product(flat, self.blocks, self.num_embeddings, self.embedding_dim, linear or self.chunk_linear)


# ---- the kernel choice


def forced_kernel() -> str | None:
    from runtime.engines.torch.models.small_gemm import forced_kernel as forced

    return forced(ENV, KERNELS)


def keeps_quantized(dense_bytes: int, memory_bytes: float, fast: str | None = None) -> tuple[bool, str]:
    """Whether a quantized GGUF whose dense copy takes `dense_bytes` is loaded in its blocks, for a
    job that may use `memory_bytes`, and why (the module's doc). `fast`: the kernel every layer
    multiplies on where that kernel runs about as fast as the dense copy (fast_kernel), else None."""
    if (forced := forced_kernel()) is not None:
        return forced != "dense", f"{'dequantized at load' if forced == 'dense' else 'kept quantized'} ({ENV}={forced})"
    if fast is not None:
        return True, f"kept quantized: its layers multiply on {fast}, about as fast as a dense copy ({ENV}=dense dequantizes it)"
    if dense_bytes > memory_bytes / 2:
        return True, (f"kept quantized: dequantized it would take {dense_bytes / 2**30:.2f} GB, more than half the "
                      f"{memory_bytes / 2**30:.1f} GB this job may use")
    return False, (f"dequantized at load, where it runs faster: {dense_bytes / 2**30:.2f} GB, within half the "
                   f"{memory_bytes / 2**30:.1f} GB this job may use ({ENV}=quantized keeps it quantized)")


def not_on_blocks(kinds, floats, dtype) -> str:
    """What of a file kept quantized does not multiply on a quantized kernel, for the start event's
    why ("" where nothing): its float weights (`floats`: type -> count), held dense in `dtype`, and
    with SPILLPACK_QUANT_GEMM=int4pack the quantized `kinds` that kernel does not take, dequantized
    a chunk of rows at a time into the scratch."""
    notes = []
    other = sorted(set(kinds) - set(INT4PACK_TYPES))
    if forced_kernel() == "int4pack" and other:
        notes.append(f"{', '.join(other)} {'have' if len(other) > 1 else 'has'} no int4pack kernel: dequantized a chunk "
                     f"of rows at a time into the scratch")
    if floats:
        notes.append(f"the {', '.join(sorted(floats))} weights dense in {str(dtype).removeprefix('torch.')} (a float type "
                     f"has no blocks)")
    return "".join(f"; {n}" for n in notes)


def fast_kernel(kinds, rows: int, cols: int, dtype) -> str | None:
    """"<types> on int4pack" where every quantized layer (`kinds`, the head aside) is Q4_0/Q4_1 and
    the int4pack kernel is the one measured faster here for a (rows, cols) layer of the model: in
    bfloat16 a decode step then runs about as fast as on the dense copy (SmolLM2 Q4_1, 32 rows,
    one thread: 12.6-13.7 against 11.3-12.9 CPU seconds; 128 rows 1.2x), in under half its memory.
    Else None: the scratch's dequantization costs each product more (float32: 1.6x)."""
    kinds = sorted(kinds)
    if not kinds or not set(kinds) <= set(INT4PACK_TYPES) or dtype != torch.bfloat16:
        return None
    if any(choose_kernel(kind, rows, cols, dtype) != "int4pack" for kind in kinds):
        return None
    return f"{'/'.join(kinds)} on int4pack in bfloat16"


def dense_head(resident_bytes: int, memory_bytes: float) -> tuple[bool, str]:
    """Whether a quantized load holds the head's weight dense (quant_layout.quantized_modules), given
    the weights' `resident_bytes` so, and why: where they still fit half the job's memory."""
    if resident_bytes <= memory_bytes / 2:
        return True, f"the head dequantized, as it multiplies every row of the vocabulary at every step ({resident_bytes / 2**30:.2f} GB in all)"
    return False, (f"the head kept quantized too: with it dequantized the weights would take {resident_bytes / 2**30:.2f} GB, "
                   f"more than half the {memory_bytes / 2**30:.1f} GB this job may use")


@functools.cache
def int4pack_available() -> bool:
    try:
        q = torch.zeros(INT4PACK_ROWS, GROUP * 2, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.ones(2, INT4PACK_ROWS, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, GROUP * 2, dtype=torch.bfloat16), packed, GROUP, sz)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def measure(kind: str, rows: int, cols: int, dtype) -> dict:
    """Seconds of one product at DECODE_ROWS rows on each kernel, the best of repeats."""
    from runtime.engines.torch.models.small_gemm import best_seconds

    qt = random_tensor(kind, min(rows, MEASURE_MAX_ROWS), cols)
    x = torch.randn(DECODE_ROWS, cols, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = {}
    with torch.inference_mode():
        for kernel in ("int4pack", "scratch"):
            layer = QuantLinear(qt, None, dtype, kernel)
            out[f"{kernel}_s"] = round(best_seconds(lambda: layer(x), repeats=20, warmup=3), 7)
    return out


def _measured(kind: str, rows: int, cols: int, dtype) -> dict:
    from runtime.engines.hardware import cached_measurement

    name = str(dtype).removeprefix("torch.")
    # "2": the scratch's scales held as float32 (a figure cached over float16 scales is measured again)
    return cached_measurement("torch-cpu", f"quant gemm 2, {kind} {min(rows, MEASURE_MAX_ROWS)}x{cols} {name}, "
                                           f"{torch.get_num_threads()} threads", lambda: measure(kind, rows, cols, dtype))


def choose_kernel(kind: str, rows: int, cols: int, dtype) -> str:
    """The kernel a quantized weight of this type and shape multiplies on here (see the module's doc)."""
    if kind not in INT4PACK_TYPES or rows % INT4PACK_ROWS or not int4pack_available():
        return "scratch"
    forced = forced_kernel()
    if forced in ("int4pack", "scratch"):
        return forced
    m = _measured(kind, rows, cols, dtype)
    return "int4pack" if m["int4pack_s"] <= m["scratch_s"] else "scratch"


def describe(dtype) -> str:
    """doctor's line: the kernels quantized GGUF weights multiply on here, and why (`dtype`: a torch dtype or its name)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    forced = forced_kernel()
    if forced and forced != "quantized":
        return f"{forced} ({ENV})"
    name = str(dtype).removeprefix("torch.")
    if not int4pack_available():
        return f"scratch for every type ({name}): this torch has no int4pack kernel for the CPU"
    m = _measured("Q4_1", 3072, 576, dtype)
    pick = "int4pack" if m["int4pack_s"] <= m["scratch_s"] else "scratch"
    return (f"Q4_0/Q4_1 in {name} on {pick}: a {DECODE_ROWS}-row product by a 3072 x 576 weight took int4pack "
            f"{m['int4pack_s'] * 1e6:.0f} us, dequantized into the scratch {m['scratch_s'] * 1e6:.0f} us (measured "
            f"per shape at load, the faster kept); Q8_0 and the K-quants dequantized into the scratch (no torch kernel "
            f"takes a scale per 32 values)")
