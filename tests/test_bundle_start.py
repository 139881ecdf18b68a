"""A stop while a bundle starts, before the job runs: run.sh's shell checking its files and
Python, and the first start unpacking the wheels it carries. Nothing is written yet, so the
truth is "run me again": exit 75, never the shell's 143 nor a wait for the whole install."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import clean_env, events_of
from test_pack import JOB, data, new_home, pack, run_bundle  # noqa: F401


def wait_for(found, what: str, p: subprocess.Popen, limit_s: float = 120):
    """Poll for a file the process under test makes when it reaches a point (no timing guess)."""
    t0 = time.monotonic()
    while not (hit := found()):
        assert p.poll() is None, f"exited {p.returncode} before {what}: {p.stderr.read()}"
        assert time.monotonic() - t0 < limit_s, f"never reached {what}"
        time.sleep(0.01)
    return hit


@pytest.fixture
def bundle(phome, data, tmp_path):
    assert pack(["tune", "tiny", str(data), *JOB, "--state", str(tmp_path / "state"), "-o", str(tmp_path / "b")]).returncode == 0
    return tmp_path / "b"


# -- run.sh's shell, before Python ------------------------------------------------------------

HELD_PYTHON = """#!/bin/sh
# Stands in front of the real Python: logs each call, and holds run.sh's version check until
# the test lets it go, so a signal lands while run.sh's shell is still checking.
echo "$*" >> {log}
if [ "$1" = "-S" ]; then
  touch {ready}
  while [ ! -e {release} ]; do sleep 0.02; done
