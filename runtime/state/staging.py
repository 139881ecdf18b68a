"""Remote directories (weights, adapters) staged once into a local cache.

`stage("s3://b/weights/qwen", "weights")` -> SPILLPACK_HOME/cache/weights/<hash of the URI>/,
holding every object under the prefix. `.staged.json` there records each file's ETag and
size as listed by the store; a file is downloaded again only when those change, so a
restart on the same machine reads nothing but the listing. Files arrive under a temporary
name and are renamed when complete, and enter `.staged.json` only after that: a download
killed half-way never counts as cached. A lock file keeps two processes on one machine
from downloading the same files at once.

A stop (SIGTERM, SIGHUP) during staging abandons the download at once: each file is fetched
by a helper thread while the main thread watches for the stop, so a stalled or long transfer
never holds the exit; its temporary file is removed by the next staging.
"""

import hashlib
import threading
from pathlib import Path

import orjson

from runtime.base.progress import ByteProgress
from runtime.base.signals import process_handler
from runtime.base.errors import SpillpackError
from runtime.base.paths import spillpack_home
from runtime.base.fileio import atomic_write, file_lock
from runtime.state.uri import open_store

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
        todo = [(k, size, etag) for k, size, etag in objects
                if not (manifest.get(k) == {"etag": etag, "size": size} and (dest / k).is_file() and (dest / k).stat().st_size == size)]
        progress = ByteProgress(f"staging {uri}", sum(size for _, size, _ in todo))
        fetched = 0
        for key, size, etag in todo:
            path = dest / key
            entry = {"etag": etag, "size": size}
            manifest.pop(key, None)
            atomic_write(dest / MANIFEST, orjson.dumps(manifest))  # the old entry no longer vouches for the file
            if not _fetch(store, key, path, lambda: progress.update(fetched + _partial(path))):
                raise SpillpackError(f"{store.child_uri(key)} disappeared while staging {uri}", "run the command again")
            if path.stat().st_size != size:
                path.unlink()
                raise SpillpackError(f"{store.child_uri(key)} changed while staging {uri}", "run the command again")
            manifest[key] = entry
            atomic_write(dest / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS))
            fetched += size
        progress.close()
        (dest / ".uri").write_text(uri + "\n")  # for a person looking at the cache
    return dest


def _partial(path: Path) -> int:
    """Bytes of `path` downloaded so far: its temporary files (Store.get_file's names)."""
    total = 0
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            total += tmp.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _fetch(store, key: str, path: Path, tick=lambda: None) -> bool:
    """store.get_file, abandoned (Abandon raised here, in the main thread) when a stop comes."""
    handler = process_handler()
    if handler is None or threading.current_thread() is not threading.main_thread():
        return store.get_file(key, path)
    handler.check()
    result: dict = {}

    def fetch():
        try:
            result["ok"] = store.get_file(key, path)
        except BaseException as e:  # handed to the main thread, which raises it
            result["error"] = e

    worker = threading.Thread(target=fetch, name="spillpack-staging", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
        handler.check()
        tick()
    if "error" in result:
        raise result["error"]
    return result["ok"]


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def _load(path: Path) -> dict:
    try:
        data = orjson.loads(path.read_bytes())
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}
