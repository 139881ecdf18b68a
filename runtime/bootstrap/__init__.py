"""Running from a bundle: what `run.sh` starts (the zipapp's entry point).

Before anything imports a compiled module, pick the bundled compiled packages that fit this
machine (the zipapp carries one directory of them per target platform, because abi3
extension modules have the same file name on every platform), install bundled torch wheels
on first start, then hand over to the CLI. Every bundled file the job reads is checked
against MANIFEST.json; `run.sh --verify` checks them all.

Imports only the standard library at module level: it runs before sys.path is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from runtime.errors import SpillpackError  # stdlib-only, safe before sys.path is complete

MANIFEST = "MANIFEST.json"
PLATFORM_DIR = "_spillpack_platforms"  # inside the zipapp's site-packages
WHEELS_DIR = "wheels"
BUNDLE_PREFIX = "files/"  # every bundle-relative path in files/job.json starts with this

_TAG = re.compile(r"^(manylinux_(\d+)_(\d+)|macosx_(\d+)_(\d+))_(x86_64|aarch64|arm64)$")


# -- platform tags -------------------------------------------------------------------


def parse_tag(tag: str) -> tuple[str, tuple[int, int], str] | None:
    """'manylinux_2_17_x86_64' -> ('linux', (2, 17), 'x86_64'); None when not a tag we support."""
    m = _TAG.match(tag)
    if not m:
        return None
    if m.group(2):
        return "linux", (int(m.group(2)), int(m.group(3))), m.group(6)
    return "darwin", (int(m.group(4)), int(m.group(5))), m.group(6)


def this_machine() -> tuple[str, tuple[int, int], str]:
    """(os, version, arch) in the terms of parse_tag: glibc version on Linux, macOS version on macOS."""
    arch = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "arm64" if sys.platform == "darwin" else "aarch64"}.get(arch, arch)
    if sys.platform == "darwin":
        parts = (platform.mac_ver()[0] or "0.0").split(".") + ["0"]
        return "darwin", (int(parts[0]), int(parts[1])), arch
    libc = ""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # 'glibc 2.36'; musl has none
    except (ValueError, OSError):
        pass
    m = re.search(r"(\d+)\.(\d+)", libc)
    return sys.platform, ((int(m.group(1)), int(m.group(2))) if m else (0, 0)), arch


def runs_here(tag: str, machine=None) -> bool:
    parsed = parse_tag(tag)
    if parsed is None:
        return False
    os_, version, arch = parsed
    m_os, m_version, m_arch = machine or this_machine()
    return os_ == m_os and arch == m_arch and m_version >= version


def describe_machine(machine=None) -> str:
    os_, version, arch = machine or this_machine()
    what = {"linux": "glibc", "darwin": "macOS"}.get(os_, os_)
    return f"{os_} {arch} ({what} {version[0]}.{version[1]})" if version != (0, 0) else f"{os_} {arch}"


# -- where the bundle is -------------------------------------------------------------


def bundle_root() -> Path | None:
    """The bundle directory when this process runs a bundle's spillpack.pyz, else None."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is None or argv0.suffix != ".pyz":
        return None
    root = argv0.resolve().parent
    return root if (root / MANIFEST).is_file() else None


def load_manifest(root: Path) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SpillpackError(f"{root / MANIFEST} is unreadable ({e})", "copy the bundle again")


# -- integrity -----------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _mismatch(rel: str, why: str) -> SpillpackError:
    return SpillpackError(f"bundled file {rel} {why}; the bundle is damaged", "copy the bundle again, then ./run.sh --verify")


def check_file(root: Path, manifest: dict, rel: str, data: bytes | None = None) -> None:
    """Compare one bundled file (or the bytes just read from it) with the manifest."""
    entry = manifest["files"].get(rel)
    if entry is None:
        raise _mismatch(rel, "is not in MANIFEST.json")
    if data is None:
        path = root / rel
        if not path.is_file():
            raise _mismatch(rel, "is missing")
        size, digest = path.stat().st_size, None
        if size == entry["size"]:
            digest = file_sha256(path)
    else:
        size, digest = len(data), hashlib.sha256(data).hexdigest() if len(data) == entry["size"] else None
    if size != entry["size"]:
        raise _mismatch(rel, f"has {size} bytes, not {entry['size']}")
    if digest != entry["sha256"]:
        raise _mismatch(rel, "does not match its SHA-256 in MANIFEST.json")


def verify_all(root: Path) -> int:
    manifest = load_manifest(root)
    for rel in sorted(manifest["files"]):
        check_file(root, manifest, rel)
    return len(manifest["files"])


class _Active:
    root: Path | None = None
    manifest: dict | None = None


