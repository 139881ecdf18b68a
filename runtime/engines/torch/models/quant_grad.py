"""A quantized weight's product where a gradient flows back to its input: a tune's frozen base
kept in its blocks (QLoRA's shape: the base quantized, the LoRA tensors and AdamW's moments in
float32).

The scratch (quant_blocks.py) is one reused buffer, so autograd must not keep it: the next
product overwrites it. `QuantProduct` has gemm._FrozenLinear's shape (forward the frozen
product, backward the input's gradient alone, no weight gradient) and keeps no tensor at all:
backward dequantizes the weight again, a chunk of rows at a time, and sums each chunk's
g[:, lo:hi] W[lo:hi] in gemm.input_grad, which _FrozenLinear's dense backward sums in the same
order. The values dequantized are the dense load's, bit for bit, and a float32 CPU tune's chunks
multiply on the kernel its dense linear would (layout.cpu_training_layout), so the gradient is
the dequantized base's, bit for bit.
"""

from __future__ import annotations

import torch

from runtime.engines.torch.models.gemm import input_grad
from runtime.engines.torch.models.quant_blocks import dequantized


class QuantProduct(torch.autograd.Function):
    """x (M, cols) @ W^T for `layer`'s frozen quantized W (rows, cols), through `layer.product`
    (its no-gradient kernel); the input's gradient from its `blocks` (gemm.input_grad)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer  # its blocks, read again in backward: nothing of the forward is kept
        with torch.no_grad():
            return layer.product(x, layer.grad_linear)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        rows, cols = layer.weight.shape
        assert layer.blocks is not None, "a quantized linear on the int4pack kernel has no blocks to take a gradient through"
        return input_grad(grad, lambda lo, hi: dequantized(layer.blocks, lo, hi, cols, grad.dtype), rows, cols), None


def needs_grad(x: torch.Tensor) -> bool:
    """Whether a product of `x` must carry a gradient back to it (a tune's forward)."""
    return torch.is_grad_enabled() and x.requires_grad
