"""`make image`: build spillpack:cpu or spillpack:cuda from the Containerfile, offline.

    python3 docker/image.py [--flavor cpu|cuda] [--base REF] [--tag REF] [--wheelhouse DIR]

1. the engine: $CONTAINER_ENGINE, else podman, else docker, found on PATH;
2. the base: found locally, else pulled; its Python and glibc say which wheels fit;
3. the wheelhouse, fetched here on the host with `pip download` once per (flavor, Python, platform,
   dependencies) into a cache that outlives the checkout (~/.cache/spillpack/wheelhouse), or taken from
   --wheelhouse DIR (an air-gapped site copies one there); spillpack's own wheel is built from this tree;
4. `ENGINE build` on a context of just those wheels (no build step reaches the network; an unchanged
   second build reuses every layer), then the tag, only once the build succeeded: a failed build
   leaves no half-tagged image.

Any failure is one line, `spillpack: <what went wrong>. Try: <command>`, and exit 1. This script
runs with whatever python3 is at hand, before spillpack is installed, so it imports nothing of
the project's and uses only the standard library (and pip, for the wheelhouse).
"""

from __future__ import annotations

import argparse
import email.parser
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "Containerfile"
DEFAULT_BASE = "docker.io/library/python:3.11-slim-bookworm"
# torch's CPU build lives on PyTorch's own index (PyPI's torch is the CUDA build); TORCH_INDEX overrides.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FLAVORS = ("cpu", "cuda")


class Failure(Exception):
    """One line for the user: what went wrong, and the command to try."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"spillpack: {what}. Try: {fix}")


def say(line: str) -> None:
    print(f"spillpack: {line}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillpack" / "wheelhouse"


def disk_full(where: str) -> Failure:
    return Failure(f"the disk is full ({where})",
                   "free space there (df -h; podman system prune or docker system prune removes unused images), then make image again")


# --- 1. the engine -------------------------------------------------------------------------------

def find_engine(asked: str | None) -> str:
    names = [asked] if asked else ["podman", "docker"]
    for name in names:
        path = shutil.which(name)
        if path is None:
            continue
        r = subprocess.run([path, "info"], capture_output=True, text=True)
        if r.returncode == 0:
            return path
        if asked or name == "docker":
            last = (r.stderr.strip().splitlines() or ["no answer"])[-1]
            fix = ("start the docker daemon (docker info says when it answers), or install podman" if name == "docker" else
                   f"{name} info (docs/containers.md: podman on Debian 12 needs CONTAINERS_CONF=docker/containers.conf)")
            raise Failure(f"the container engine {name} on PATH does not work here ({last})", fix)
    raise Failure("no container engine on PATH (podman or docker; CONTAINER_ENGINE names another)",
                  "apt-get install podman runc (or install docker), then make image")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# --- 2. the base ---------------------------------------------------------------------------------

PROBE = "import platform, sys; print(json.dumps([sys.version_info[:2], platform.machine(), platform.libc_ver()]))"


def probe_base(engine: str, base: str) -> tuple[str, str, tuple[int, int]]:
    """(python 'X.Y', machine, glibc (major, minor)) of the base image, pulled first if it is not here."""
    if run([engine, "image", "inspect", base]).returncode != 0:
        say(f"pulling the base image {base}")
        r = run([engine, "pull", base])
        if r.returncode != 0:
            if "no space left" in r.stderr.lower():
                raise disk_full(f"pulling {base}")
            last = (r.stderr.strip().splitlines() or ["no answer"])[-1]
            raise Failure(f"the base image {base} is not here and cannot be pulled ({last[:200]})",
                          f"make image BASE=<an image with python3 that `{Path(engine).name} image ls` lists>, "
                          f"or {Path(engine).name} pull {base} where a registry is reachable")
    r = run([engine, "run", "--rm", "--entrypoint", "python3", base, "-c", "import json; " + PROBE])
    try:
        (major, minor), machine, (libc, libc_version) = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Failure(f"the base image {base} has no working python3 ({(r.stderr.strip().splitlines() or ['no output'])[-1][:200]})",
                      "make image BASE=<an image with Python 3.10 or newer and python3 -m venv>")
    if (major, minor) < (3, 10):
        raise Failure(f"the base image {base} has Python {major}.{minor}; spillpack needs 3.10 or newer",
                      "make image BASE=docker.io/library/python:3.11-slim-bookworm")
    if libc != "glibc":
        raise Failure(f"the base image {base} is not glibc-based ({libc or 'unknown libc'}); torch's wheels need glibc",
                      "make image BASE=docker.io/library/python:3.11-slim-bookworm")
    glibc = tuple(int(x) for x in libc_version.split(".")[:2])
    return f"{major}.{minor}", machine, glibc


def platforms(machine: str, glibc: tuple[int, int]) -> list[str]:
    """pip's --platform takes exact tags: every manylinux tag this glibc runs."""
    return [f"manylinux_2_{m}_{machine}" for m in range(glibc[1], 16, -1)] + [f"manylinux2014_{machine}"]


