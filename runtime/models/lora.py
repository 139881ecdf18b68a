"""LoRA adapters, engine-neutral: the spec, the initial tensors, and the files on disk.

Canonical tensor names follow PEFT without its wrapper prefix:
`model.layers.0.self_attn.q_proj.lora_A.weight` (r, in) and `...lora_B.weight` (out, r),
float32. The update is B @ A scaled by alpha / r, and B starts at zero, so step 0 of a
tune is exactly the base model. Written out twice: the PEFT layout (loadable by
`peft.PeftModel.from_pretrained`) and the mlx-lm layout.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from runtime.base.errors import SpillpackError
from runtime.models.arch import architecture

PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
MLX_WEIGHTS = "adapters.safetensors"
MLX_DIR = "mlx"
BASE_RECORD = "base.json"  # the base an adapter was trained on: what --init-adapter checks (PEFT ignores the file)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_linears(config: dict, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) for each adapted linear layer.

    The architecture's arguments list each layer's linears (runtime.models.args.lora_linears):
    Phi-3's fused qkv_proj and gate_up_proj, Qwen3-MoE's attention and experts, the others' seven.
    """
    args = architecture(config).args.from_dict(config)
    targets = fuse_targets(args, targets, config.get("model_type"))
    layers = [args.lora_linears(layer) for layer in range(args.num_hidden_layers)]
    known = {k.split(".")[-1] for shapes in layers for k in shapes}
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise SpillpackError(f"unknown LoRA target {unknown[0]!r} for {config.get('model_type')}",
                             f"--targets with some of {','.join(sorted(known))}")
    out = {}
    for layer, shapes in enumerate(layers):
        for name, shape in shapes.items():
            if name.split(".")[-1] in targets:
                out[f"model.layers.{layer}.{name}"] = shape
    return out


def fuse_targets(args, targets: tuple[str, ...], model_type) -> tuple[str, ...]:
    """Unfused names that a fused linear stands for, all of them named, become the fused one
    (q_proj,k_proj,v_proj -> qkv_proj on Phi-3); some of them only is refused: the fused linear
    cannot adapt a part of itself."""
    out = list(targets)
    for fused, parts in args.lora_fused.items():
        named = [t for t in parts if t in out]
        if named and len(named) < len(parts):
            raise SpillpackError(f"{model_type} fuses {', '.join(parts)} into {fused}; --targets names only {', '.join(named)}",
                                 f"--targets with {fused} (or all of {','.join(parts)})")
        if named:
            out = [t for t in out if t not in parts] + [fused]
    return tuple(out)


def init_tensors(config: dict, spec: LoraSpec, seed: int) -> dict[str, np.ndarray]:
    """A as PEFT initializes it (kaiming-uniform, bound 1/sqrt(in)), B zero; from numpy so
    every engine starts from the same bytes."""
    linears = target_linears(config, spec.targets)
    # Past min(in, out) a rank adds no expressiveness, only bytes (rank 100000 on tiny: 6.7 GB).
    name, width = min(((n, min(shape)) for n, shape in linears.items()), key=lambda x: x[1])
    if spec.rank > width:
        raise SpillpackError(f"--rank {spec.rank} is more than the width of {name.split('.')[-1]} ({width}), "
                             "which bounds a LoRA update's rank", f"--rank {min(16, width)} (at most {width})")
    rng = np.random.Generator(np.random.PCG64([seed, 0x10AA]))
    out = {}
    for name, (fan_in, fan_out) in sorted(linears.items()):
        bound = 1.0 / math.sqrt(fan_in)
        out[f"{name}.lora_A.weight"] = rng.uniform(-bound, bound, size=(spec.rank, fan_in)).astype(np.float32)
        out[f"{name}.lora_B.weight"] = np.zeros((fan_out, spec.rank), dtype=np.float32)
    return out


# The base's facts an adapter records (and --init-adapter compares, in this order).
BASE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")


def base_record(model_dir) -> dict:
    """The facts of a base model an adapter records (BASE_RECORD): its architecture and sizes
    from config.json, and its weights' hash (runtime.models.ref.ModelDir.fingerprint)."""
    c = model_dir.config
    return {**{k: c[k] for k in BASE_KEYS if k in c}, "architectures": c.get("architectures"), "weights_sha256": model_dir.fingerprint(),
            "weights_sample_sha256": weights_sample(model_dir.path)}


SAMPLES = 64  # per safetensors file
SAMPLE_BYTES = 4096


def weights_sample(path: Path) -> str:
    """sha256 over config.json and, for each safetensors file (or the one GGUF file), its name,
    size and SAMPLES evenly spaced SAMPLE_BYTES pieces of it: unlike the fingerprint (headers only) it tells apart two
    checkpoints of the same shapes with other values, at 256 KiB read per file."""
    import hashlib

    path = Path(path)
    if path.is_file():  # a GGUF: its metadata and tensors are in the one file
        h, files = hashlib.sha256(b"gguf"), [path]
    else:
        h, files = hashlib.sha256((path / "config.json").read_bytes()), sorted(path.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            for i in range(SAMPLES):
                fh.seek(size * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def save_adapter(directory: Path, tensors: dict[str, np.ndarray], spec: LoraSpec, base_model: str, num_layers: int,
                 base: dict | None = None) -> None:
    """Both layouts into `directory` (PEFT at the top, mlx-lm under mlx/); `base`: a base_record()."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if base is not None:
        (directory / BASE_RECORD).write_text(json.dumps(base, indent=2, sort_keys=True) + "\n")
    save_file({PEFT_PREFIX + k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        # The modules really adapted (a fused name where --targets named its parts), for PEFT to find.
        "target_modules": sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
    }
    (directory / PEFT_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    mlx_dir = directory / MLX_DIR
    mlx_dir.mkdir(exist_ok=True)
    mlx_tensors = {}
    for k, v in tensors.items():
        module, which = k.rsplit(".lora_", 1)
        if which == "A.weight":
            mlx_tensors[f"{module}.lora_a"] = np.ascontiguousarray(v.T)
        else:
            mlx_tensors[f"{module}.lora_b"] = np.ascontiguousarray(v.T)
    save_file(mlx_tensors, str(mlx_dir / MLX_WEIGHTS))
    mlx_config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": spec.rank, "scale": spec.scale, "dropout": spec.dropout,
                            "keys": sorted({k.split(".", 3)[3].rsplit(".lora_", 1)[0] for k in tensors})},
    }
    (mlx_dir / "adapter_config.json").write_text(json.dumps(mlx_config, indent=2) + "\n")


def load_adapter(directory: Path) -> tuple[dict[str, np.ndarray], LoraSpec]:
    """Read a PEFT-layout adapter (ours or PEFT's own)."""
    directory = Path(directory)
    cfg_path, weights_path = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    if not cfg_path.is_file() or not weights_path.is_file():
        raise SpillpackError(f"{directory} is not a LoRA adapter (needs {PEFT_CONFIG} and {PEFT_WEIGHTS})", f"ls {directory}")
    try:
        cfg = json.loads(cfg_path.read_text())
        raw = load_file(str(weights_path))
    except Exception as e:
        raise SpillpackError(f"adapter {directory} cannot be read ({e})", f"ls -l {directory}")
    tensors = {}
    for k, v in raw.items():
        k = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        k = k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        tensors[k] = v.astype(np.float32)
    targets = cfg.get("target_modules") or []
    targets = tuple(sorted(targets if isinstance(targets, list) else [targets]))
    spec = LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=targets, dropout=float(cfg.get("lora_dropout", 0.0)))
    return tensors, spec

