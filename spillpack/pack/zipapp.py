"""spillpack.pyz: a shiv zipapp of runtime/ and its dependencies, byte-identical for the same inputs.

Inside its site-packages: runtime/, the pure-Python wheels, and one directory per target
platform under _spillpack_platforms/ with that platform's compiled wheels (abi3 extension
modules have the same file name on every platform, so they cannot share one directory);
runtime.bootstrap.platforms puts the one that fits the machine first on sys.path.

The archive's __main__ runs runtime/bootstrap/early.py (copied to the root as
_spillpack_early.py) before shiv's bootstrap, so a stop during the first start's unpacking is
recorded and exits 75 instead of killing the process with 143.

Reproducible: shiv sorts entries and takes its build id from a hash of the contents; we
fix the timestamp (shiv's 1980 default), the file modes, the shebang and the order in
which wheels are unpacked. A finished pyz is cached by a hash of its inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import runtime
from runtime.bootstrap import early
from runtime.bootstrap.platforms import PLATFORM_DIR
from runtime.bootstrap.wheels import unpack_wheel

from .wheels import dist_of, is_pure

ENTRY_POINT = "runtime.entry:bundle"
SHEBANG = "/usr/bin/env python3"


def runtime_files() -> list[tuple[str, Path]]:
    src = Path(runtime.__file__).resolve().parent
    out = []
    for p in sorted(src.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            out.append(("runtime/" + p.relative_to(src).as_posix(), p))
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def layout(per_platform: dict[str, list[Path]]) -> tuple[list[Path], dict[str, list[Path]]]:
    """(wheels every platform shares, {tag: its own wheels}). A pure wheel is shared only
    when every platform resolved the same file."""
    tags = sorted(per_platform)
    common = [w for w in per_platform[tags[0]] if is_pure(w) and all(any(o.name == w.name for o in per_platform[t]) for t in tags)]
    names = {w.name for w in common}
    own = {t: [w for w in per_platform[t] if w.name not in names] for t in tags}
    return common, own


def carries(per_platform: dict[str, list[Path]]) -> dict:
    common, own = layout(per_platform)
    return {"common": [dist_of(w) for w in common], **{t: [dist_of(w) for w in ws] for t, ws in own.items()}}


def build(per_platform: dict[str, list[Path]], dest: Path, cache: Path) -> None:
    common, own = layout(per_platform)
    key_parts = {
        "shiv": _shiv_version(),
        "entry": ENTRY_POINT,
        "main": f"{early.MODULE}:main",
        "runtime": [(rel, _sha(p)) for rel, p in runtime_files()],
        "common": [(w.name, _sha(w)) for w in common],
        "own": {t: [(w.name, _sha(w)) for w in ws] for t, ws in own.items()},
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
    cached = cache / f"{key}.pyz"
    if cached.is_file():
        shutil.copyfile(cached, dest)
        return
    with tempfile.TemporaryDirectory(prefix="spillpack-stage-") as tmp:
        stage = Path(tmp) / "site-packages"
        for rel, p in runtime_files():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, stage / rel)
        for w in common:
            unpack_wheel(w, stage)
        for tag, ws in own.items():
            for w in ws:
                unpack_wheel(w, stage / PLATFORM_DIR / tag)
        for p in stage.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        _create(stage, dest)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=".pyz.")
    os.close(fd)
    shutil.copyfile(dest, tmp_name)
    os.replace(tmp_name, cached)


def _shiv_version() -> str:
    from shiv.__version__ import __version__

    return __version__


def _create(stage: Path, dest: Path) -> None:
    from shiv.bootstrap.environment import Environment
    from shiv.builder import create_archive
    from shiv.constants import BUILD_AT_TIMESTAMP_FORMAT, SOURCE_DATE_EPOCH_DEFAULT

    built_at = datetime.fromtimestamp(SOURCE_DATE_EPOCH_DEFAULT, tz=timezone.utc).strftime(BUILD_AT_TIMESTAMP_FORMAT)
    # compile_pyc off: compiling numpy at first start costs seconds, and Python writes each
    # .pyc atomically on first import anyway. build_id None: shiv hashes the contents.
    env = Environment(built_at=built_at, shiv_version=_shiv_version(), entry_point=ENTRY_POINT, compile_pyc=False,
                      reproducible=True)
    # The archive's __main__ runs runtime/bootstrap/early.py first (copied to the root, where
    # zipimport finds it before anything is unpacked): a stop during shiv's unpacking exits 75.
    create_archive([stage], target=dest, interpreter=SHEBANG, main=f"{early.MODULE}:main", env=env, compressed=True)
    with zipfile.ZipFile(dest, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        info = zipfile.ZipInfo(f"{early.MODULE}.py", date_time=time.gmtime(SOURCE_DATE_EPOCH_DEFAULT)[:6])
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o644 << 16
        archive.writestr(info, Path(early.__file__).read_bytes())
