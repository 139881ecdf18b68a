"""Which local files a job reads, and where each one goes in the bundle.

Data (and adapters, folders) always go under files/data/, keeping their layout below the
deepest directory they share; model weights go under files/weights/NAME/ only with
--include-weights. s3:// stays as written (read on the target with its credentials);
outputs (--out, --state) stay as written: they name places on the target.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from runtime.bootstrap.manifest import BUNDLE_PREFIX
from runtime.base.errors import SpillpackError
from runtime.jobs.adapters import parse as adapter_parts
from runtime.models.gguf.model import is_gguf
from runtime.models.ref import TAGS

# Options whose value is a file or directory the job reads, by role.
DATA_OPTIONS = ("data", "input", "evals", "prompts", "folder", "adapter", "init_adapter", "val")
MODEL_OPTIONS = ("model", "teacher", "student")  # a tag, tiny, or a model directory
WEIGHTS_OPTION = "weights"


@dataclass
class Plan:
    """bundle-relative path -> local source file, and the rewritten option values."""

    files: dict[str, Path] = field(default_factory=dict)
    rewrites: dict[str, str] = field(default_factory=dict)
    not_bundled: list[str] = field(default_factory=list)  # local weights left as written (no --include-weights)


def _local(name: str, value: str) -> Path | None:
    """The local path behind a value, None for s3://; a scheme nobody can read from a bundle is refused."""
    if value.startswith("s3://"):
        return None
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif "://" in value:
        raise SpillpackError(f"--{name.replace('_', '-')} {value}: a {value.split('://')[0]}:// URI cannot be made bundle-relative "
                             "or read on the target", "a local path (it is copied into the bundle) or an s3:// URI")
    return Path(os.path.abspath(os.path.expanduser(value)))


def _build_folder(path: Path) -> list[Path]:
    """A build folder: only the files a build reads (runtime.jobs.build.FOLDER_FILES), never the
    rest of the folder (.env, .aws/, .git/, earlier bundles), and no link that leaves the folder."""
    from runtime.jobs.build import FOLDER_FILES

    if not path.is_dir():
        raise SpillpackError(f"build folder {path} does not exist or is not a directory", f"ls {path.parent}")
    root = path.resolve()
    out = []
    for fname in FOLDER_FILES:
        p = path / fname
        if not os.path.lexists(p):
            continue
        real = p.resolve()
        if not real.is_relative_to(root):
            raise SpillpackError(f"build folder {path}: {fname} links to {real}, outside the folder; pack does not follow it",
                                 f"copy the file into {path} instead of linking it")
        if not real.is_file():
            raise SpillpackError(f"build folder {path}: {fname} is not a regular file, so it cannot be packed", f"ls -l {p}")
        out.append(p)
    if not out:
        raise SpillpackError(f"build folder {path} has none of {', '.join(FOLDER_FILES)}", f"ls {path}")
    return out


def _files_under(name: str, path: Path) -> list[Path]:
    if not path.exists():
        kind = "directory" if name in ("folder", "adapter", WEIGHTS_OPTION) else "file"
        raise SpillpackError(f"--{name.replace('_', '-')}: {kind} {path} does not exist", f"ls {path.parent}")
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SpillpackError(f"--{name.replace('_', '-')}: {path} is not a regular file or directory, so it cannot be made "
                             "bundle-relative", f"copy it to a regular file and pack that")
    out = []
    for dirpath, dirs, files in os.walk(path):
        # Never a dot-file or dot-directory (.git, .env, .cache): no job reads them, and they hold secrets.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(f for f in files if not f.startswith(".")):
            p = Path(dirpath, f)
            if not stat.S_ISREG(p.stat().st_mode):
                raise SpillpackError(f"{p} is not a regular file, so it cannot be made bundle-relative", f"remove it from {path}")
            out.append(p)
    if not out:
        raise SpillpackError(f"--{name.replace('_', '-')}: {path} is an empty directory", f"ls {path}")
    return out


