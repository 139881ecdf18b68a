"""What a model reference (`tiny`, a tag, a directory, a URI) names, and checks that it is usable."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.base.errors import SpillpackError
from runtime.base.paths import spillpack_home
from runtime.models.config_check import check_model_config
from runtime.models import ollama
from runtime.models.arch import architecture
from runtime.models.gguf.model import find_gguf
from runtime.models.weights import read_safetensors_header, weight_files
from runtime.state.store import local_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Tag:
    arch: str
    files: tuple[str, ...]  # besides config.json and the tokenizer files
    hf_repo: str  # where the weights come from, for the hint in error messages


SINGLE, SHARDED = ("model.safetensors",), ("model.safetensors.index.json",)
# Every tag a user types: its architecture and the Hugging Face repository its files come from
# (instruct/chat variants; Qwen3's are hybrid thinking models). Gemma 3 4B and up ship as
# image-text models (model_type gemma3), of which the language model is used.
TAGS = {
    "qwen2.5:0.5b": Tag("qwen2", SINGLE, "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5:1.5b": Tag("qwen2", SINGLE, "Qwen/Qwen2.5-1.5B-Instruct"),
    "qwen2.5:3b": Tag("qwen2", SHARDED, "Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5:7b": Tag("qwen2", SHARDED, "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5:14b": Tag("qwen2", SHARDED, "Qwen/Qwen2.5-14B-Instruct"),
    "qwen3:0.6b": Tag("qwen3", SINGLE, "Qwen/Qwen3-0.6B"),
    "qwen3:1.7b": Tag("qwen3", SHARDED, "Qwen/Qwen3-1.7B"),
    "qwen3:4b": Tag("qwen3", SHARDED, "Qwen/Qwen3-4B"),
    "qwen3:8b": Tag("qwen3", SHARDED, "Qwen/Qwen3-8B"),
    "qwen3:14b": Tag("qwen3", SHARDED, "Qwen/Qwen3-14B"),
    "qwen3:32b": Tag("qwen3", SHARDED, "Qwen/Qwen3-32B"),
    "qwen3:30b-a3b": Tag("qwen3_moe", SHARDED, "Qwen/Qwen3-30B-A3B"),
    "llama3.2:1b": Tag("llama", SINGLE, "meta-llama/Llama-3.2-1B-Instruct"),
    "llama3.2:3b": Tag("llama", SHARDED, "meta-llama/Llama-3.2-3B-Instruct"),
    "llama3.1:8b": Tag("llama", SHARDED, "meta-llama/Llama-3.1-8B-Instruct"),
    "gemma3:1b": Tag("gemma3_text", SINGLE, "google/gemma-3-1b-it"),
    "gemma3:4b": Tag("gemma3", SHARDED, "google/gemma-3-4b-it"),
    "gemma3:12b": Tag("gemma3", SHARDED, "google/gemma-3-12b-it"),
    "gemma3:27b": Tag("gemma3", SHARDED, "google/gemma-3-27b-it"),
    "mistral:7b": Tag("mistral", SHARDED, "mistralai/Mistral-7B-Instruct-v0.3"),
    "phi4-mini": Tag("phi3", SHARDED, "microsoft/Phi-4-mini-instruct"),
    "phi3.5-mini": Tag("phi3", SHARDED, "microsoft/Phi-3.5-mini-instruct"),
}


@dataclass(frozen=True)
class ModelDir:
    path: Path
    config: dict = field(hash=False, compare=False)
    arch: str

    @property
    def is_gguf(self) -> bool:
        """A GGUF file (path is the file; an Ollama blob has no .gguf suffix): config, tokenizer and weights all come from it."""
        return self.path.is_file()

    def fingerprint(self) -> str:
        """sha256 over config.json and each safetensors file's name, size and header (a GGUF:
        over its header and size).

        Reads a few KB per file, never the tensors, so it is cheap enough to call on every
        start; a state written for other weights is then told apart from this one.
        """
        if self.is_gguf:
            from runtime.models.gguf.model import fingerprint

            return fingerprint(self.path)
        h = hashlib.sha256()
        h.update((self.path / "config.json").read_bytes())
        for f in sorted(self.path.glob("*.safetensors")):
            h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
            h.update(read_safetensors_header(f))
        return h.hexdigest()


def local_path(uri: str, kind: str = "weights") -> Path:
    """A local path for a URI: a path or file:// as it is, an s3:// prefix staged locally.

    s3:// prefixes are staged into the local cache (downloaded once per ETag and size; see
    runtime/state/staging.py), `kind` naming the cache ("weights", "adapters"); everything else is
    parsed by the store's `local_file`.
    """
    path = local_file(uri)
    if path is None:
        from runtime.state.staging import stage

        return stage(uri, kind)
    return path


def resolve_model(ref: str, weights: str | None = None) -> ModelDir:
    if ref == "tiny":
        from runtime.models.tiny import ensure_tiny

        return validate(ensure_tiny())
    if ref in TAGS:
        return validate(find_tag(ref, weights), TAGS[ref])
    path = local_path(ref)
    if (gguf := find_gguf(path)) is not None:
        return validate_gguf(gguf)
    if path.is_dir():
        return validate(path)
    if ollama.parse_name(ref) is not None:  # a name Ollama knows: its GGUF from --weights (as --emit-config pins it) or the store
        if weights is not None and (gguf := find_gguf(local_path(weights))) is not None:
            return validate_gguf(gguf)
        if (found := ollama.find(ref)) is not None:
            return validate_gguf(found.blob)
    check_tag(ref)
    raise SpillpackError(
        f"model {ref!r} is neither a known tag nor a local model directory",
        "as the job's MODEL: tiny, a tag such as qwen2.5:0.5b with --weights /path/to/weights, or /path/to/hf-model-dir",
    )


MODEL_KEYS = ("model", "teacher", "student")  # the job arguments and options that name a model


def looks_like_tag(ref: str) -> bool:
    return ":" in ref and "/" not in ref and "://" not in ref


def check_tag(ref: str) -> None:
    """Refuse a reference written like a tag (name:size) that is not a known one nor in the local Ollama store."""
    if looks_like_tag(ref) and ref not in TAGS and ollama.find(ref, verify=False) is None:
        known = ", ".join(["tiny", *TAGS])
        raise SpillpackError(f"unknown model tag {ref!r} (known: {known}; not in the Ollama store at {ollama.store_root()} either)",
                             "tiny, or a Hugging Face model directory, as the job's MODEL (spillpack models lists the tags)")


def store_weights(arguments: dict, options: dict) -> tuple[str, str, "ollama.StoreModel"] | None:
    """(option, tag, store model) when the job's model is a tag that only the local Ollama store
    holds here (no --weights, no SPILLPACK_HOME/models copy): the blob is verified, and
    --emit-config and pack pin it as the job's --weights."""
    if options.get("weights"):
        return None
    for key in MODEL_KEYS:
        ref = arguments.get(key, options.get(key))
        if not isinstance(ref, str) or ref == "tiny" or ollama.parse_name(ref) is None or Path(ref).expanduser().exists():
            continue
        if ref in TAGS and (spillpack_home() / "models" / tag_dirname(ref)).is_dir():
            continue
        found = ollama.find(ref)
        if found is not None:
            return key, ref, found
    return None


