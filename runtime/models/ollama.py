"""The local Ollama store: a tag such as qwen2.5:7b or smollm2:135m resolved, offline, to the GGUF
blob Ollama keeps for it.

Ollama's layout (its types/model/name.go and manifest/ package): the store is `OLLAMA_MODELS`,
else `~/.ollama/models`. A name `[host/][namespace/]model[:tag]` defaults to host
registry.ollama.ai, namespace library and tag latest, and its manifest is the file
`manifests/<host>/<namespace>/<model>/<tag>`: a Docker distribution manifest (schemaVersion 2)
whose `layers` are blobs by digest; the layer of media type `application/vnd.ollama.image.model`
is the GGUF, at `blobs/sha256-<hex>` (a digest's ':' written as '-'). The config layer
(`application/vnd.docker.container.image.v1+json`) says the family and the quantization.

A blob is used only after its SHA-256 equals the digest the manifest names, hashed as a stream
(one megabyte at a time, whatever the model's size). The verdict is remembered per blob, size and
modification time under SPILLPACK_HOME/cache/ollama, so a 5 GB model is hashed once, not at
every start.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.base.errors import SpillpackError
from runtime.base.fileio import atomic_write, sha256_file
from runtime.base.paths import spillpack_home

MODEL_MEDIA = "application/vnd.ollama.image.model"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,79}$")  # a name part as Ollama allows it (its host also takes ':')


def store_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


@dataclass(frozen=True)
class StoreModel:
    name: str  # as the user typed it
    qualified: str  # host/namespace/model:tag
    manifest: Path
    blob: Path
    digest: str  # sha256:<hex>
    size: int
    family: str | None  # from the config layer, when it has one
    file_type: str | None


def parse_name(ref: str) -> tuple[str, str, str, str] | None:
    """(host, namespace, model, tag) as Ollama's ParseName reads `ref`, or None when it is no name
    (a path, a URI, empty parts)."""
    if not ref or "://" in ref or ref.startswith(("/", ".", "~")) or ref.endswith("/"):
        return None
    tag = DEFAULT_TAG
    if ref.rfind(":") > ref.rfind("/"):
        ref, tag = ref.rsplit(":", 1)
    parts = ref.split("/")
    if len(parts) > 3:
        return None
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts
    if not all(_PART.match(p) for p in (namespace, model, tag)) or not re.match(r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,349}$", host):
        return None
    return host, namespace, model, tag


def manifest_path(ref: str, root: Path | None = None) -> Path | None:
    parsed = parse_name(ref)
    if parsed is None:
        return None
    host, namespace, model, tag = parsed
    return (root or store_root()) / "manifests" / host / namespace / model / tag


def blob_path(digest: str, root: Path) -> Path | None:
    m = _DIGEST.match(digest or "")
    return root / "blobs" / f"sha256-{m.group(1)}" if m else None


def find(ref: str, root: Path | None = None, verify: bool = True) -> StoreModel | None:
    """The model `ref` names in the store, its blob checked; None when the store has no manifest
    for it. A manifest that is there but unusable is one line naming it."""
    root = root or store_root()
    path = manifest_path(ref, root)
    if path is None or not path.is_file():
        return None
    model = read_manifest(ref, path, root)
    if verify:
        check_blob(model)
    return model


def _bad(path: Path, what: str) -> SpillpackError:
    return SpillpackError(f"Ollama manifest {path} {what}", f"ollama pull {_name_of(path)} to fetch it again")


def short_name(manifest: Path) -> str:
    """The name a user types for a manifest (library models without host and namespace)."""
    return _name_of(manifest)


def _name_of(manifest: Path) -> str:
    host, namespace, model, tag = manifest.parts[-4:]
    short = model if (host, namespace) == (DEFAULT_HOST, DEFAULT_NAMESPACE) else (
        f"{namespace}/{model}" if host == DEFAULT_HOST else f"{host}/{namespace}/{model}")
    return f"{short}:{tag}"


def read_manifest(ref: str, path: Path, root: Path) -> StoreModel:
    try:
        if path.stat().st_size > 1 << 20:  # a manifest is a few hundred bytes; never read a huge file whole
            raise ValueError("it is larger than a manifest can be")
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
            raise ValueError("it has no list of layers")
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(path, f"is not a valid manifest ({e})")
    layers = [x for x in manifest["layers"] if isinstance(x, dict) and x.get("mediaType") == MODEL_MEDIA]
    if not layers:
        raise _bad(path, f"has no layer of media type {MODEL_MEDIA} (not a GGUF model)")
    layer = layers[0]
    blob = blob_path(str(layer.get("digest", "")), root)
    size = layer.get("size")
    if blob is None or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(path, f"names its model blob with digest {layer.get('digest')!r} and size {size!r}, not a sha256 digest and a size")
    family = file_type = None
    config = blob_path(str((manifest.get("config") or {}).get("digest", "")), root) if isinstance(manifest.get("config"), dict) else None
    if config is not None and config.is_file() and config.stat().st_size < 1 << 20:
        try:
            info = json.loads(config.read_text(encoding="utf-8"))
            family, file_type = info.get("model_family"), info.get("file_type")
        except (ValueError, UnicodeDecodeError, AttributeError):
            pass  # the config layer only describes; the model layer is what is used
    host, namespace, model, tag = path.parts[-4:]
    return StoreModel(ref, f"{host}/{namespace}/{model}:{tag}", path, blob, "sha256:" + blob.name[len("sha256-"):], size,
                      family if isinstance(family, str) else None, file_type if isinstance(file_type, str) else None)


def check_blob(model: StoreModel) -> None:
    """The blob is there, has the manifest's size, and hashes to its digest."""
    try:
        st = model.blob.stat()
    except FileNotFoundError:
        raise SpillpackError(f"the Ollama store's manifest {model.manifest} names blob {model.blob.name}, which is missing from "
                             f"{model.blob.parent}", f"ollama pull {_name_of(model.manifest)} to fetch it again")
    if st.st_size != model.size:
        raise SpillpackError(f"Ollama blob {model.blob} has {st.st_size} bytes, its manifest {model.manifest} says {model.size} "
                             "(truncated or replaced)", f"ollama pull {_name_of(model.manifest)} to fetch it again")
    seal = spillpack_home() / "cache" / "ollama" / f"{model.blob.name}.verified"
    stamp = f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"
    try:
        if seal.read_text() == stamp:
            return
    except OSError:
        pass
    got = "sha256:" + sha256_file(model.blob)
    if got != model.digest:
        raise SpillpackError(f"Ollama blob {model.blob} is corrupted: its SHA-256 is {got.split(':')[1][:12]}..., its manifest "
                             f"{model.manifest} names {model.digest.split(':')[1][:12]}...",
                             f"ollama rm {_name_of(model.manifest)} && ollama pull {_name_of(model.manifest)}")
    try:
        atomic_write(seal, stamp.encode(), durable=False)
    except OSError:
        pass  # a read-only home: it is hashed again next time


def list_models(root: Path | None = None) -> list[StoreModel]:
    """Every model manifest in the store (manifests/<host>/<namespace>/<model>/<tag>), unverified:
    listing never hashes gigabytes. A manifest that cannot be read is left out here (using it says why)."""
    root = root or store_root()
    base = root / "manifests"
    out = []
    if not base.is_dir():
        return out
    for path in sorted(p for p in base.glob("*/*/*/*") if p.is_file() and not p.name.startswith(".")):
        try:
            out.append(read_manifest(_name_of(path), path, root))
        except SpillpackError:
            continue
    return out