def _store_gguf(values: dict, include_weights: bool) -> tuple[str, Path] | None:
    """(label, blob) when the job's weights are a GGUF of the local Ollama store: pinned as --weights
    by --emit-config, or a tag only the store holds. A cluster has no such store, so without
    --include-weights this is refused with the two ways to get the file there."""
    from runtime.models import ollama
    from runtime.models.ref import MODEL_KEYS, store_weights, tag_dirname

    weights = values.get(WEIGHTS_OPTION)
    tag, blob = None, None
    if isinstance(weights, str) and weights and "://" not in weights:
        path = Path(os.path.abspath(os.path.expanduser(weights)))
        if path.is_file() and path.parent.name == "blobs" and path.name.startswith("sha256-") and (path.parent.parent / "manifests").is_dir():
            blob = path
            tag = next((values[k] for k in MODEL_KEYS if isinstance(values.get(k), str) and ollama.parse_name(values[k])), path.name)
    elif not weights:
        pinned = store_weights(values, values)
        if pinned is not None:
            tag, blob = pinned[1], pinned[2].blob
    if blob is None:
        return None
    label = tag_dirname(tag.split("/")[-1])
    if not include_weights:
        size = blob.stat().st_size
        raise SpillpackError(
            f"the job's weights are {tag} from the local Ollama store ({blob}, {size / 1e6:.0f} MB), which the target does not have",
            f"spillpack pack ... --include-weights to carry the GGUF, or stage it: aws s3 cp {blob} "
            f"s3://BUCKET/models/{label}/{label}.gguf and --weights s3://BUCKET/models/{label}/ in the job")
    return label, blob


def plan(values: dict, include_weights: bool) -> Plan:
    result = Plan()
    store = _store_gguf(values, include_weights)
    if store is not None:  # the GGUF as it is, under a .gguf name, in a directory of its own (checked whole at start)
        label, blob = store
        result.rewrites[WEIGHTS_OPTION] = f"{BUNDLE_PREFIX}weights/{label}"
        result.files[f"{BUNDLE_PREFIX}weights/{label}/{label}.gguf"] = blob
        values = {k: v for k, v in values.items() if k != WEIGHTS_OPTION}
    data: dict[tuple[str, int], Path] = {}  # (option, which of its values: a row job's named adapters are many)
    parts: dict[str, list[tuple[str | None, str]]] = {}
    for name in DATA_OPTIONS:
        value = values.get(name)
        if isinstance(value, str) and value:
            parts[name] = adapter_parts(value) if name == "adapter" else [(None, value)]
            for i, (_, src) in enumerate(parts[name]):
                path = _local(name, src)
                if path is not None:
                    data[name, i] = path
    weights: dict[str, Path] = {}
    for name in (*MODEL_OPTIONS, WEIGHTS_OPTION):
        value = values.get(name)
        if not isinstance(value, str) or not value or value == "tiny" or value in TAGS:
            continue
        if store is not None and name in MODEL_OPTIONS and not os.path.exists(os.path.expanduser(value)):
            continue  # the store's tag: its GGUF is carried above
        path = _local(name, value)
        if path is None:
            continue
        if name in MODEL_OPTIONS and not path.is_dir() and not is_gguf(path):
            continue  # not a directory: the runtime's model lookup reports it as it always does
        if include_weights:
            weights[name] = path
        else:
            result.not_bundled.append(f"--{name} {value}")

    if data:
        tops = [p if p.is_dir() else p.parent for p in data.values()]
        file_lists = {key: _build_folder(p) if key[0] == "folder" else _files_under(key[0], p) for key, p in data.items()}
        common = Path(os.path.commonpath([str(t) for t in tops]))
        for key, path in data.items():
            for f in file_lists[key]:
                result.files[BUNDLE_PREFIX + "data/" + f.relative_to(common).as_posix()] = f
        for name, values_of in parts.items():
            if not any((name, i) in data for i in range(len(values_of))):
                continue
            out = []
            for i, (label, src) in enumerate(values_of):
                if (name, i) in data:
                    rel = data[name, i].relative_to(common).as_posix()
                    src = BUNDLE_PREFIX + "data" + ("" if rel == "." else "/" + rel)
                out.append(src if label is None else f"{label}={src}")
            result.rewrites[name] = ",".join(out)
    used: set[str] = set()
    for name, path in weights.items():
        files = _files_under(name, path)
        base = (path.stem if path.is_file() else path.name) or "model"  # one GGUF file: a directory of its own
        label, n = base, 2
        while label in used:
            label, n = f"{base}-{n}", n + 1
        used.add(label)
        result.rewrites[name] = f"{BUNDLE_PREFIX}weights/{label}"
        for f in files:
            rel = f.name if path.is_file() else f.relative_to(path).as_posix()
            result.files[f"{BUNDLE_PREFIX}weights/{label}/{rel}"] = f
    return result


def uses_s3(values: dict) -> bool:
    return any(isinstance(v, str) and v.startswith("s3://") for v in values.values())
