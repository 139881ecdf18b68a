"""`tune --init-adapter SRC`: continue training an existing LoRA adapter.

SRC is a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), an mlx-lm
adapter directory (adapter_config.json with lora_parameters + adapters.safetensors), a LoRA
adapter GGUF (llama.cpp's `--lora` file, runtime.models.gguf.adapter), or a spillpack state (its
finished adapter/, else its newest checkpoint), each as a path or s3://.

PEFT loads whatever matches and stays silent about the rest, so a wrong base wastes a whole
run. Here every tensor must be a LoRA pair of a linear the base has, shaped for it, and the
base must be the one the adapter records where it records one (spillpack's base.json, a
state's job, mlx-lm's layer count): any difference is one line naming the first tensor or key
that differs, before anything is trained or written. Rank, alpha and targets come from the
adapter; a conflicting --rank, --alpha or --targets is an error line.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from safetensors.numpy import load as st_load

from runtime.base.errors import SpillpackError
from runtime.base.fileio import sha256_bytes
from runtime.models.lora import (BASE_KEYS, BASE_RECORD, MLX_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS, LoraSpec, base_record, load_adapter,
                                 target_linears)
from runtime.state.uri import open_store



@dataclass
class InitAdapter:
    tensors: dict[str, np.ndarray]  # canonical LoRA names, float32
    spec: LoraSpec
    sha256: str  # of the tensors and spec: part of the job's identity
    kind: str  # "peft" | "mlx-lm" | "state" | "gguf"
    resume: dict | None = None
    targets: str | None = None  # --targets as the job writes it: a state's own text, else the adapted layers joined  # SRC is a state of this same job: its newest checkpoint, to continue from


def load(src: str, model_dir, o: dict, own_state: str | None = None) -> InitAdapter:
    """The adapter at `src`, checked against the base in `model_dir` and the options in `o`.
    `own_state`: this job's --state URI, which SRC must not be (that is a plain resume)."""
    if own_state is not None and _same_place(src, own_state):
        raise SpillpackError(f"--init-adapter {src} is this job's own --state", "the same command without --init-adapter to continue it")
    gguf = _gguf_file(src)
    store = open_store(src) if gguf is None else None
    if gguf is not None:
        adapter = _from_gguf(src, gguf, model_dir)
    elif store.read("job.json") is not None:
        adapter = _from_state(src, store, model_dir)
    else:
        files = set(store.list(""))
        if PEFT_CONFIG not in files:
            raise SpillpackError(f"--init-adapter {src} is not a LoRA adapter: no {PEFT_CONFIG} (a PEFT or mlx-lm adapter directory, "
                                 "a LoRA adapter GGUF, or a spillpack state)", f"ls {src}")
        cfg = _json(store, PEFT_CONFIG, src)
        if "lora_parameters" in cfg or MLX_WEIGHTS in files and PEFT_WEIGHTS not in files:
            adapter = _from_mlx(src, store, cfg, model_dir)
        else:
            adapter = _from_peft(src, store, cfg)
        record = _json(store, BASE_RECORD, src) if BASE_RECORD in files else None
        if record is not None:
            check_base(src, record, base_record(model_dir))
    check_tensors(src, adapter.tensors, adapter.spec, model_dir.config)
    check_options(src, adapter.spec, o)
    adapter.targets = adapter.targets or ",".join(adapter.spec.targets)
    return adapter


def resume_of(adapter: InitAdapter, identity: dict) -> dict | None:
    """SRC's newest checkpoint when SRC is a state of this same job (its identity equal to this
    one's but for the init adapter): the job continues from it, optimizer moments and all.
    Any other adapter starts a fresh optimizer."""
    if adapter.resume is None:
        return None
    theirs = {k: v for k, v in adapter.resume["identity"].items() if k != "init_adapter"}
    ours = {k: v for k, v in identity.items() if k != "init_adapter"}
    return adapter.resume if theirs == ours else None


