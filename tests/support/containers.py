"""A real container engine for the tests: podman, its Debian base image, spillpack:cpu, and
podman's Docker-compatible socket for testcontainers.

Prepared once per machine and reused: the base image (debootstrap'd Debian 12 with python3,
about 2 minutes and 275 MB the first time) is kept in podman's own storage and its root
filesystem as a tarball under ~/.cache/spillpack/containers (so a podman reset does not cost
another debootstrap); spillpack:cpu is built by `make image`, whose wheelhouse is cached under
~/.cache/spillpack/wheelhouse and whose layers podman reuses, so a second session rebuilds only
what changed. The tests skip, saying why, only where podman cannot run (not installed and not
installable: .ci/run installs it with apt-get).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/spillpack-base:bookworm"
IMAGE = "localhost/spillpack:cpu"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillpack" / "containers"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def engine_env() -> dict:
    """podman's settings on a machine like CI's (runc, ulimits it accepts): docker/containers.conf,
    unless the machine names its own."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(REPO / "docker" / "containers.conf"))
    return env


def podman(*args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, env=kw.pop("env", engine_env()), timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


def why_not() -> str | None:
    """None where podman runs containers here, else the reason the container tests skip."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc debootstrap; .ci/run does it as root)"
    r = subprocess.run(["podman", "info"], capture_output=True, text=True, env=engine_env())
    if r.returncode != 0:
        return f"podman cannot run here: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
    return None


@contextmanager
def machine_lock(name: str):
    """One preparer at a time on this machine (two pytest workers, two checkouts)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def apt_mirror() -> str:
    """The Debian mirror apt already uses (debootstrap fetches the same packages apt would)."""
    for src in [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]:
        if src.is_file():
            for line in src.read_text().splitlines():
                line = line.strip()
                if line.startswith("URIs:"):
                    return line.split()[1]
                if line.startswith("deb ") and "security" not in line:
                    return next(p for p in line.split()[1:] if "://" in p)
    return DEFAULT_MIRROR


def ensure_base() -> str:
    """The base image: in podman already, else imported from the cached tarball, else debootstrap'd."""
    with machine_lock("base"):
        if podman("image", "exists", BASE, check=False).returncode == 0:
            return BASE
        tarball = CACHE / "bookworm-minbase.tar"
        if not tarball.is_file():
            if shutil.which("debootstrap") is None:
                raise AssertionError("debootstrap is not installed: apt-get install debootstrap (.ci/run does)")
            with tempfile.TemporaryDirectory(dir=CACHE, prefix=".rootfs-") as root:
                r = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                                    "bookworm", root, apt_mirror()], capture_output=True, text=True, timeout=1200)
                if r.returncode != 0:
                    raise AssertionError(f"debootstrap failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
                part = tarball.with_suffix(".part")
                subprocess.run(["tar", "-C", root, "-cf", str(part), "."], check=True)
                part.rename(tarball)
        # An imported image has no environment: PATH is set here, as a Dockerfile's base would have it.
        podman("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               str(tarball), BASE)
        return BASE


def torch_index_env() -> dict:
    """TORCH_INDEX="" where PyTorch's index cannot be reached (these machines reach PyPI only, and
    pip's own configuration finds the CPU build there): pip would otherwise retry it for every
    package of the wheelhouse."""
    if "TORCH_INDEX" in os.environ:
        return {}
    try:
        socket.create_connection(("download.pytorch.org", 443), timeout=3).close()
        return {}
    except OSError:
        return {"TORCH_INDEX": ""}


def make_image(base: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`make image` as a user runs it (stdout and stderr captured)."""
    return subprocess.run(["make", "-s", "-C", str(REPO), "image", f"BASE={base}", f"PYTHON={sys.executable}", *extra],
                          capture_output=True, text=True, env={**engine_env(), **torch_index_env(), **(env or {})}, timeout=3600)


def image_id(ref: str) -> str | None:
    r = podman("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_image(base: str) -> str:
    with machine_lock("image"):
        r = make_image(base)
        if r.returncode != 0:
            raise AssertionError(f"make image failed:\n{r.stderr[-4000:]}")
    return IMAGE


class Service:
    """`podman system service` on a socket of its own: the Docker API testcontainers talks to."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="spillpack-podman-"))
        self.socket = self.dir / "podman.sock"
        self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                                     env=engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.monotonic()
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                raise AssertionError(f"podman system service did not start: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        self.url = f"unix://{self.socket}"

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def json_lines(text: str) -> list[dict]:
    """Every line of a headless stdout, parsed: a line that is not JSON fails the test."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]