def check_model_tags(*sections: dict) -> None:
    """Every model a job names, checked where the job is written down (--emit-config, pack):
    a tag unknown here is refused on the laptop, not on the cluster."""
    for section in sections:
        for key in MODEL_KEYS:
            if isinstance(section.get(key), str):
                check_tag(section[key])


def find_tag(tag: str, weights: str | None) -> Path:
    looked = []
    if weights is not None:
        path = local_path(weights)
        if (gguf := find_gguf(path)) is not None:
            return gguf
        if path.is_dir():
            return path
        looked.append(f"--weights {weights}")
    home = spillpack_home() / "models" / tag_dirname(tag)
    if home.is_dir():
        return home
    looked.append(str(home))
    if (found := ollama.find(tag)) is not None:
        return found.blob
    looked.append(f"the Ollama store at {ollama.store_root()}")
    raise SpillpackError(
        f"no weights for {tag} (looked in {', '.join(looked[:-1])} and {looked[-1]}); download {TAGS[tag].hf_repo} first",
        f"MODEL {tag} with --weights /path/to/{tag_dirname(tag)}",
    )


def tag_dirname(tag: str) -> str:
    # ':' is not allowed in Windows paths and awkward in shells.
    return tag.replace(":", "-")


def validate_gguf(path: Path, tag: Tag | None = None) -> ModelDir:
    """Check a GGUF file is a loadable model (header, architecture, tensor types, tokenizer)."""
    from runtime.models.gguf.model import check

    config = check(path)
    architecture_ = architecture(config, str(path))
    arch = architecture_.model_type
    from runtime.models.gguf.config import key_names
    from runtime.models.gguf.model import open_gguf, tensor_shapes

    check_model_config(architecture_.effective_config(config), architecture_.args, str(path),  # as a directory's config is
                       tensor_shapes(path), key_names(open_gguf(path)))
    # A GGUF holds Gemma 3's language model only, whichever size the tag names.
    if tag is not None and arch != tag.arch and {arch, tag.arch} != {"gemma3", "gemma3_text"}:
        raise SpillpackError(f"{path} holds a {arch} model, but the tag expects {tag.arch!r}",
                             f"--weights pointing at a GGUF of {tag.hf_repo}")
    return ModelDir(path=path.resolve(), config=config, arch=arch)


def validate(path: Path, tag: Tag | None = None) -> ModelDir:
    """Check a directory is a loadable HF model; each failure names the file at fault."""
    if (gguf := find_gguf(path)) is not None:
        return validate_gguf(gguf, tag)
    config_file = path / "config.json"
    if not config_file.exists():
        raise SpillpackError(f"no config.json in {path}", "a Hugging Face model directory as the job's MODEL or --weights")
    try:
        config = json.loads(config_file.read_text())
        assert isinstance(config, dict), "not a JSON object"
    except (ValueError, AssertionError, UnicodeDecodeError) as e:
        raise SpillpackError(f"{config_file} is not valid JSON ({e})", f"re-download the model into {path}")
    for name in TOKENIZER_FILES:
        if not (path / name).exists():
            raise SpillpackError(f"no {name} in {path}", f"copy the tokenizer files of the model into {path}")
    architecture_ = architecture(config, str(config_file))
    arch = architecture_.model_type
    config = architecture_.effective_config(config)
    if tag is not None and arch != tag.arch:
        raise SpillpackError(
            f"{config_file} has model_type {arch!r}, but the tag expects {tag.arch!r}",
            f"--weights pointing at a download of {tag.hf_repo}",
        )
    shapes = {}
    for f in weight_files(path):
        if not f.exists():
            raise SpillpackError(f"{f.name} is named in model.safetensors.index.json but missing from {path}", f"re-download the weights into {path}")
        shapes.update((k, v["shape"]) for k, v in json.loads(read_safetensors_header(f)).items() if k != "__metadata__")
    check_model_config(config, architecture_.args, str(config_file), shapes)  # every field the engines read, before they read it
    return ModelDir(path=path.resolve(), config=config, arch=arch)
