"""The torch engine (torch-cpu and torch-cuda): LoRA training and generation.

The base model is frozen; only LoRA tensors and their AdamW moments change. The base's dtype
follows the device and the model's width (runtime/engines/torch/precision.py: bfloat16 on CPUs
that multiply it natively for models from 512 wide, else float32; bfloat16 on CUDA devices with
native bfloat16, float16 with loss scaling on older ones), while LoRA weights,
moments and everything in a checkpoint stay float32, so a checkpoint means the same on every
engine. The device and base dtype are parameters: tests run the CUDA engine's arithmetic
(bfloat16 and float16 bases) on a CPU.
"""

import threading

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.base.errors import SpillpackError
from runtime.models.memory import loss_chunk
from runtime.models.dropout import feature_keys, keep_mask, token_keys
from runtime.models.lora import LoraSpec
from runtime.engines.hardware import TRAIN_MMAP_THRESHOLD, return_freed_memory
from runtime.engines.torch.device import PeakMemory, describe, fit_threads, make_deterministic
from runtime.engines.torch.loss import target_loss
from runtime.engines.torch.models import load_checkpoint, load_model, routed_tokens
from runtime.engines.torch.models.layout import cpu_training_layout
from runtime.engines.torch.placement import WeightPlacement
from runtime.engines.torch.row_threads import RowThreads
from runtime.engines.torch.optim import AdamW
from runtime.engines.torch.decode_dtype import generation_precision
from runtime.engines.torch.precision import LossScaler, device_precision, grads_finite, precision_of
from runtime.engines import OptimSpec


class DropoutKeys(threading.local):
    """The token keys of the micro-batch being computed (runtime.models.dropout), shared by every
    LoRA layer of a model; None outside training. A layer recomputed in backward reads the same.
    Per thread: row threads (row_threads.py) each compute a part of the micro-batch."""

    tokens: torch.Tensor | None = None  # (B, T) int32

    def for_input(self, h: torch.Tensor) -> torch.Tensor:
        """The keys of the tokens `h` (..., width) holds: the micro-batch's, or those routed to an expert."""
        if h.shape[:-1] == self.tokens.shape:
            return self.tokens
        routed = routed_tokens.get()
        assert routed is not None and h.shape[:-1] == routed.shape, f"no token keys for an input of shape {tuple(h.shape)}"
        return self.tokens.reshape(-1)[routed]


class LoRALinear(nn.Module):
    """Wraps a frozen nn.Linear: y = base(x) + scale * (dropout(x) A^T) B^T.

    Dropout's masks are a pure function of each token's key and this module's feature keys
    (runtime.models.dropout), so a recomputed, resumed or re-split step drops the same inputs.
    """

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, scale: float, dropout: float = 0.0,
                 keys: DropoutKeys | None = None, features: torch.Tensor | None = None):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(A)  # (r, in)
        self.lora_B = nn.Parameter(B)  # (out, r)
        self.scale = scale
        self.p, self.keys, self.features = dropout, keys, features  # features: (in,) int32, not a buffer

    def forward(self, x):
        return self.add_update(self.base(x), x)

    def add_update(self, y, x):
        """y, the frozen linear's output for x (computed here or in a joined GEMM), plus the update."""
        h = x.to(self.lora_A.dtype)
        if self.training and self.p > 0 and self.keys is not None and self.keys.tokens is not None:
            h = h * keep_mask(self.keys.for_input(h), self.features, self.p) / (1 - self.p)
        z = F.linear(h, self.lora_A)  # (..., r)
        if y.dtype == z.dtype:
            # y + scale * z B^T as one GEMM that scales and adds as it multiplies: two op calls
            # fewer per LoRA linear, forward and backward.
            out = torch.addmm(y.reshape(-1, y.shape[-1]), z.reshape(-1, z.shape[-1]), self.lora_B.t(), alpha=self.scale)
            return out.view(y.shape)
        return y + (self.scale * F.linear(z, self.lora_B)).to(y.dtype)