fi
exec {python} "$@"
"""


@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-to-group"])
def test_a_stop_while_run_sh_checks_exits_75_and_the_job_never_starts(bundle, phome, tmp_path, tiny_home, sig, group):
    held = tmp_path / "python"
    log, ready, release = tmp_path / "calls", tmp_path / "ready", tmp_path / "release"
    held.write_text(HELD_PYTHON.format(log=log, ready=ready, release=release, python=sys.executable))
    held.chmod(0o755)
    home = new_home(tmp_path, tiny_home, "node")
    p = subprocess.Popen([str(bundle / "run.sh")], env=clean_env(home, {"SPILLPACK_PYTHON": str(held)}), cwd="/",
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=group)
    wait_for(ready.exists, "run.sh's Python check", p)
    if group:  # a terminal's or a container runtime's stop reaches the check's Python too
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    release.touch()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, (p.returncode, err)
    assert out == "" and "spillpack" not in err and "Traceback" not in err  # (a group's stop: the shell may note "Terminated")
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["-S"]  # the job itself never started
    assert not (tmp_path / "state").exists()

    if sig != signal.SIGTERM or group:
        return
    # The same command, run again, runs the job.
    r = run_bundle(bundle, ["--stop-after", "1"], env=clean_env(home, {"SPILLPACK_PYTHON": str(held)}), input="")
    assert r.returncode == 0, r.stderr
    assert events_of(r.stdout)[-1]["event"] == "done" and (tmp_path / "state" / "job.json").is_file()


# -- the zipapp unpacking itself on a machine's first start ----------------------------------

def running_zipapp(pid: int) -> bool:
    """run.sh has exec'd Python on the zipapp (until then its shell's own trap answers)."""
    try:
        return b"spillpack.pyz" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_while_the_zipapp_unpacks_exits_75_with_nothing_written(bundle, phome, tmp_path, tiny_home, sig):
    """shiv unpacks the zipapp's site-packages on a machine's first start (a second or more)
    before any of runtime/ can run: a stop then is recorded and told once the job's code is up."""
    import fcntl
    import zipfile

    from tests.support.jobproc import handler_installed

    home = new_home(tmp_path, tiny_home, "node")
    env = clean_env(home)
    shiv_root = Path(env["TMPDIR"]) / f"spillpack-{os.getuid()}"  # where run.sh has it unpack
    shiv_root.mkdir(parents=True)
    build_id = json.loads(zipfile.ZipFile(bundle / "spillpack.pyz").read("environment.json"))["build_id"]
    # Hold shiv's own unpacking lock, as a concurrent first start on this node would: this start
    # waits at it, inside the unpacking, until the test lets go.
    lock = os.open(shiv_root / f".spillpack.pyz_{build_id}_lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        p = subprocess.Popen([str(bundle / "run.sh")], env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: running_zipapp(p.pid) and handler_installed(p.pid, sig), "the zipapp's first instruction", p)
            p.send_signal(sig)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = p.communicate(timeout=300)
    finally:
        os.close(lock)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 75, (p.returncode, err)
    pre = [e for e in events_of(out) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == sig.name and pre[0]["step"] is None, out
    assert not any(e["event"] in ("start", "error") for e in events_of(out)) and "Traceback" not in err
    assert not (tmp_path / "state").exists()
    # Unpacked all the same (shiv finishes its one atomic unpacking): the next start runs at once.
    assert (shiv_root / f"spillpack.pyz_{build_id}" / "site-packages" / "runtime").is_dir()


# -- the first start's wheel install ---------------------------------------------------------

@pytest.fixture(scope="module")
def small_wheels(tmp_path_factory) -> list[Path]:
    """Two real wheels, built here from source with no index (no network)."""
    where = tmp_path_factory.mktemp("wheels")
    for name in ("alpha", "beta"):
        src = where / "src" / name
        (src / name).mkdir(parents=True)
        (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                                            f'[project]\nname = "{name}"\nversion = "1.0"\n')
        (src / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(where / "dist"), str(where / "src" / "alpha"), str(where / "src" / "beta")], check=True, timeout=300)
    return sorted((where / "dist").glob("*.whl"))


def carry_wheels(bundle: Path, wheels: list[Path]) -> Path:
    """The bundle as `pack --with-torch cpu` lays it out (wheels/TAG/*.whl, each listed in
    MANIFEST.json with its hash, with_torch set), carrying small wheels instead of torch's
    hundreds of megabytes: the first start unpacks them as it would unpack torch."""
    from runtime.bootstrap.manifest import MANIFEST, WHEELS_DIR, FileEntry, Manifest
    from runtime.base.fileio import sha256_file

    manifest = Manifest.read(bundle)
    tag = manifest.platforms[0]
    files = dict(manifest.files)
    for whl in wheels:
        rel = f"{WHEELS_DIR}/{tag}/{whl.name}"
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_bytes(whl.read_bytes())
        files[rel] = FileEntry(whl.stat().st_size, sha256_file(whl), str(whl))
    (bundle / MANIFEST).write_bytes(replace(manifest, files=files, with_torch="cpu").to_json())
    return bundle / WHEELS_DIR / tag


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_during_the_first_starts_wheel_install_exits_75_and_the_next_start_installs(bundle, phome, tmp_path, tiny_home, sig,
                                                                                            small_wheels):
    alpha, beta = small_wheels
    carried = carry_wheels(bundle, [alpha, beta])
    assert run_bundle(bundle, ["--verify"], env=clean_env(phome)).returncode == 0  # a well-formed bundle
    # The second wheel's read stalls (a FIFO nobody writes to, as a hung network file system
    # would): the install cannot finish by itself, so only the stop can end this start.
    (carried / beta.name).unlink()
    os.mkfifo(carried / beta.name)
    home = new_home(tmp_path, tiny_home, "node")
    env = clean_env(home)
    p = subprocess.Popen([str(bundle / "run.sh")], env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    private = bundle / ".spillpack"
    try:
        partial = wait_for(lambda: next(private.glob("*/.*/alpha/__init__.py"), None), "the wheel install", p)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # still held at the FIFO: never leave it behind
            p.kill()
            p.wait()
    assert p.returncode == 75, (p.returncode, err)
    pre = [e for e in events_of(out) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == sig.name and pre[0]["step"] is None, out
    assert "Traceback" not in err
    assert not partial.exists()  # the partial copy is gone ...
    assert [d for d in private.glob("*/*")] == []  # ... and nothing was taken for an install
    assert not (tmp_path / "state").exists()

    if sig != signal.SIGTERM:
        return
    # The wheel arrives; the next start unpacks everything and runs the job on it.
    (carried / beta.name).unlink()
    (carried / beta.name).write_bytes(beta.read_bytes())
    r = run_bundle(bundle, ["--stop-after", "1"], env=env)
    assert r.returncode == 0, r.stderr
    assert events_of(r.stdout)[-1]["event"] == "done"
    [installed] = private.glob("*/*")
    assert sorted(p.name for p in installed.iterdir()) == [".complete", "alpha", "alpha-1.0.dist-info", "beta", "beta-1.0.dist-info"]
    assert (installed / "beta" / "__init__.py").read_text() == "NAME = 'beta'\n"
