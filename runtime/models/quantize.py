"""--quantize: a Hugging Face directory's float weights quantized at load, weights only, into the
blocks a GGUF holds (group 32) by gguf's reference quantizers (llama.cpp's): int8 as Q8_0 (a
float16 scale a block), int4 as Q4_1 (a scale and a minimum a block; Q4_0's zero-centred
blocks lose more on weights that are not). The torch engine then keeps them as it keeps a
quantized GGUF's (runtime/engines/torch/models/quant_linear.py). Framework-neutral: numpy and gguf.
"""

from __future__ import annotations

import numpy as np

from runtime.base.errors import SpillpackError, UsageError

TYPES = {"int8": "Q8_0", "int4": "Q4_1"}  # --quantize -> the block type
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}  # a block of 32 values
GROUP = 32


def block_type(value: str | None, engine: str) -> str | None:
    """The block type --quantize asks for on `engine`, or None; refused off torch-cpu."""
    if value is None:
        return None
    if value not in TYPES:
        raise UsageError(f"--quantize takes {' or '.join(TYPES)}, not {value!r}", "spillpack run --help")
    if engine != "torch-cpu":
        raise SpillpackError(f"--quantize {value} keeps weights in quantized blocks on torch-cpu only; the {engine} engine "
                             f"loads the float weights", "the same command with --engine torch-cpu, or without --quantize")
    return TYPES[value]


def refuse_gguf(value: str, model: str) -> None:
    raise UsageError(f"--quantize {value} quantizes a Hugging Face directory's float weights, and {model} is a GGUF, "
                     f"quantized already", "the same command without --quantize")


def quantizable(name: str, shape: tuple) -> bool:
    """A weight --quantize turns into blocks: a 2-D `.weight` whose rows are whole blocks (the
    linears and the embedding; norms and biases stay float)."""
    return name.endswith(".weight") and len(shape) == 2 and shape[1] % GROUP == 0


def as_float32(array: np.ndarray, kind: str) -> np.ndarray:
    """A safetensors tensor as float32 (`kind`: its dtype; BF16 comes as its uint16 bits)."""
    if kind == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32, copy=False)


def quantized(array: np.ndarray, kind: str, block: str):
    """A float tensor as a QuantTensor of `block` blocks (runtime.models.gguf.tensors)."""
    import gguf

    from runtime.models.gguf.tensors import QuantTensor

    raw = gguf.quants.quantize(np.ascontiguousarray(as_float32(array, kind)), gguf.GGMLQuantizationType[block])
    return QuantTensor(block, tuple(array.shape), raw.reshape(array.shape[0], -1))


def resident_bytes(shapes: dict, block: str, float_bytes: int) -> tuple[int, int]:
    """(bytes the weights of `shapes` (name -> shape) hold quantized to `block`, the rest at
    `float_bytes`; how many are quantized)."""
    total = count = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) if shape else 1
        if quantizable(name, shape):
            total += n // GROUP * BLOCK_BYTES[block]
            count += 1
        else:
            total += n * float_bytes
    return total, count
