"""First-start install of the wheels a bundle carries (torch with --with-torch, mlx with
--with-mlx, the --report-to trackers' libraries): unzipped once, atomically, into the bundle or SPILLPACK_HOME, never into the
system's Python; no pip, no network. Standard library only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from runtime.bootstrap.bundle import Bundle
from runtime.bootstrap.manifest import PRIVATE_DIR, WHEELS_DIR, Manifest
from runtime.base.signals import process_handler
from runtime.base.errors import SpillpackError


def unpack_wheel(whl: Path, dest: Path) -> None:
    """Install one wheel by unzipping it: its root is site-packages, plus NAME.data/{purelib,platlib}.
    Scripts and headers are not needed to import a package. Used by the packer too."""
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or ".." in parts or not parts[-1] or not parts[0]:
                continue
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)


def install_wheels(wheels: Path, target: Path, check=lambda whl: None) -> None:
    """Unpack every wheel in `wheels` into `target`, once, atomically.
    Concurrent first starts: each unpacks privately, the first rename wins, the others use it.
    A stop meanwhile abandons the unpacking at once (the process's handler raises Abandon: the
    job exits 75 with nothing to save); the partial copy is removed, never renamed, and the
    next start unpacks again."""
    if (target / ".complete").exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    handler = process_handler()
    try:
        with handler.setup() if handler else contextlib.nullcontext():
            for whl in sorted(wheels.glob("*.whl")):
                unpack_wheel(whl, tmp)
                check(whl)  # the one packed (its manifest entry), or the unpacked copy is removed, never used
        (tmp / ".complete").write_text("")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_dir(root: Path, manifest: Manifest) -> Path:
    """Inside the bundle when it is writable, else under SPILLPACK_HOME."""
    if os.access(root, os.W_OK):
        return root / PRIVATE_DIR / manifest.wheels_key
    home = os.environ.get("SPILLPACK_HOME") or str(Path.home() / ".spillpack")
    return Path(home).expanduser() / "wheels" / manifest.wheels_key


def ensure_engines(root: Path, manifest: Manifest, tag: str) -> None:
    """Make the carried wheels importable; refuse to start when no engine's framework is there."""
    carried = root / WHEELS_DIR / tag
    if (manifest.with_torch or manifest.with_mlx or manifest.trackers) and carried.is_dir():
        target = install_dir(root, manifest) / tag
        bundle = Bundle(root, manifest)
        install_wheels(carried, target, lambda whl: bundle.check_file(f"{WHEELS_DIR}/{tag}/{whl.name}"))
        sys.path.insert(0, str(target))
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("mlx") is None:
        raise SpillpackError(f"{sys.executable} has no torch (nor mlx), and this bundle carries none for {tag}",
                             "pip install torch, or SPILLPACK_PYTHON=/path/to/python-with-torch ./run.sh, "
                             "or spillpack pack ... --with-torch cpu")