def apply_lora(model: nn.Module, tensors: dict[str, np.ndarray], spec: LoraSpec, device, keys: DropoutKeys | None = None) -> dict[str, nn.Parameter]:
    """Wrap each targeted linear; returns the trainable parameters by canonical name."""
    params = {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        A = torch.tensor(tensors[f"{name}.lora_A.weight"], dtype=torch.float32, device=device)
        B = torch.tensor(tensors[f"{name}.lora_B.weight"], dtype=torch.float32, device=device)
        features = torch.from_numpy(feature_keys(name, A.shape[1])).to(device) if keys is not None else None
        wrapped = LoRALinear(base, A, B, spec.scale, spec.dropout, keys, features)
        setattr(parent, child, wrapped)
        params[f"{name}.lora_A.weight"] = wrapped.lora_A
        params[f"{name}.lora_B.weight"] = wrapped.lora_B
    return params


def freeze(model: nn.Module, engine) -> None:
    """The base frozen, and laid out for a tune's GEMMs on a float32 CPU base."""
    for p in model.parameters():
        p.requires_grad_(False)
    if engine.device.type == "cpu" and engine.base_dtype == torch.float32:
        cpu_training_layout(model)


def step_loss(model, ids: torch.Tensor, labels: torch.Tensor, chunk: int, g: float) -> torch.Tensor:
    """The summed loss of (B, T) `ids` at `labels` (-100: no loss), its graph kept where grad is enabled."""
    # Right padding under a causal mask: real tokens never see the pads after them.
    hidden = model.hidden_states(ids)  # (B, T, D)
    keep = labels != -100  # (B, T)
    return target_loss(model, hidden[keep], labels[keep], chunk, g)  # only positions with loss


class TorchTrainSession:
    def __init__(self, engine: "TorchEngine", model_dir, spec: LoraSpec, tensors: dict, opt: OptimSpec, seed: int = 0):
        self.engine, self.spec, self.model_dir, self.seed = engine, spec, model_dir, seed
        if engine.device.type == "cpu":
            return_freed_memory(TRAIN_MMAP_THRESHOLD)  # a step's freed activations reused by the next, not re-faulted
        self.keys = DropoutKeys() if spec.dropout > 0 else None
        self.model, self.params = self._build(model_dir, tensors)
        self.names = sorted(self.params)
        self.optimizer = AdamW([self.params[n] for n in self.names], betas=opt.betas, eps=opt.eps,
                               weight_decay=opt.weight_decay)
        self.scaler = LossScaler() if engine.precision.loss_scaling else None
        self.model.train(spec.dropout > 0)
        self.pad_id = 0
        # Target positions per chunk of the loss: cross_entropy_in_place holds the float32 logits,
        # and on a 16-bit base the head's output and the gradient handed back to it.
        self.loss_chunk = loss_chunk(self.model.args.vocab_size, 4 if engine.base_dtype == torch.float32 else 8)
        # On a CPU a micro-batch's rows are split across the job's threads (row_threads.py).
        self.rows = RowThreads(torch.get_num_threads() if engine.device.type == "cpu" and self.splits_rows else 1)

    splits_rows = True  # a micro-batch's rows may run on several threads at once

    def _build(self, model_dir, tensors: dict):
        """The frozen base with its LoRA wrappers, and the trainable parameters by name: resident (kept
        quantized: QLoRA's shape, quant_grad.py), or streamed from the file's map where the plan says
        (placement.stream_why): its products and its input's gradients read the map."""
        streamed = self.engine.stream_why(model_dir)[0]
        quantized = not streamed and self.engine.keeps_quantized(model_dir) and (self.engine.quantize or True)
        model = load_model(model_dir, dtype=self.engine.base_dtype, device=self.engine.device, quantized=quantized,
                           tune=bool(quantized) or streamed, streamed=streamed)
        freeze(model, self.engine)
        return model, apply_lora(model, tensors, self.spec, self.engine.device, self.keys)

    @property
    def grad_checkpoint(self) -> bool:
        """Per-layer activation checkpointing (the decoder's shared layer loop runs it)."""
        return self.model.model.grad_checkpoint

    @grad_checkpoint.setter
    def grad_checkpoint(self, on: bool) -> None:
        self.model.model.grad_checkpoint = bool(on)

    def forward_backward(self, micro_batches, total_targets: int, step: int = 0) -> tuple[float, int]:
        """Accumulate gradients for one optimizer step. Abandonable: it only touches .grad (and,
        under loss scaling, the scale this step will settle with)."""
        if self.scaler is None:
            return self._accumulate(micro_batches, total_targets, step, 1.0)
        scale = self.scaler.scale
        while True:
            result = self._accumulate(micro_batches, total_targets, step, scale)
            if grads_finite(self.params.values()):
                for p in self.params.values():
                    if p.grad is not None:
                        p.grad.div_(scale)  # a power of two: exact
                self.scaler.pending = scale
                return result
            self.optimizer.zero_grad()
            scale /= 2
            if scale < LossScaler.MIN:
                raise SpillpackError(f"the LoRA gradients of step {step + 1} are not finite even without loss scaling "
                                     f"on a {self.engine.precision.name} base",
                                     "spillpack doctor, then the same command with --engine torch-cpu (a float32 base)")

    def _accumulate(self, micro_batches, total_targets: int, step: int, scale: float) -> tuple[float, int]:
        loss_sum, tokens, row = 0.0, 0, 0
        g = scale / total_targets
        for ids, labels, *rows in micro_batches:
            rows = rows[0] if rows else np.arange(row, row + len(ids))  # the rows' places in the step
            row += len(ids)
            parts = self.rows.parts(len(ids))
            if len(parts) == 1:
                loss = self._loss(ids, labels, rows, step, g, self.loss_chunk)
                (loss * g).backward()
                loss_sum += float(loss.detach())
            else:
                # Each part's gradients summed in row order, then added as one micro-batch's are.
                chunk = max(1, self.loss_chunk // len(parts))
                done = self.rows.map(lambda s: self._grads(ids[s], labels[s], rows[s], step, g, chunk), parts)
                with torch.no_grad():
                    for i, n in enumerate(self.names):
                        grads = [d[1][i] for d in done if d[1][i] is not None]
                        if grads:
                            total, p = sum(grads[1:], grads[0]), self.params[n]
                            p.grad = total if p.grad is None else p.grad.add_(total)
                loss_sum += sum(d[0] for d in done)
            tokens += int(ids.size)
        if self.keys is not None:
            self.keys.tokens = None
        return loss_sum, tokens

    def _loss(self, ids, labels, rows, step: int, g: float, chunk: int) -> torch.Tensor:
        """The summed loss of these rows, its graph kept for backward where grad is enabled. `rows`:
        their places in the step, which key LoRA dropout's masks (None: a held-out pass, no dropout)."""
        dev = self.engine.device
        if self.keys is not None and rows is not None:  # this thread's, until its backward is over (a recomputed layer reads them)
            self.keys.tokens = torch.from_numpy(token_keys(self.seed, step, rows, ids.shape[1])).to(dev)
        return self._forward_loss(torch.from_numpy(ids).to(dev), torch.from_numpy(labels).to(dev), chunk, g)

    def _forward_loss(self, ids: torch.Tensor, labels: torch.Tensor, chunk: int, g: float) -> torch.Tensor:
        return step_loss(self.model, ids, labels, chunk, g)

    def _grads(self, ids, labels, rows, step: int, g: float, chunk: int) -> tuple[float, tuple]:
        """A part's loss and its gradients for the LoRA parameters (in self.names' order), taken by
        the thread that computes the part and returned, not accumulated."""
        try:
            loss = self._loss(ids, labels, rows, step, g, chunk)
            return float(loss.detach()), torch.autograd.grad(loss * g, [self.params[n] for n in self.names], allow_unused=True)
        finally:
            if self.keys is not None:
                self.keys.tokens = None

    def evaluate(self, micro_batches) -> tuple[float, int]:
        """The summed cross-entropy and the target count of held-out rows: forward only, no
        gradient, dropout off; the loss in chunks of `loss_chunk` positions, as in training."""
        was = self.model.training
        self.model.train(False)
        loss_sum, targets = 0.0, 0
        try:
            for ids, labels in micro_batches:
                parts = self.rows.parts(len(ids))  # split by rows as a step is (row_threads.py)
                chunk = max(1, self.loss_chunk // len(parts))
                for loss, n in self.rows.map(lambda s: self._held_out(ids[s], labels[s], chunk), parts):
                    loss_sum += loss
                    targets += n
        finally:
            self.model.train(was)
        return loss_sum, targets

    def _held_out(self, ids, labels, chunk: int) -> tuple[float, int]:
        with torch.no_grad():  # per thread, as torch's grad mode is: no graph kept
            return float(self._loss(ids, labels, None, 0, 1.0, chunk)), int((labels != -100).sum())

    def _optimizer_state(self, p, step: float = 0.0, exp_avg=None, exp_avg_sq=None) -> None:
        """AdamW's state, as torch.optim.AdamW would make it lazily (step on the CPU, moments
        beside the parameter), so no tensor of it lands on torch's default device."""
        self.optimizer.state[p] = {
            "step": torch.tensor(step, dtype=torch.float32, device="cpu"),
            "exp_avg": torch.zeros_like(p) if exp_avg is None else exp_avg,
            "exp_avg_sq": torch.zeros_like(p) if exp_avg_sq is None else exp_avg_sq,
        }

    def apply(self, lr: float) -> None:
        """The optimizer update; never interrupted."""
        for p in self.params.values():
            if not self.optimizer.state.get(p):
                self._optimizer_state(p)
        self.optimizer.lr = lr
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scaler is not None:
            self.scaler.step_done()

    def discard(self) -> None:
        self.optimizer.zero_grad()
        if self.scaler is not None:
            self.scaler.discard()

    def adapter(self) -> dict[str, np.ndarray]:
        return {n: self.params[n].detach().float().cpu().numpy().copy() for n in self.names}

    def export(self) -> dict[str, np.ndarray]:
        out = {f"adapter.{n}": v for n, v in self.adapter().items()}
        for n in self.names:
            st = self.optimizer.state.get(self.params[n])
            if st:
                out[f"optim.{n}.exp_avg"] = st["exp_avg"].detach().float().cpu().numpy().copy()
                out[f"optim.{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().float().cpu().numpy().copy()
        if self.scaler is not None:
            out.update(self.scaler.export())
        return out

    def load(self, tensors: dict[str, np.ndarray], step: int) -> None:
        dev = self.engine.device
        with torch.no_grad():
            for n in self.names:
                self.params[n].copy_(torch.from_numpy(tensors[f"adapter.{n}"]).to(dev))
                if f"optim.{n}.exp_avg" in tensors:
                    self._optimizer_state(self.params[n], float(step),
                                          torch.from_numpy(tensors[f"optim.{n}.exp_avg"]).to(dev).clone(),
                                          torch.from_numpy(tensors[f"optim.{n}.exp_avg_sq"]).to(dev).clone())
        if self.scaler is not None:
            self.scaler.load(tensors)

    def merged_weights(self) -> dict[str, np.ndarray]:
        """The checkpoint's own tensors, read again as float32 on the CPU, with each LoRA update
        folded in, under the checkpoint's names. Not the device's copy: a bfloat16 base would
        round every tensor, even those no adapter touches."""
        weights = load_checkpoint(self.model_dir, torch.float32, "cpu")
        for n in self.names:
            if n.endswith(".lora_A.weight"):
                module = n.removesuffix(".lora_A.weight")
                A = self.params[n].detach().float().cpu()
                B = self.params[f"{module}.lora_B.weight"].detach().float().cpu()
                weights[f"{module}.weight"] = weights[f"{module}.weight"] + self.spec.scale * (B @ A)
        return {k: v.numpy() for k, v in weights.items()}


class TorchEngine(WeightPlacement):
    """`device` and `base_dtype` default to what the engine's name and the device call for;
    `width` is the model's hidden size (the CPU's dtype policy needs it), `why` says where a
    given `base_dtype` came from, `training` whether the engine is for a tune (the policy may differ),
    `shape` the config of the model a row job generates with (its decode step may be measured),
    `layer_types` a quantized GGUF's types of its layers (its dtype may keep them in their blocks)."""

    def __init__(self, name: str, device: str | torch.device | None = None, base_dtype: torch.dtype | str | None = None,
                 width: int | None = None, why: str | None = None, training: bool = False, shape: dict | None = None,
                 quantize: str | None = None, max_mem_gb: float | None = None, layer_types: dict | None = None):
        self.name = name
        self.max_mem_gb = max_mem_gb  # --max-mem-gb: the memory the job may use, where it is less than the machine's
        base_dtype = getattr(torch, base_dtype) if isinstance(base_dtype, str) else base_dtype
        self.device = torch.device(device if device is not None else ("cuda" if name == "torch-cuda" else "cpu"))
        make_deterministic(self.device)  # before anything of this engine reaches the device
        if self.device.type == "cpu":
            return_freed_memory()
            fit_threads(self.device)
        if base_dtype is not None:
            self.precision = precision_of(base_dtype, why)
        else:
            self.precision = device_precision(self.device, width, training)
            if shape is not None and not training and self.device.type == "cpu":
                self.precision = generation_precision(self.precision, shape, max_mem_gb, layer_types)
        self.base_dtype = self.precision.base
        self.memory = PeakMemory(self.device)
        self._quantized: dict[str, tuple[bool, str | None, bool]] = {}  # model path -> (kept quantized, why, dense head)
        self._streamed: dict[str, tuple[bool, str]] = {}  # model path -> (streamed from the file, why)
        self.training = training
        self.quantize = quantize  # --quantize's block type (runtime.models.quantize): float weights quantized at load

    def fit_threads(self) -> None:
        if self.device.type == "cpu":
            fit_threads(self.device)

    def describe(self) -> dict:
        """Device model, software and base dtype, recorded per process in the state's history."""
        return {**describe(self.device), "dtype": self.precision.name, "precision": self.precision.why}

    def train_session(self, model_dir, spec: LoraSpec, tensors: dict, opt: OptimSpec, seed: int = 0) -> TorchTrainSession:
        return TorchTrainSession(self, model_dir, spec, tensors, opt, seed)

    def load_model(self, model_dir, adapter: tuple[dict, LoraSpec] | list[tuple[dict, LoraSpec]] | None = None):
        # A float32 CPU base's GEMMs run faster on weights laid out for them (layout.cpu_inference_layout).
        cpu_inference = self.device.type == "cpu" and self.base_dtype == torch.float32
        streamed = self.stream_why(model_dir)[0]
        model = load_model(model_dir, dtype=self.base_dtype, device=self.device, cpu_inference=cpu_inference,
                           quantized=not streamed and self.keeps_quantized(model_dir) and (self.quantize or True),
                           dense_head=not streamed and self.dense_head(model_dir), streamed=streamed)
        if isinstance(adapter, list):  # many adapters in one batch: each request names its own (multi_lora.py)
            from runtime.engines.torch.multi_lora import apply_adapters

            apply_adapters(model, adapter, self.device)
        elif adapter is not None:
            tensors, spec = adapter
            apply_lora(model, tensors, spec, self.device)
        return model.eval()

    def generator(self, model_dir, tokenizer, adapter=None, slots: int = 8, max_len: int = 2048):
        from runtime.engines.generation import Generator

        return Generator(self.load_model(model_dir, adapter).make_decoder(slots, max_len), tokenizer)

    def peak_mem_gb(self) -> float:
        """Since this engine was made (one per job): reserved memory on CUDA, peak RSS on a CPU."""
        return self.memory.gb()