# --- 3. the wheelhouse ---------------------------------------------------------------------------

def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]


def build_app_wheel(dest: Path) -> Path:
    """spillpack's own wheel from this tree, byte-identical while the tree is (fixed timestamps),
    so that an unchanged second build reuses its layer too."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    # A setuptools that builds wheels by itself (70.1+, or any with the wheel package) builds here,
    # offline and in seconds; otherwise pip fetches one for the build.
    try:
        import setuptools
        major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
        if (major, minor) < (70, 1):
            import wheel  # noqa: F401
        isolation = ["--no-build-isolation"]
    except (ImportError, ValueError):
        isolation = []
    with tempfile.TemporaryDirectory(prefix="spillpack-src-") as src:
        # A copy of the sources only, so the build leaves nothing in the tree (setuptools' build/, egg-info).
        for part in ("pyproject.toml", "README.md", "spillpack", "runtime"):
            s = REPO / part
            (shutil.copytree(s, Path(src) / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
             if s.is_dir() else shutil.copy2(s, Path(src) / part))
        r = run(pip("wheel", "-q", "--no-deps", *isolation, "-w", str(dest), src), env=env)
    if r.returncode != 0:
        if "no space left" in r.stderr.lower():
            raise disk_full(f"building spillpack's wheel in {dest}")
        why = [l.strip() for l in r.stderr.splitlines() if l.strip().lower().startswith("error:")] or ["pip failed"]
        raise Failure(f"building spillpack's wheel failed ({why[0]})",
                      f"{sys.executable} -m pip wheel --no-deps {REPO}")
    wheels = sorted(dest.glob("spillpack-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise Failure(f"pip reported success but wrote no spillpack wheel into {dest}",
                      f"{sys.executable} -m pip wheel --no-deps {REPO}")
    return wheels[-1]  # the one just built (a copied wheelhouse may hold older ones)


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise Failure(f"{wheel} has no .dist-info/METADATA: not a wheel pip wrote", f"rm {wheel}, then make image again")
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return sorted(r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r)


def torch_request(flavor: str, deps: list[str]) -> tuple[list[str], list[str]]:
    """The torch requirement for the flavor (the project's version, CPU or CUDA build) and pip's index options."""
    version = next((m.group(1) for d in deps if (m := re.match(r"torch\s*==\s*([\w.]+)", d))), None)
    if version is None:
        raise Failure("pyproject.toml pins no torch version", "pin torch==X.Y.Z in pyproject.toml's dependencies")
    if flavor == "cpu":
        # TORCH_INDEX="" (set, empty): no extra index, for a site whose pip already finds the CPU
        # build (a find-links folder, a mirror) and cannot reach PyTorch's index.
        index = os.environ.get("TORCH_INDEX", TORCH_CPU_INDEX)
        return [f"torch=={version}+cpu"], (["--extra-index-url", index] if index else [])
    # `===` is string equality: the CUDA build (PyPI's plain version), never a +cpu build that a
    # find-links folder or another index offers under the same version.
    index = os.environ.get("TORCH_INDEX")
    return [f"torch==={version}"], (["--extra-index-url", index] if index else [])


def fetch_wheelhouse(flavor: str, python: str, tags: list[str], app: Path) -> Path:
    """The wheels of everything spillpack needs but itself, for the base's Python and platform,
    from the cache or downloaded into it (atomically: a folder counts once complete)."""
    deps = requires(app)
    torch, index = torch_request(flavor, deps)
    key = hashlib.sha256(json.dumps([flavor, python, tags[0], deps, torch, index]).encode()).hexdigest()[:12]
    dest = cache_dir() / f"{flavor}-py{python}-{tags[0]}-{key}"
    if (dest / "requirements.txt").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    say(f"fetching the {flavor} wheelhouse for Python {python} ({tags[0]}) into {dest}"
        + (" (torch's CUDA build and its libraries: several GB)" if flavor == "cuda" else ""))
    try:
        nodot = python.replace(".", "")
        cmd = pip("download", "-q", "--progress-bar", "off", "--only-binary=:all:", "--python-version", python,
                  "--implementation", "cp", "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none", "-d", str(tmp), *index)
        for t in tags:
            cmd += ["--platform", t]
        r = run(cmd + [str(app), *torch])
        if r.returncode != 0:
            if "no space left" in r.stderr.lower():
                raise disk_full(f"downloading wheels into {dest.parent}")
            lines = [l for l in r.stderr.splitlines() if l.startswith("ERROR")] or r.stderr.strip().splitlines() or ["pip failed"]
            raise Failure(f"could not fetch the {flavor} wheelhouse for Python {python}: {lines[0]}",
                          "make image again where PyPI is reachable, or make image WHEELHOUSE=<a copied wheelhouse>")
        (tmp / app.name).unlink(missing_ok=True)
        pins = []
        for w in sorted(tmp.glob("*.whl")):
            name, version = w.name.split("-")[:2]
            pins.append(f"{name}=={version}")
        (tmp / "requirements.txt").write_text("\n".join(pins) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise disk_full(f"writing the wheelhouse under {dest.parent}")
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def stage(context: Path, wheelhouse: Path, app: Path) -> None:
    """The build context: wheels/ (hard links into the cache where one file system allows) and app/."""
    wheels = context / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for f in sorted(wheelhouse.iterdir()):
        if f.suffix in (".whl", ".txt"):
            try:
                os.link(f, wheels / f.name)
            except OSError:
                shutil.copy2(f, wheels / f.name)


# --- 4. build and tag ----------------------------------------------------------------------------

def build(engine: str, context: Path, base: str, flavor: str, tag: str) -> str:
    iid = context / "image.id"
    iid.unlink(missing_ok=True)
    cmd = [engine, "build", "-f", str(CONTAINERFILE), "--build-arg", f"BASE={base}", "--build-arg", f"FLAVOR={flavor}",
           "--iidfile", str(iid), str(context)]
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-40:]
    if p.returncode != 0 or not iid.is_file():
        text = "\n".join(tail)
        if "no space left" in text.lower():
            raise disk_full(f"{Path(engine).name}'s image storage, building {tag}")
        last = next((l for l in reversed(tail) if l.strip()), "no output")
        raise Failure(f"building {tag} failed ({last[:200]}); nothing was tagged",
                      f"{' '.join(cmd[:2])} ... (the output above says which step)")
    image_id = iid.read_text().strip()
    r = run([engine, "tag", image_id, tag])
    if r.returncode != 0:
        raise Failure(f"could not tag {image_id[:19]} as {tag} ({r.stderr.strip()[:200]})", f"{Path(engine).name} tag {image_id} {tag}")
    return image_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make image", description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="cpu", choices=FLAVORS)
    ap.add_argument("--base", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--wheelhouse", default="", help="a wheelhouse fetched elsewhere (nothing is downloaded)")
    ap.add_argument("--engine", default=os.environ.get("CONTAINER_ENGINE") or None)
    ap.add_argument("--context", default=str(REPO / "build" / "image"))
    def usage(message: str):  # one line, exit 2, as every spillpack usage error
        print(f"spillpack: make image: {message}. Try: make image FLAVOR=cpu|cuda [BASE=IMAGE] [WHEELHOUSE=DIR]", file=sys.stderr)
        sys.exit(2)

    ap.error = usage
    a = ap.parse_args(argv)
    base, tag = a.base or DEFAULT_BASE, a.tag or f"spillpack:{a.flavor}"
    try:
        engine = find_engine(a.engine)
        python, machine, glibc = probe_base(engine, base)
        context = Path(a.context) / a.flavor
        app = build_app_wheel(context / "app")
        if a.wheelhouse:
            wheelhouse = Path(a.wheelhouse)
            if not (wheelhouse / "requirements.txt").is_file():
                raise Failure(f"{wheelhouse} is not a wheelhouse (no requirements.txt)",
                              f"copy one from {cache_dir()} on a machine that ran make image")
        else:
            wheelhouse = fetch_wheelhouse(a.flavor, python, platforms(machine, glibc), app)
        stage(context, wheelhouse, app)
        image_id = build(engine, context, base, a.flavor, tag)
    except Failure as f:
        print(f, file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(disk_full(f"writing {e.filename2 or e.filename or 'the build context'}"), file=sys.stderr)
            return 1
        print(Failure(f"make image failed: {e}", "make image again; docs/containers.md"), file=sys.stderr)
        return 1
    short = image_id.split(":")[-1][:12]
    say(f"built {tag} ({short}) from {base}, Python {python}, wheelhouse {wheelhouse}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
