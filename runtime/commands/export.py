"""`spillpack export STATE --gguf FILE [--type f32|f16|q8_0] | --gguf-adapter FILE [--adapter-type f32|f16]`:
a tune's result as GGUF, for llama.cpp and Ollama.

The adapter is the finished one under the state's adapter/ (or, for a tune that has not
finished, its newest checkpoint, which is said). `--gguf` folds it into the base model the
tune named (the engine's own merge: the checkpoint's float32 tensors + scale * B @ A) and writes
the whole model; `--gguf-adapter` writes the LoRA alone, for `llama-server --lora`. The base is
found from the state's saved invocation, as `resume` would find it; `--weights` names it when
the state was made elsewhere (a cluster's paths). Runs in a bundle too (`./run.sh export STATE ...`).
"""

from __future__ import annotations

import orjson
from safetensors.numpy import load as st_load

from runtime.base.errors import SpillpackError, UsageError
from runtime.jobs.tune_checkpoint import agrees
from runtime.models import gguf_write
from runtime.models.lora import PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, LoraSpec
from runtime.state.jobstate import JobState
from runtime.state.uri import open_store


def add_arguments(parser) -> None:
    parser.add_argument("state", metavar="STATE", help="a tune's state: a path, file:// or s3:// URI")
    parser.add_argument("--gguf", metavar="FILE", help="write the merged model (base + LoRA) as one GGUF file")
    parser.add_argument("--type", default="f16", choices=gguf_write.TYPES, help="the merged model's tensor type (default: f16)")
    parser.add_argument("--gguf-adapter", metavar="FILE", help="write the LoRA alone as a llama.cpp GGUF adapter")
    parser.add_argument("--adapter-type", default="f32", choices=gguf_write.ADAPTER_TYPES,
                        help="the adapter's tensor type (default: f32)")
    parser.add_argument("--weights", metavar="URI", help="the base model's weights, when the state's own path is not here")


def read_adapter(uri: str) -> tuple[dict, LoraSpec, dict, str]:
    """(canonical LoRA tensors, spec, the tune's saved invocation, where they came from)."""
    store = open_store(uri)
    state = JobState(store, {})
    inv = state.invocation()
    if store.read("job.json") is None or inv is None:
        raise SpillpackError(f"{uri} holds no job state (no job.json or invocation.json)", "spillpack export <a tune's --state URI> --gguf model.gguf")
    if inv.get("command") != "tune":
        raise SpillpackError(f"{uri} is the state of a {inv.get('command')} job; export takes a tune's", f"spillpack status {uri}")
    o = inv["options"]
    raw = store.read(f"adapter/{PEFT_WEIGHTS}")
    if raw is not None:
        cfg = orjson.loads(store.read(f"adapter/{PEFT_CONFIG}") or b"{}")
        tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in st_load(raw).items()}
        spec = LoraSpec(rank=int(cfg.get("r", o["rank"])), alpha=float(cfg.get("lora_alpha", o["alpha"])),
                        targets=tuple(cfg.get("target_modules") or o["targets"].split(",")))
        return tensors, spec, inv, store.child_uri("adapter")
    latest = state.checkpoints.latest(lambda c: agrees(state, c))  # the checkpoint a resume of the tune would take
    if latest is None:
        raise SpillpackError(f"{uri} has no adapter yet: the tune has committed no checkpoint", f"spillpack resume {uri}")
    blob = st_load(state.read_file(latest, "state.safetensors"))
    tensors = {k.removeprefix("adapter."): v for k, v in blob.items() if k.startswith("adapter.")}
    spec = LoraSpec(rank=o["rank"], alpha=float(o["alpha"]), targets=tuple(t.strip() for t in o["targets"].split(",") if t.strip()))
    return tensors, spec, inv, f"{state.commit_uri(latest)} (step {latest.step}: the tune has not finished)"


def merged_weights(model_dir, tensors: dict, spec: LoraSpec) -> dict:
    """The engine's merge (the checkpoint's own float32 tensors + scale * B @ A), as `tune --merge` writes it."""
    from runtime.engines import OptimSpec
    from runtime.engines.registry import get_engine
    from runtime.engines.hardware import choose_engine

    engine = get_engine(choose_engine(None)[0])
    return engine.train_session(model_dir, spec, tensors, OptimSpec(), 0).merged_weights()


def main(ns: dict, events) -> int:
    if not ns.get("gguf") and not ns.get("gguf_adapter"):
        raise UsageError("export needs --gguf FILE or --gguf-adapter FILE", f"spillpack export {ns['state']} --gguf model.gguf")
    for flag, key in (("--gguf", "gguf"), ("--gguf-adapter", "gguf_adapter")):
        if ns.get(key):
            gguf_write.check_gguf_output(ns[key], flag)
    tensors, spec, inv, source = read_adapter(ns["state"])
    from runtime.models.ref import resolve_model

    model_dir = resolve_model(inv["arguments"]["model"], ns.get("weights") or inv["options"].get("weights"))
    gguf_write.gguf_arch(model_dir.config)  # an architecture GGUF cannot hold is refused before the merge
    name = inv["options"].get("name") or "spillpack"
    if ns.get("gguf"):
        weights = merged_weights(model_dir, tensors, spec)
        info = {}
        gguf_write.deliver(ns["gguf"], lambda p: info.update(gguf_write.write_model(p, weights, model_dir.config, model_dir.path,
                                                                                    ns["type"], name=name)))
        lines = gguf_write.ollama_lines(ns["gguf"], name)
        _tell(events, "gguf", f"wrote {ns['gguf']}: {info['architecture']} merged with the adapter from {source}, "
                              f"{info['tensors']} tensors in {info['type']}; to run it in Ollama:", lines,
              file=ns["gguf"], adapter=source, ollama=lines, **info)
    if ns.get("gguf_adapter"):
        info = {}
        gguf_write.deliver(ns["gguf_adapter"], lambda p: info.update(gguf_write.write_adapter(p, tensors, spec.alpha, model_dir.config,
                                                                                              ns["adapter_type"])))
        lines = [f"llama-server -m BASE.gguf --lora {ns['gguf_adapter']}   # BASE.gguf: {inv['arguments']['model']} as GGUF, unmerged"]
        _tell(events, "gguf_adapter", f"wrote {ns['gguf_adapter']}: the LoRA from {source} ({info['tensors']} tensors in "
                                      f"{info['type']}, alpha {spec.alpha:g}, rank {spec.rank}); with llama.cpp:", lines,
              file=ns["gguf_adapter"], adapter=source, llama_cpp=lines, **info)
    return 0


def _tell(events, event: str, head: str, lines: list[str], **fields) -> None:
    if events.headless:
        events.emit(event, **fields)
        return
    events.say(head)
    for line in lines:
        print(f"  {line}")
