"""The MLX engine: LoRA training and generation with mlx, on Apple silicon or mlx's CPU build.

The same math as the torch engine, tensor for tensor: LoRA `y = base(x) + scale * (x A^T) B^T`
with A (r, in) and B (out, r) under the canonical names, the loss summed over target tokens
and divided by the step's target count, and AdamW exactly as torch.optim.AdamW computes it
(decoupled weight decay, bias correction by the step count). So `export()` writes the same
names and meanings as the torch session and a checkpoint continues on either engine.
On a Metal GPU the frozen base is bfloat16; LoRA weights, moments and checkpoints stay float32.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from runtime.models.dropout import feature_keys, keep_mask, token_keys
from runtime.models.lora import LoraSpec
from runtime.models.memory import loss_chunk
from runtime.engines.mlx.models import load_model, submodule
from runtime.engines import OptimSpec


class DropoutKeys:
    """The token keys of the micro-batch being computed (runtime.models.dropout), shared by every
    LoRA layer of a model; None outside training. A layer recomputed in backward reads the same."""

    tokens: mx.array | None = None  # (B, T) int32

    def for_input(self, h: mx.array) -> mx.array:
        """The keys of the tokens `h` (..., width) holds: the micro-batch's, or all of them
        flattened (a MoE expert runs on every token)."""
        if tuple(h.shape[:-1]) == tuple(self.tokens.shape):
            return self.tokens
        assert h.shape[0] == self.tokens.size and h.ndim == 2, f"no token keys for an input of shape {tuple(h.shape)}"
        return self.tokens.reshape(-1)


class LoRALinear(nn.Module):
    """Wraps a frozen nn.Linear. lora_A/lora_B are bias-free linears, so their weights sit at
    the canonical `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight` (out, r).
    Dropout's masks are runtime.models.dropout's, the same as the torch engine's."""

    def __init__(self, base: nn.Linear, A: np.ndarray, B: np.ndarray, scale: float, dropout: float = 0.0,
                 keys: DropoutKeys | None = None, features: np.ndarray | None = None):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(A.shape[1], A.shape[0], bias=False)
        self.lora_B = nn.Linear(B.shape[1], B.shape[0], bias=False)
        self.lora_A.weight = mx.array(A, dtype=mx.float32)
        self.lora_B.weight = mx.array(B, dtype=mx.float32)
        self.scale = scale
        # Underscores: not parameters, never trained or saved.
        self._p, self._keys = dropout, keys
        self._features = None if features is None else mx.array(features)  # (in,) int32

    def __call__(self, x):
        y = self.base(x)
        h = x.astype(mx.float32)
        if self.training and self._p > 0 and self._keys is not None and self._keys.tokens is not None:
            h = h * keep_mask(self._keys.for_input(h), self._features, self._p) / (1 - self._p)
        z = self.lora_B(self.lora_A(h))
        return y + (self.scale * z).astype(y.dtype)


def apply_lora(model: nn.Module, tensors: dict[str, np.ndarray], spec: LoraSpec, keys: DropoutKeys | None = None) -> dict[str, LoRALinear]:
    """Wrap each targeted linear (the model is frozen first); returns the wrappers by module name."""
    model.freeze()
    wrapped = {}
    for name in sorted({k.rsplit(".lora_", 1)[0] for k in tensors}):
        parent_name, _, child = name.rpartition(".")
        parent = submodule(model, parent_name)
        A = tensors[f"{name}.lora_A.weight"]
        features = feature_keys(name, A.shape[1]) if keys is not None else None
        lora = LoRALinear(getattr(parent, child), A, tensors[f"{name}.lora_B.weight"], spec.scale, spec.dropout, keys, features)
        setattr(parent, child, lora)
        lora.base.freeze()
        wrapped[name] = lora
    return wrapped


def target_loss(model, hidden, targets, chunk: int):
    """Summed cross-entropy of the positions with loss, hidden (N, D) and targets (N,), float32.
    `chunk` positions at a time, each chunk checkpointed, so only one chunk's vocabulary-wide
    logits are alive in forward and in backward (runtime.models.memory.loss_chunk)."""

    def part(y):
        return lambda h: nn.losses.cross_entropy(model.logits(h).astype(mx.float32), y, reduction="sum")  # (n, V) logits

    n = hidden.shape[0]
    if n <= chunk:
        return part(targets)(hidden)
    return sum(mx.checkpoint(part(targets[s:s + chunk]))(hidden[s:s + chunk]) for s in range(0, n, chunk))