def _same_place(a: str, b: str) -> bool:
    import os

    norm = lambda u: os.path.abspath(os.path.expanduser(u[len("file://"):] if u.startswith("file://") else u)) \
        if not u.startswith("s3://") else u.rstrip("/")  # noqa: E731
    return norm(a) == norm(b)


def _json(store, name: str, src: str) -> dict:
    try:
        cfg = orjson.loads(store.read(name) or b"")
    except orjson.JSONDecodeError:
        cfg = None
    if not isinstance(cfg, dict):
        raise SpillpackError(f"--init-adapter {src}: {name} is not a JSON object", f"cat {src.rstrip('/')}/{name}")
    return cfg


def _digest(tensors: dict, spec: LoraSpec) -> str:
    parts = [orjson.dumps({"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)})]
    for k in sorted(tensors):
        parts += [k.encode(), str(tensors[k].shape).encode(), np.ascontiguousarray(tensors[k], dtype=np.float32).tobytes()]
    return sha256_bytes(b"\0".join(parts))


def _targets_of(tensors: dict) -> tuple[str, ...]:
    return tuple(sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors}))


def _from_peft(src: str, store, cfg: dict) -> InitAdapter:
    for key, ok in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise SpillpackError(f"--init-adapter {src}: {PEFT_CONFIG} sets {key}, which spillpack's LoRA does not compute",
                                 "an adapter trained with plain LoRA (use_dora, use_rslora and fan_in_fan_out false)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise SpillpackError(f"--init-adapter {src} is a {cfg.get('peft_type')} adapter, not LoRA", f"cat {src.rstrip('/')}/{PEFT_CONFIG}")
    with tempfile.TemporaryDirectory(prefix="spillpack-init-") as tmp:
        for name in (PEFT_CONFIG, PEFT_WEIGHTS):
            data = store.read(name)
            if data is None:
                raise SpillpackError(f"--init-adapter {src} has no {name}", f"ls {src}")
            (Path(tmp) / name).write_bytes(data)
        tensors, spec = load_adapter(Path(tmp))
    bad = next((k for k in sorted(tensors) if not k.endswith((".lora_A.weight", ".lora_B.weight"))), None)
    if bad is not None:
        raise SpillpackError(f"--init-adapter {src}: tensor {bad} is not a LoRA A or B weight", "an adapter with LoRA tensors only")
    spec = LoraSpec(spec.rank, spec.alpha, _targets_of(tensors))
    return InitAdapter(tensors, spec, _digest(tensors, spec), "peft")


def _gguf_file(src: str):
    """A context giving the local path of SRC where SRC is one GGUF file (a path, or an s3:// key
    fetched to a temporary file), else None."""
    import contextlib

    from runtime.models.gguf import SUFFIX, is_gguf_file
    from runtime.state.store import local_file

    path = local_file(src)
    if path is not None:
        return contextlib.nullcontext(path) if is_gguf_file(path) else None
    if not src.rstrip("/").lower().endswith(SUFFIX):
        return None

    @contextlib.contextmanager
    def fetched():
        parent, _, key = src.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="spillpack-adapter-") as tmp:
            local = Path(tmp) / key
            if not open_store(parent).get_file(key, local):
                raise SpillpackError(f"--init-adapter {src} does not exist", f"aws s3 ls {parent}/")
            yield local
    return fetched()


def _from_gguf(src: str, opened, model_dir) -> InitAdapter:
    from runtime.models.gguf.adapter import read_lora

    with opened as path:
        tensors, alpha, _ = read_lora(path, model_dir.config, "--init-adapter")
    ranks = {v.shape[0] for k, v in tensors.items() if k.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise SpillpackError(f"--init-adapter {src}: its lora_a tensors have ranks {sorted(ranks)}, not one rank",
                             "an adapter GGUF of one LoRA")
    spec = LoraSpec(ranks.pop(), alpha, _targets_of(tensors))
    return InitAdapter(tensors, spec, _digest(tensors, spec), "gguf")


def _from_mlx(src: str, store, cfg: dict, model_dir) -> InitAdapter:
    """mlx-lm: `<module>.lora_a` (in, r) and `.lora_b` (r, out), scale = alpha / rank."""
    params = cfg.get("lora_parameters") or {}
    if cfg.get("fine_tune_type", "lora") != "lora":
        raise SpillpackError(f"--init-adapter {src} is an mlx-lm {cfg.get('fine_tune_type')} adapter, not LoRA",
                             f"cat {src.rstrip('/')}/{PEFT_CONFIG}")
    layers = cfg.get("num_layers")
    have = model_dir.config.get("num_hidden_layers")
    if isinstance(layers, int) and isinstance(have, int) and layers > have:
        raise SpillpackError(f"--init-adapter {src} was trained on a different base: num_layers is {layers} there and the base has "
                             f"{have} layers", "the base model the adapter was trained on")
    data = store.read(MLX_WEIGHTS)
    if data is None:
        raise SpillpackError(f"--init-adapter {src} has no {MLX_WEIGHTS}", f"ls {src}")
    try:
        raw = st_load(data)
    except Exception as e:
        raise SpillpackError(f"--init-adapter {src}: {MLX_WEIGHTS} cannot be read ({e})", f"ls -l {src}")
    tensors = {}
    for k, v in raw.items():
        if k.endswith(".lora_a"):
            tensors[k[: -len(".lora_a")] + ".lora_A.weight"] = np.ascontiguousarray(v.T, dtype=np.float32)
        elif k.endswith(".lora_b"):
            tensors[k[: -len(".lora_b")] + ".lora_B.weight"] = np.ascontiguousarray(v.T, dtype=np.float32)
        else:
            raise SpillpackError(f"--init-adapter {src}: tensor {k} is not a LoRA lora_a or lora_b", "an mlx-lm LoRA adapter")
    if not tensors:
        raise SpillpackError(f"--init-adapter {src}: {MLX_WEIGHTS} holds no tensor", f"ls -l {src}")
    ranks = [v.shape[0] for k, v in tensors.items() if k.endswith("lora_A.weight")]
    if not ranks:
        raise SpillpackError(f"--init-adapter {src}: {MLX_WEIGHTS} has lora_b tensors but no lora_a", "an mlx-lm LoRA adapter with both halves")
    rank = params.get("rank") or ranks[0]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise SpillpackError(f"--init-adapter {src}: lora_parameters.rank must be a positive whole number, not {repr(rank)[:40]}",
                             f"fix adapter_config.json in {src}")
    alpha = float(params.get("scale", 20.0)) * rank  # mlx-lm's default scale is 20
    spec = LoraSpec(rank, alpha, _targets_of(tensors))
    return InitAdapter(tensors, spec, _digest(tensors, spec), "mlx-lm")


def _from_state(src: str, store, model_dir) -> InitAdapter:
    """A spillpack state: its finished adapter (PEFT layout under adapter/), else its newest checkpoint."""
    from runtime.jobs import tune_checkpoint
    from runtime.state.jobstate import JobState

    state = JobState(store, {})
    theirs = state.claimed() or {}
    if theirs.get("command") != "tune":
        raise SpillpackError(f"--init-adapter {src} is the state of a {theirs.get('command')} job, not a tune: it holds no adapter",
                             f"spillpack status {src}")
    if theirs.get("model") and theirs["model"] != model_dir.fingerprint():
        raise SpillpackError(f"--init-adapter {src} was trained on a different base: the model's weights hash (config and "
                             "safetensors headers) differs from this one's", f"spillpack status {src} names the model it tuned")
    record = store.read("adapter/" + BASE_RECORD)  # a finished tune's adapter records its base
    if record is not None:
        check_base(src, _json(store, "adapter/" + BASE_RECORD, src), base_record(model_dir))
    latest = state.checkpoints.latest(lambda c: tune_checkpoint.agrees(state, c))  # the one tune itself would resume from
    if latest is None:
        raise SpillpackError(f"--init-adapter {src} is a tune state with no committed checkpoint yet", f"spillpack status {src}")
    resume = {"identity": theirs, **tune_checkpoint.read(state, latest)}
    tensors = {k[len("adapter."):]: v for k, v in resume["tensors"].items() if k.startswith("adapter.")}
    spec = LoraSpec(int(theirs["rank"]), float(theirs["alpha"]), _targets_of(tensors))
    return InitAdapter(tensors, spec, _digest(tensors, spec), "state", resume, targets=theirs.get("targets"))


def check_base(src: str, theirs: dict, ours: dict) -> None:
    for key in BASE_KEYS:
        if key in theirs and key in ours and theirs[key] != ours[key]:
            raise SpillpackError(f"--init-adapter {src} was trained on a different base: {key} is {theirs[key]!r} there and "
                                 f"{ours[key]!r} here", "the base model the adapter was trained on")
    for key in ("weights_sha256", "weights_sample_sha256"):
        if theirs.get(key) and ours.get(key) and theirs[key] != ours[key]:
            raise SpillpackError(f"--init-adapter {src} was trained on a different base: {key} is {theirs[key][:12]}... there and "
                                 f"{ours[key][:12]}... here", "the base model the adapter was trained on (same config.json and safetensors)")


def check_tensors(src: str, tensors: dict, spec: LoraSpec, config: dict) -> None:
    """Every tensor a LoRA A (r, in) or B (out, r) of a linear the base has; A and B in pairs."""
    try:
        linears = target_linears(config, spec.targets)
    except SpillpackError as e:
        first = next(k for k in sorted(tensors) if k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] not in _known(config))
        raise SpillpackError(f"--init-adapter {src}: tensor {first} adapts a layer this base does not have ({e.what})",
                             "the base model the adapter was trained on") from None
    for k in sorted(tensors):
        module, which = k.rsplit(".lora_", 1)
        if module not in linears:
            raise SpillpackError(f"--init-adapter {src}: tensor {k} adapts {module}, which this base does not have "
                                 f"({config.get('num_hidden_layers')} layers)", "the base model the adapter was trained on")
        fan_in, fan_out = linears[module]
        want = (spec.rank, fan_in) if which.startswith("A") else (fan_out, spec.rank)
        if tuple(tensors[k].shape) != want:
            raise SpillpackError(f"--init-adapter {src}: tensor {k} has shape {tuple(tensors[k].shape)}, and this base's {module} "
                                 f"needs {want} at rank {spec.rank}", "the base model the adapter was trained on")
        pair = f"{module}.lora_{'B' if which.startswith('A') else 'A'}.weight"
        if pair not in tensors:
            raise SpillpackError(f"--init-adapter {src}: tensor {k} has no {pair.rsplit('.', 2)[-2]} beside it", f"ls -l {src}")


def _known(config: dict) -> set:
    from runtime.models.arch import architecture

    args = architecture(config).args.from_dict(config)
    return {k.split(".")[-1] for layer in range(args.num_hidden_layers) for k in args.lora_linears(layer)}


def check_options(src: str, spec: LoraSpec, o: dict) -> None:
    """--rank, --alpha and --targets given next to --init-adapter must say what the adapter says."""
    given = {"rank": o.get("rank"), "alpha": o.get("alpha")}
    has = {"rank": spec.rank, "alpha": spec.alpha}
    for key, value in given.items():
        if value is not None and float(value) != float(has[key]):
            raise SpillpackError(f"--{key} {value:g} conflicts with --init-adapter {src}, whose {key} is {has[key]:g}",
                                 f"the same command without --{key} (the adapter's {key} is used)")
    if o.get("targets"):
        named = tuple(sorted(t.strip() for t in str(o["targets"]).split(",") if t.strip()))
        if named != spec.targets:
            raise SpillpackError(f"--targets {o['targets']} conflicts with --init-adapter {src}, which adapts "
                                 f"{','.join(spec.targets)}", "the same command without --targets")
