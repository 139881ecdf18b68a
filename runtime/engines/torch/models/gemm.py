"""The GEMM kernels a float32 CPU base's linears run on, beside torch's default (MKL's sgemm):
oneDNN's, with a weight packed once for inference (PackedLinear) or read dense for a tune's frozen
base (FrozenLinear), a tied head's product taken by rows (`head`), and numpy's BLAS (OpenBLAS in
numpy's wheels) for the small products of inference where it is measured faster (BlasLinear,
a decode step's attention products in attention.decode_products; runtime/engines/torch/models/small_gemm.py).

On a 2-core AMD EPYC (AVX2), MKL runs a few rows on one thread and at 35-45 GFLOP/s where oneDNN
reaches 60-100 at two threads (decode shapes), and a tune's forward shapes at 99-121 GFLOP/s
where oneDNN reaches 152-158; the figures are with each use below.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_linear() -> bool:
    """Whether this torch runs linears on oneDNN with packed weights (x86 builds do; elsewhere
    every linear stays on torch's default GEMM)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), 8)
        got = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool(torch.equal(got, torch.full((2, 8), 8.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight in oneDNN's blocked layout for `gemm`. The batch size given is a hint
    for the blocking: a packed weight serves every row count, each row computed as it would be
    alone; 8 is a decode step's."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)


def gemm(x, weight, bias=None):
    """x @ weight^T + bias, for a dense weight, one `pack`ed, a numpy (in, out) array (`blas_linear`),
    or a module that multiplies by its own weight (a joined quantized group, quant_linear.QuantLinear)."""
    if isinstance(weight, nn.Module):
        return weight(x) if bias is None else weight(x) + bias
    if isinstance(weight, np.ndarray):
        return blas_linear(x, weight, bias)
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def blas_linear(x, weight_t: np.ndarray, bias=None):
    """x @ weight_t + bias on numpy's BLAS, for inference (no gradient): weight_t the (in, out)
    numpy view of a weight stored transposed (layout.cpu_inference_layout), x a float32 CPU tensor.
    Where a gradient would flow through x (a caller outside the engine's no-grad inference), the
    same product on torch's F.linear, so autograd sees it."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, torch.from_numpy(weight_t).t(), bias)
    a = x.numpy()  # the shapes handled in numpy: a reshape there costs a tenth of torch's
    out = torch.from_numpy((a.reshape(-1, a.shape[-1]) @ weight_t).reshape(*a.shape[:-1], weight_t.shape[1]))
    if bias is not None:
        out += bias
    return out


def product(x: np.ndarray, weight, bias=None) -> np.ndarray:
    """`gemm` for a float32 numpy (rows, in) array outside autograd (numpy_step.NumpyStep): on
    numpy's BLAS for a numpy (in, out) weight, else the same torch kernel over the same memory."""
    if isinstance(weight, np.ndarray):
        out = x @ weight
        if bias is not None:
            out += bias.detach().numpy()
        return out
    return gemm(torch.from_numpy(x), weight, bias).numpy()


class BlasLinear(nn.Linear):
    """A small nn.Linear of inference multiplied on numpy's BLAS (layout.cpu_inference_layout, where
    small_gemm.blas_is_faster): `weight_t` is the (in, out) numpy view of its transposed weight."""

    def forward(self, x):
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)  # a gradient for the weight (a caller outside inference)
        return blas_linear(x, self.weight_t, self.bias)


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight lies packed for oneDNN (`packed`, made by
    layout.cpu_inference_layout); `weight` keeps its shape and dtype on the meta device."""

    def forward(self, x):
        return gemm(x, self.packed, self.bias)


def frozen_product(x, weight, bias=None):
    """x W^T + b on oneDNN, reading a dense W as it lies (a tune's frozen linear, or a chunk of a
    quantized one's rows: oneDNN's output columns come out the same, bit for bit, in chunks)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def input_grad(grad, rows_of, rows: int, cols: int):
    """grad (..., rows) @ W (rows, cols) for a frozen W, on MKL, a chunk of rows at a time:
    `rows_of(lo, hi)` gives W[lo:hi] (a dense weight's slice, or a quantized weight's rows
    dequantized into the scratch: quant_grad.py). One sum order for both, so a tune on a quantized
    base takes the dequantized dense base's gradient bit for bit; a weight of one chunk's rows is
    one product."""
    from runtime.engines.torch.models.quant_blocks import chunk_rows

    flat = grad.reshape(-1, rows)
    step = chunk_rows(cols, grad.dtype)
    out = None
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        part = flat if hi - lo == rows else flat[:, lo:hi]
        out = torch.mm(part, rows_of(lo, hi)) if out is None else out.addmm_(part, rows_of(lo, hi))
    return out.view(*grad.shape[:-1], cols)


class _FrozenLinear(torch.autograd.Function):
    """x W^T + b for a W and b no gradient reaches: forward on oneDNN reading W as it lies, the
    input's gradient g W on MKL (input_grad). Only W is kept for backward (no weight gradient needs x)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return frozen_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return input_grad(grad, lambda lo, hi: weight[lo:hi], *weight.shape), None, None


class FrozenLinear(nn.Linear):
    """A tune's frozen linear on a float32 CPU base (layout.cpu_training_layout). Qwen2.5-0.5B's
    shapes, 692 tokens, 2 threads of the AMD EPYC above, forward: q/k/v 13.1 -> 9.1 ms, gate
    110 -> 76, down 49.7 -> 39.5; oneDNN's input gradient read from the same dense weight was
    slower than MKL's (95 -> 135 ms at gate), and a packed transpose would be a second copy."""

    def forward(self, x):
        if self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _FrozenLinear.apply(x, self.weight, self.bias)


def head(hidden, weight, kernel: str = "linear"):
    """hidden @ weight^T for a tied head of (vocab, hidden) weights, by `kernel` (Model.head_kernel,
    set by the layouts of runtime/engines/torch/models/layout.py for a large vocabulary):
    - "linear": F.linear;
    - "by_rows" (inference): as weight @ hidden^T, the embedding read as it lies and MKL splitting
      the vocabulary across threads, where hidden @ weight^T runs a decode step's few rows on one
      thread (SmolLM2-135M, 8 rows, 2 threads: 27.0 -> 11.2 ms; one thread 28.5 -> 21.5). Packing
      the head would need a second copy of the embedding for its lookups;
    - "blas" (inference, a small vocabulary): numpy's BLAS over the embedding stored transposed;
    - "frozen" (a tune): _FrozenLinear, the forward on oneDNN (Qwen2.5-0.5B's 151,936-token head at
      296 positions, 2 threads: 1047 -> 548 ms, no copy of the weight made)."""
    if kernel == "by_rows":
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(weight, flat.t()).t().contiguous().view(*hidden.shape[:-1], weight.shape[0])
    if kernel == "frozen" and not weight.requires_grad:
        return _FrozenLinear.apply(hidden, weight, None)
    if kernel == "blas" and not (torch.is_grad_enabled() and weight.requires_grad):  # a small tied head on numpy's BLAS (inference), the embedding stored transposed
        return blas_linear(hidden, weight.detach().t().numpy())
    return F.linear(hidden, weight)
