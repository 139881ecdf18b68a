"""A quantized weight's product where a gradient flows back to its input: a tune's frozen base
kept in its blocks (QLoRA's shape: the base quantized, the LoRA tensors and AdamW's moments in
float32).

The scratch (quant_blocks.py) is one reused buffer, so autograd must not keep it: the next
product overwrites it. `QuantProduct` has gemm._FrozenLinear's shape (forward the frozen
product, backward the input's gradient alone, no weight gradient) and keeps no tensor at all:
backward dequantizes the weight again, a chunk of rows at a time, and sums each chunk's
g[:, lo:hi] W[lo:hi]. The values dequantized are the dense load's, bit for bit, so the gradient
is the dequantized base's, up to the summation order of float arithmetic.
"""

from __future__ import annotations

import torch

from runtime.engines.torch.models.quant_blocks import chunk_rows, dequantized


class QuantProduct(torch.autograd.Function):
    """x (M, cols) @ W^T for `layer`'s frozen quantized W (rows, cols), through `layer.product`
    (its no-gradient kernel); the input's gradient from its `blocks`."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer  # its blocks, read again in backward: nothing of the forward is kept
        with torch.no_grad():
            return layer.product(x)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        return input_grad(grad, layer.blocks, *layer.weight.shape), None


def input_grad(grad: torch.Tensor, blocks, rows: int, cols: int) -> torch.Tensor:
    """grad (M, rows) @ W (rows, cols), W dequantized a chunk of rows at a time into the scratch."""
    assert blocks is not None, "a quantized linear on the int4pack kernel has no blocks to take a gradient through"
    step = chunk_rows(cols, grad.dtype)
    out = None
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        w = dequantized(blocks, lo, hi, cols, grad.dtype)  # (hi - lo, cols)
        if out is None:
            out = torch.mm(grad[:, lo:hi], w)
        else:
            out.addmm_(grad[:, lo:hi], w)
    return out


def needs_grad(x: torch.Tensor) -> bool:
    """Whether a product of `x` must carry a gradient back to it (a tune's forward)."""
    return torch.is_grad_enabled() and x.requires_grad
