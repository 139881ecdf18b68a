"""The torch engine's models: each architecture's module (named by runtime.models.arch) and
strict loading of a Hugging Face safetensors checkpoint into it."""

from __future__ import annotations

import importlib

from contextvars import ContextVar
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.base.heap import trim_heap
from runtime.engines.torch.models.layout import cpu_inference_layout, join_linears
from runtime.models.arch import architecture
from runtime.models.quantize import quantizable, quantized as quantize_array
from runtime.models.weights import check_weights, read_tensors, tensor_shapes, weight_files

if TYPE_CHECKING:
    from runtime.models.ref import ModelDir

# Which of the micro-batch's flattened (B*T) tokens the current call sees, where a module runs
# on some of them (a MoE expert on the tokens routed to it): LoRA dropout keys its masks by token.
routed_tokens: ContextVar = ContextVar("routed_tokens", default=None)


def model_file(arch):
    """This engine's module for an architecture: the file named by runtime.models.arch's table."""
    assert "torch" in arch.frameworks, (arch.model_type, "torch")
    return importlib.import_module(f"{__name__}.{arch.module}")


def converted_tensors(files, dtype, device, rows=None, quantized: bool = False):
    """(name, tensor) in `dtype` on `device`, one at a time (read_tensors' `rows`: part of each).
    With `quantized`, a GGUF's quantized weights (runtime.models.gguf.tensors.QuantTensor) stay in
    their blocks, as torch tensors (quant_linear.blocks_of), each made before the next is read; a
    block type (runtime.models.quantize) quantizes a directory's float weights into it so."""
    for name, kind, array in read_tensors(files, rows, bool(quantized)):
        if isinstance(quantized, str) and isinstance(array, np.ndarray) and quantizable(name, array.shape):
            array = quantize_array(array, kind, quantized)  # --quantize: a float weight into blocks of this type
        if not isinstance(array, np.ndarray):  # a QuantTensor
            from runtime.engines.torch.models.quant_blocks import blocks_of

            blocks = blocks_of(array)
            if not array.mapped:  # the readers' frames hold it until their next tensor: its bytes are the blocks' now
                array.raw = None
            yield name, blocks
            continue
        t = torch.from_numpy(array)
        if kind == "BF16":
            t = t.view(torch.bfloat16)
        yield name, t.to(device=device, dtype=dtype)


def load_weights(files, dtype, device) -> dict:
    """Tensor by tensor: each is converted (and moved) before the next is read, so the host
    never holds the file's copy beside the converted one."""
    return dict(converted_tensors(files, dtype, device))


def load_checkpoint(model_dir: "ModelDir", dtype=torch.float32, device="cpu") -> dict:
    """The checkpoint's tensors under the model's names (its quirks sanitized), unchecked."""
    arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
    return arch.sanitize(arch.args.from_dict(model_dir.config), load_weights(weight_files(model_dir.path), dtype, device))


def load_model(model_dir: "ModelDir", dtype=torch.float32, device="cpu", cpu_inference: bool = False,
               quantized: bool = False, dense_head: bool = False, tune: bool = False, streamed: bool = False):
    """Build the architecture named by config.json and load its weights strictly; `cpu_inference`:
    the weights laid out for a float32 CPU base's generation and evaluation (layout.cpu_inference_layout),
    which no gradient may reach; `quantized` (inference on a CPU): a GGUF's quantized weights kept
    in their blocks (quant_linear.py), never dequantized whole (but the head's weight, with
    `dense_head`); with `tune`, laid out for a tune's frozen base (quant_layout.quantized_modules);
    `streamed` (on a CPU; a tune's with `tune`): every 2-D weight a view of its file's map (streamed.py), no
    layout that would copy it."""
    arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
    args = arch.args.from_dict(model_dir.config)
    # Build on the meta device: no time or memory spent on a random init that is overwritten.
    with torch.device("meta"):
        model = model_file(arch).Model(args)
    files = weight_files(model_dir.path)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    maps: set = set()
    if streamed:
        from runtime.engines.torch.models.streamed import streamed_tensors

        weights = arch.sanitize(args, dict(streamed_tensors(files, dtype, maps)))
        check_weights(expected, {k: tuple(v.shape) for k, v in weights.items()}, files, model_dir)
        quantized, cpu_inference = True, False  # its Blocks become quantized modules; a layout would copy the map
        weights = weights.items()
    elif quantized:  # checked on the headers, then laid out as it is read (quant_layout.quantized_modules)
        shapes = tensor_shapes(files)
        named = arch.sanitize(args, {k: k for k in shapes})  # the model's name -> the file's
        check_weights(expected, {k: shapes[v] for k, v in named.items()}, files, model_dir)
        ours = {v: k for k, v in named.items()}
        weights = ((ours[k], t) for k, t in converted_tensors(files, dtype, device, quantized=quantized) if k in ours)
    else:
        weights = arch.sanitize(args, load_weights(files, dtype, device))
        check_weights(expected, {k: tuple(v.shape) for k, v in weights.items()}, files, model_dir)
    if quantized:
        from runtime.engines.torch.models.quant_layout import head_key, quantized_modules

        weights = quantized_modules(model, weights, dtype, head_key(expected), dense_head, tune)
    model.load_state_dict(weights, strict=True, assign=True)
    del weights
    if cpu_inference:
        cpu_inference_layout(model)
    if streamed:
        from runtime.engines.torch.models.streamed import mark_streamed

        mark_streamed(model, maps)
    join_linears(model)
    trim_heap()
    return model.eval()
