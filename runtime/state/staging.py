"""Remote directories (weights, adapters) staged once into a local cache.

`stage("s3://b/weights/qwen", "weights")` -> SPILLPACK_HOME/cache/weights/<hash of the URI>/,
holding every object under the prefix. `.staged.json` there records each file's ETag and
size as listed by the store; a file is downloaded again only when those change, so a
restart on the same machine reads nothing but the listing. Files arrive under a temporary
name and are renamed when complete, and enter `.staged.json` only after that: a download
killed half-way never counts as cached. A lock file keeps two processes on one machine
from downloading the same files at once.
"""

import hashlib
import os
from pathlib import Path

import orjson

from runtime.errors import SpillpackError
from runtime.paths import spillpack_home
from runtime.fileio import atomic_write, file_lock
from runtime.state.store import open_store

MANIFEST = ".staged.json"


def cache_dir(uri: str, kind: str) -> Path:
    return spillpack_home() / "cache" / kind / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:24]


def stage(uri: str, kind: str = "weights") -> Path:
    store = open_store(uri)
    objects = [(k, size, etag) for k, size, etag in store.list_meta("") if not _hidden(k)]
    if not objects:
        raise SpillpackError(f"nothing under {uri} to use as {kind}", f"aws s3 ls {uri.rstrip('/')}/")
    dest = cache_dir(uri, kind)
    dest.mkdir(parents=True, exist_ok=True)
    with file_lock(dest / ".lock"):
        manifest = _load(dest / MANIFEST)
        for torn in dest.rglob(".*.tmp"):  # a download killed half-way; under the lock nobody else is writing
            torn.unlink(missing_ok=True)
        wanted = {k for k, _, _ in objects}
        for stale in sorted(set(manifest) - wanted):  # gone from the store since the last staging
            manifest.pop(stale)
            (dest / stale).unlink(missing_ok=True)
        for key, size, etag in objects:
            path = dest / key
            entry = {"etag": etag, "size": size}
            if manifest.get(key) == entry and path.is_file() and path.stat().st_size == size:
                continue
            manifest.pop(key, None)
            atomic_write(dest / MANIFEST, orjson.dumps(manifest))  # the old entry no longer vouches for the file
            if not store.get_file(key, path):
                raise SpillpackError(f"{store.child_uri(key)} disappeared while staging {uri}", "run the command again")
            if path.stat().st_size != size:
                path.unlink()
                raise SpillpackError(f"{store.child_uri(key)} changed while staging {uri}", "run the command again")
            manifest[key] = entry
            atomic_write(dest / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS))
        (dest / ".uri").write_text(uri + "\n")  # for a person looking at the cache
    return dest


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def _load(path: Path) -> dict:
    try:
        data = orjson.loads(path.read_bytes())
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}