def _loss(model, ids, rows, cols, targets, chunk):
    hidden = model.hidden_states(ids)  # (B, T, D); right padding is harmless under the causal mask
    return target_loss(model, hidden[rows, cols], targets, chunk)  # only positions with loss


class MLXTrainSession:
    def __init__(self, engine: "MLXEngine", model_dir, spec: LoraSpec, tensors: dict, opt: OptimSpec, seed: int = 0):
        self.engine, self.spec, self.opt, self.seed = engine, spec, opt, seed
        self.model = load_model(model_dir, dtype=engine.base_dtype)
        self.keys = DropoutKeys() if spec.dropout > 0 else None
        self.loras = apply_lora(self.model, tensors, spec, self.keys)
        self.names = sorted(tensors)
        self.model.train(spec.dropout > 0)
        self.loss_chunk = loss_chunk(self.model.args.vocab_size)  # target positions per chunk of the loss
        self._value_and_grad = nn.value_and_grad(self.model, _loss)
        self.grads: dict[str, mx.array] | None = None
        self.moments: dict[str, tuple[mx.array, mx.array]] = {}
        self.t = 0  # AdamW's step count, as torch keeps it in the optimizer state
        self.pad_id = 0

    def _param(self, name: str) -> nn.Linear:
        module, which = name.rsplit(".lora_", 1)
        return getattr(self.loras[module], "lora_" + which.split(".")[0])

    @property
    def grad_checkpoint(self) -> bool:
        """Per-layer activation checkpointing (the decoder's shared layer loop runs it)."""
        return self.model.model.grad_checkpoint

    @grad_checkpoint.setter
    def grad_checkpoint(self, on: bool) -> None:
        self.model.model.grad_checkpoint = bool(on)

    def forward_backward(self, micro_batches, total_targets: int, step: int = 0) -> tuple[float, int]:
        """Accumulate gradients for one optimizer step. Abandonable: it only touches self.grads."""
        loss_sum, tokens, row = 0.0, 0, 0
        for ids, labels, *rows in micro_batches:
            rows = rows[0] if rows else np.arange(row, row + len(ids))  # the rows' places in the step
            row += len(ids)
            if self.keys is not None:
                self.keys.tokens = mx.array(token_keys(self.seed, step, rows, ids.shape[1]))
            rows, cols = np.nonzero(labels != -100)
            loss, grads = self._value_and_grad(self.model, mx.array(ids), mx.array(rows), mx.array(cols),
                                               mx.array(labels[rows, cols]), self.loss_chunk)
            flat = {k: g / total_targets for k, g in tree_flatten(grads)}
            self.grads = flat if self.grads is None else {k: self.grads[k] + g for k, g in flat.items()}
            mx.eval(loss, self.grads)
            loss_sum += float(loss)
            tokens += int(ids.size)
        if self.keys is not None:
            self.keys.tokens = None
        return loss_sum, tokens

    def evaluate(self, micro_batches) -> tuple[float, int]:
        """The summed cross-entropy and the target count of held-out rows: forward only, dropout
        off; the loss in chunks of `loss_chunk` positions, as in training."""
        was = self.model.training
        self.model.train(False)
        loss_sum, targets = 0.0, 0
        try:
            for ids, labels in micro_batches:
                rows, cols = np.nonzero(labels != -100)
                hidden = self.model.hidden_states(mx.array(ids))[mx.array(rows), mx.array(cols)]  # (N, D)
                y = mx.array(labels[rows, cols])
                for s in range(0, len(rows), self.loss_chunk):
                    part = target_loss(self.model, hidden[s:s + self.loss_chunk], y[s:s + self.loss_chunk], self.loss_chunk)
                    mx.eval(part)
                    loss_sum += float(part)
                targets += len(rows)
        finally:
            self.model.train(was)
        return loss_sum, targets

    def apply(self, lr: float) -> None:
        """torch.optim.AdamW's update (amsgrad off), in the same order of operations; never interrupted."""
        b1, b2 = self.opt.betas
        self.t += 1
        bc1, bc2_sqrt = 1 - b1**self.t, (1 - b2**self.t) ** 0.5
        updated = []
        for n in self.names:
            lin, g = self._param(n), self.grads[n]
            m, v = self.moments.get(n) or (mx.zeros_like(g), mx.zeros_like(g))
            p = lin.weight * (1 - lr * self.opt.weight_decay)
            m = m + (g - m) * (1 - b1)
            v = v * b2 + (g * g) * (1 - b2)
            p = p - (lr / bc1) * (m / (mx.sqrt(v) / bc2_sqrt + self.opt.eps))
            lin.weight, self.moments[n] = p, (m, v)
            updated += [p, m, v]
        mx.eval(updated)
        self.grads = None

    def discard(self) -> None:
        self.grads = None

    def adapter(self) -> dict[str, np.ndarray]:
        return {n: np.array(self._param(n).weight, dtype=np.float32) for n in self.names}

    def export(self) -> dict[str, np.ndarray]:
        out = {f"adapter.{n}": v for n, v in self.adapter().items()}
        for n, (m, v) in self.moments.items():
            out[f"optim.{n}.exp_avg"] = np.array(m, dtype=np.float32)
            out[f"optim.{n}.exp_avg_sq"] = np.array(v, dtype=np.float32)
        return out

    def load(self, tensors: dict[str, np.ndarray], step: int) -> None:
        self.moments = {}
        for n in self.names:
            self._param(n).weight = mx.array(tensors[f"adapter.{n}"], dtype=mx.float32)
            if f"optim.{n}.exp_avg" in tensors:
                self.moments[n] = (mx.array(tensors[f"optim.{n}.exp_avg"]), mx.array(tensors[f"optim.{n}.exp_avg_sq"]))
        self.t = step if self.moments else 0
        mx.eval(self.model.trainable_parameters())

    def merged_weights(self) -> dict[str, np.ndarray]:
        """Base weights with each LoRA update folded in, under the checkpoint's own names, float32."""
        out = {}
        for name, lora in self.loras.items():
            delta = lora.scale * (lora.lora_B.weight @ lora.lora_A.weight)
            out[f"{name}.weight"] = np.array(lora.base.weight.astype(mx.float32) + delta)
            if "bias" in lora.base:
                out[f"{name}.bias"] = np.array(lora.base.bias.astype(mx.float32))
        for name, value in tree_flatten(self.model.parameters()):
            if ".lora_" not in name and ".base." not in name:
                out[name] = np.array(value.astype(mx.float32))
        return out