def check_read(path: str | Path, data: bytes) -> None:
    """Called with the bytes of every data file the runtime reads: a bundled file must match."""
    if _Active.root is None:
        return
    try:
        rel = Path(path).resolve().relative_to(_Active.root).as_posix()
    except ValueError:
        return  # not inside the bundle
    if rel in _Active.manifest["files"]:
        check_file(_Active.root, _Active.manifest, rel, data)


def localize(values: dict) -> None:
    """Make `files/...` values absolute under the bundle (run.sh may start from any cwd),
    and check every bundled file inside a bundled directory now: weights and adapters are read
    by libraries that do not go through check_read (a single file is checked as it is read)."""
    if _Active.root is None:
        return
    for key, value in values.items():
        if isinstance(value, str) and value.startswith(BUNDLE_PREFIX):
            values[key] = str(_Active.root / value)
            prefix = value.rstrip("/") + "/"
            for rel in sorted(_Active.manifest["files"]):
                if rel.startswith(prefix):
                    check_file(_Active.root, _Active.manifest, rel)


# -- compiled packages and torch -----------------------------------------------------


def activate_platform(manifest: dict) -> str:
    """Put the compiled packages built for this machine first on sys.path; return the tag."""
    site = Path(__file__).resolve().parent.parent
    tags = manifest.get("platforms", [])
    want = manifest.get("python", "")
    have = "%d.%d" % sys.version_info[:2]
    if want and want != have:
        raise SpillpackError(f"this bundle's compiled parts are for Python {want}; this is Python {have}",
                             f"SPILLPACK_PYTHON=python{want} ./run.sh, or spillpack pack ... --python {have}")
    for tag in tags:
        if runs_here(tag):
            sys.path.insert(0, str(site / PLATFORM_DIR / tag))
            return tag
    raise SpillpackError(f"this bundle's compiled parts are for {', '.join(tags)}; this machine is {describe_machine()}",
                         f"spillpack pack ... --platform {suggest_tag()}")


def suggest_tag() -> str:
    os_, version, arch = this_machine()
    if os_ == "darwin":
        return f"macosx_11_0_{arch}"
    return f"manylinux_2_17_{arch}" if version < (2, 28) else f"manylinux_2_28_{arch}"


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
            if info.is_dir() or ".." in parts or not parts[-1]:
                continue
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)


def install_wheels(wheels: Path, target: Path) -> None:
    """Unpack every wheel in `wheels` into `target`, once, atomically; no pip, no network.
    Concurrent first starts: each unpacks privately, the first rename wins, the others use it."""
    if (target / ".complete").exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for whl in sorted(wheels.glob("*.whl")):
            unpack_wheel(whl, tmp)
        (tmp / ".complete").write_text("")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def torch_dir(root: Path, manifest: dict) -> Path:
    """Inside the bundle when it is writable, else under SPILLPACK_HOME: never the system's Python."""
    key = (manifest.get("with_torch") or {}).get("key", "torch")
    inside = root / ".spillpack" / key
    if os.access(root, os.W_OK):
        return inside
    home = os.environ.get("SPILLPACK_HOME") or str(Path.home() / ".spillpack")
    return Path(home).expanduser() / "torch" / key


def ensure_torch(root: Path, manifest: dict, tag: str) -> None:
    import importlib.util

    if manifest.get("with_torch"):
        target = torch_dir(root, manifest) / tag
        install_wheels(root / WHEELS_DIR / tag, target)
        sys.path.insert(0, str(target))
        return
    if importlib.util.find_spec("torch") is None:
        raise SpillpackError(f"{sys.executable} has no torch, and this bundle carries none",
                             "pip install torch, or SPILLPACK_PYTHON=/path/to/python-with-torch ./run.sh, "
                             "or spillpack pack ... --with-torch cpu")


# -- the entry point -----------------------------------------------------------------


def start(argv: list[str]) -> int | None:
    """Prepare this process to run the bundled job; an exit code when it should stop here."""
    root = bundle_root()
    if root is None:
        return None
    manifest = load_manifest(root)
    if argv[:1] == ["--verify"]:
        n = verify_all(root)
        sys.stderr.write(f"spillpack: all {n} files of {root} match MANIFEST.json\n")
        return 0
    tag = activate_platform(manifest)
    if "--help" not in argv and "-h" not in argv:
        ensure_torch(root, manifest, tag)
    _Active.root, _Active.manifest = root, manifest
    return None


def entry() -> None:
    try:
        code = start(sys.argv[1:])
    except SpillpackError as e:
        sys.stderr.write(e.line() + "\n")
        sys.exit(e.exit_code)
    if code is not None:
        sys.exit(code)
    from runtime.cli import entry as cli_entry

    cli_entry()
