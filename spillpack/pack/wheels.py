"""The runtime's dependencies as wheels for a target platform, fetched once into a cache.

Each dependency is asked for at the version installed here (the one the laptop tests with),
falling back to the newest older release that has a wheel for the target (an old glibc
gets an older numpy), never below a floor known to work. Fetched with `pip download`
into SPILLPACK_HOME/cache/wheels; a second pack for the same target does not download.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.base.progress import wanted as progress_wanted
from runtime.bootstrap.platforms import parse_tag, this_machine
from runtime.base.errors import SpillpackError, UsageError
from runtime.base.paths import spillpack_home

# name -> oldest release the runtime works with. torch is not here: it comes from the
# target machine, or from wheels/ with --with-torch. numpy is: the runtime imports it
# directly, and `pip install torch` does not bring it.
RUNTIME_DEPS = {
    "numpy": "1.26",
    "safetensors": "0.4.3",
    "tokenizers": "0.19",
    "orjson": "3.9",
    "psutil": "5.9",
    "jinja2": "3.1",
    "markupsafe": "2.1",
    "tomli-w": "1.0",
    # GGUF models: gguf is pure Python (dequantization in numpy); importing it imports yaml.
    "gguf": "0.10",
    "pyyaml": "5.1",
}
# Only when the job names an s3:// URI. All pure Python.
S3_DEPS = {"boto3": "1.28", "botocore": "1.31", "s3transfer": "0.6", "jmespath": "1.0", "python-dateutil": "2.8",
           "six": "1.16", "urllib3": "1.26"}


def host_tag() -> str:
    """The default target: this machine's OS and architecture, at a glibc most clusters have."""
    os_, version, arch = this_machine()
    if os_ == "darwin":
        return f"macosx_11_0_{arch}" if arch == "arm64" else "macosx_10_15_x86_64"
    if os_ == "linux":
        return f"manylinux_2_28_{arch}" if version >= (2, 28) else f"manylinux_2_17_{arch}"
    raise UsageError(f"cannot tell which wheels fit this machine ({os_} {arch})", "spillpack pack ... --platform manylinux_2_17_x86_64")


def check_tag(tag: str) -> str:
    if parse_tag(tag) is None:
        raise UsageError(f"unknown platform tag {tag!r}",
                         "--platform manylinux_2_17_x86_64, manylinux_2_17_aarch64 or macosx_11_0_arm64")
    return tag


def pip_platforms(tag: str) -> list[str]:
    """Every wheel platform tag that runs on `tag` (pip's --platform takes exact tags)."""
    os_, (major, minor), arch = parse_tag(tag)
    if os_ == "linux":
        out = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return out + [f"{name}_{arch}" for m, name in legacy.items() if minor >= m and (arch == "x86_64" or m == 17)]
    versions = [(v, 0) for v in range(major, 10, -1)] + [(10, m) for m in range(15 if major > 10 else minor, 8, -1)]
    out = []
    for v, m in versions:
        if arch == "x86_64" or (v, m) >= (11, 0):
            out.append(f"macosx_{v}_{m}_{arch}")
        out.append(f"macosx_{v}_{m}_universal2")
    return out


def requirements(with_s3: bool) -> list[str]:
    deps = {**RUNTIME_DEPS, **(S3_DEPS if with_s3 else {})}
    out = []
    for name, floor in sorted(deps.items()):
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise SpillpackError(f"{name} is not installed here, so the packer cannot tell which version to bundle",
                                 f"pip install {name}")
        out.append(f"{name}>={floor},<={have}")
    return out


def cache_root() -> Path:
    return spillpack_home() / "cache" / "wheels"


def fetch(tag: str, python: str, reqs: list[str], extra_pip: tuple[str, ...] = (), with_deps: bool = False) -> list[Path]:
    """The wheels for `reqs` on (tag, python), from the cache or downloaded into it.
    Without with_deps, `reqs` is the whole closure (the runtime's list is written out above)."""
    key = hashlib.sha256(json.dumps([tag, python, reqs, list(extra_pip), with_deps]).encode()).hexdigest()[:16]
    dest = cache_root() / f"{tag}-py{python}-{key}"
    listing = dest / "wheels.json"
    if listing.is_file():
        names = json.loads(listing.read_text())
        if all((dest / n).is_file() for n in names):
            return [dest / n for n in names]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        nodot = python.replace(".", "")
        live = progress_wanted()  # on a terminal pip's own line shows bytes, rate and time left (to stderr)
        cmd = [sys.executable, "-m", "pip", "download", *([] if live else ["--quiet"]), "--disable-pip-version-check",
               *([] if with_deps else ["--no-deps"]), "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
               "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none", "-d", str(tmp), *extra_pip]
        for p in pip_platforms(tag):
            cmd += ["--platform", p]
        r = subprocess.run(cmd + reqs, stdout=sys.stderr if live else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PIP_NO_INPUT": "1"})
        if r.returncode != 0:
            lines = [l for l in r.stderr.splitlines() if l.startswith("ERROR")] or r.stderr.strip().splitlines() or ["pip failed"]
            raise SpillpackError(f"could not fetch the runtime's wheels for {tag}, Python {python}: {lines[0]}",
                                 f"pip download --only-binary=:all: --platform {tag} --python-version {python} {' '.join(reqs)}")
        names = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / "wheels.json").write_text(json.dumps(names, indent=1) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            pass  # another pack got there first with the same wheels
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [dest / n for n in json.loads(listing.read_text())]


def is_pure(whl: Path) -> bool:
    return whl.name.endswith("-none-any.whl")


def dist_of(whl: Path) -> str:
    """'numpy-2.4.6-cp311-...whl' -> 'numpy 2.4.6'."""
    name, version = whl.name.split("-")[:2]
    return f"{name} {version}"