class MLXEngine:
    name = "mlx"

    def __init__(self, dtype: str | None = None, why: str | None = None):
        """`dtype`: "float32" or "bfloat16" asked for (`why`: by whom); else bfloat16 on a GPU,
        float32 on a CPU (mlx's CPU backend has no fast bfloat16 matmul)."""
        self.device = mx.default_device()
        self.base_dtype = getattr(mx, dtype) if dtype else mx.bfloat16 if self.device == mx.gpu else mx.float32
        name = str(self.base_dtype).removeprefix("mlx.core.")
        self.why = why or (f"{name} on a Metal GPU" if self.device == mx.gpu else f"{name}: mlx on a CPU")

    def fit_threads(self) -> None:
        """mlx picks its own threads (Metal, or its CPU backend's pool): nothing the job chooses."""

    def describe(self) -> dict:
        """Device model, software and base dtype, recorded per process in the state's history. On
        a CPU the device reads as torch-cpu's does, so a switch of engine on one machine is told
        as that, not as a change of device too."""
        import platform

        from runtime.base.place import cpu_model

        if self.device == mx.gpu:
            device = f"{mx.device_info().get('device_name') or 'Apple'} GPU (Metal)"
        else:
            device = f"{cpu_model()} ({platform.machine()})"
        return {"device": device, "software": f"mlx {getattr(mx, '__version__', '?')}", "dtype": str(self.base_dtype).removeprefix("mlx.core."),
                "precision": self.why}

    def train_session(self, model_dir, spec: LoraSpec, tensors: dict, opt: OptimSpec, seed: int = 0) -> MLXTrainSession:
        return MLXTrainSession(self, model_dir, spec, tensors, opt, seed)

    def load_model(self, model_dir, adapter: tuple[dict, LoraSpec] | list[tuple[dict, LoraSpec]] | None = None):
        model = load_model(model_dir, dtype=self.base_dtype)
        if isinstance(adapter, list):  # many adapters in one batch: each request names its own (multi_lora.py)
            from runtime.engines.mlx.multi_lora import apply_adapters

            apply_adapters(model, adapter)
        elif adapter is not None:
            tensors, spec = adapter
            apply_lora(model, tensors, spec)
        model.eval()
        return model

    def generator(self, model_dir, tokenizer, adapter=None, slots: int = 8, max_len: int = 2048):
        from runtime.engines.generation import Generator

        return Generator(self.load_model(model_dir, adapter).make_decoder(slots, max_len), tokenizer)

    def peak_mem_gb(self) -> float:
        return mx.get_peak_memory() / 2**30
