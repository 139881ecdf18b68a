"""Shared fixtures: every test runs with SPILLPACK_HOME in a temporary directory.

The built-in tiny model is built once per session and copied into each test's home,
so tests are isolated without paying for the build each time.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one torch thread per job, or jobs' threads wait on each other at
    # every op and a step runs many times slower (measured here: 0.1 s steps taking 5.8 s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# `run`'s answers carry `created` (when a row was answered); tests compare two jobs' output bytes,
# so it is fixed, as SOURCE_DATE_EPOCH does for reproducible builds (here, for module fixtures
# too; a test of the clock unsets it).
os.environ.setdefault("SOURCE_DATE_EPOCH", "1767225600")
# The oracles the suite compares against (transformers' logits and generation, PEFT, earlier
# runs' bytes) are float32, and `--dtype auto` picks bfloat16 for models 512 or more wide on a
# CPU with native bfloat16 (the real SmolLM2 here). The tests of that policy unset this.
os.environ.setdefault("SPILLPACK_DTYPE", "float32")


@pytest.fixture(autouse=True)
def no_cloud_metadata(monkeypatch):
    """Jobs in tests look for a cloud's preemption notice (--preemption-notice auto) on a
    closed loopback port, never on the real link-local metadata address."""
    if "SPILLPACK_METADATA_URL" not in os.environ:
        monkeypatch.setenv("SPILLPACK_METADATA_URL", "http://127.0.0.1:9")


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("tiny-home")
    old = os.environ.get("SPILLPACK_HOME")
    os.environ["SPILLPACK_HOME"] = str(home)
    try:
        from runtime.models.tiny import ensure_tiny

        ensure_tiny()
    finally:
        if old is None:
            os.environ.pop("SPILLPACK_HOME", None)
        else:
            os.environ["SPILLPACK_HOME"] = old
    return home


@pytest.fixture(scope="session")
def gguf_family(tmp_path_factory, tiny_home):
    """family -> (path, ModelDir) of a random GGUF of that family (tests/support/gguf_files.py),
    written once per session on first use."""
    built = {}

    def get(name):
        if name not in built:
            from runtime.models.ref import resolve_model
            from runtime.models.tiny import ensure_tiny
            from tests.support.gguf_files import write_family

            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPILLPACK_HOME", str(tiny_home))
                path = write_family(name, tmp_path_factory.mktemp("gguf") / f"{name}.gguf", ensure_tiny())
                built[name] = path, resolve_model(str(path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def gguf_oracle(tmp_path_factory, tiny_home):
    """family -> (GGUF path, ModelDir, transformers model, transformers tokenizer): a random GGUF of
    that family (a `mistral` one named like Mistral) read by transformers' own GGUF loader, the
    oracle of tests/test_gguf_models.py and tests/test_gguf_placements.py, built once per session."""
    built = {}

    def get(name):
        if name not in built:
            from runtime.models.ref import resolve_model
            from runtime.models.tiny import ensure_tiny
            from tests.support.gguf_files import load_transformers, write_family

            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPILLPACK_HOME", str(tiny_home))
                path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
                write_family(name, path, ensure_tiny(), model_name="Mistral-7B-Instruct test" if name == "mistral" else None)
                hf, tok = load_transformers(path)
                built[name] = path, resolve_model(str(path)), hf, tok
        return built[name]

    return get


@pytest.fixture
def home(tmp_path, tiny_home, monkeypatch) -> Path:
    """A fresh SPILLPACK_HOME holding the tiny model."""
    h = tmp_path / "home"
    shutil.copytree(tiny_home / "models", h / "models")
    monkeypatch.setenv("SPILLPACK_HOME", str(h))
    monkeypatch.delenv("SPILLPACK_ENGINE", raising=False)
    monkeypatch.delenv("SPILLPACK_STATUS", raising=False)
    return h


@pytest.fixture(scope="session")
def wheel_cache(tmp_path_factory):
    """Wheels and built zipapps shared by every packing test of the session: fetched from PyPI once."""
    return tmp_path_factory.mktemp("pack-cache")


@pytest.fixture
def phome(home, wheel_cache):
    """A home for `spillpack pack`: the tiny model, and the session's wheel and zipapp caches."""
    (home / "cache").mkdir(exist_ok=True)
    for sub in ("wheels", "pyz"):
        (wheel_cache / sub).mkdir(exist_ok=True)
        (home / "cache" / sub).symlink_to(wheel_cache / sub)
    return home


def clean_env(home: Path, extra=None) -> dict:
    """What a fresh cluster node gives a bundle: PATH with a python3 that has torch, HOME, SPILLPACK_HOME, TMPDIR,
    and one torch thread, as the suite's direct runs have (OMP_NUM_THREADS above): a job left to choose takes
    its count from the load it meets, and two jobs compare bit for bit only at one count (docs/state.md)."""
    (home.parent / "tmp").mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(home.parent), "SPILLPACK_HOME": str(home),
            "TMPDIR": str(home.parent / "tmp"), "SPILLPACK_THREADS": "1",
            "SPILLPACK_METADATA_URL": os.environ.get("SPILLPACK_METADATA_URL", "http://127.0.0.1:9"),
            **({"SOURCE_DATE_EPOCH": os.environ["SOURCE_DATE_EPOCH"]} if "SOURCE_DATE_EPOCH" in os.environ else {}), **(extra or {})}


def run_cli(args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    """Run the CLI as a user does: a subprocess, headless JSON lines on stdout. Forked from a
    process that imported torch already where the call allows (tests/support/forkcli.py)."""
    from tests.support import forkcli

    full_env = {**os.environ, "SPILLPACK_HEADLESS": "1", **(env or {})}
    cwd = kw.pop("cwd", REPO)
    if not kw:
        r = forkcli.run(args, full_env, cwd, timeout, REPO)
        if r is not None:
            return r
    return subprocess.run([sys.executable, "-m", "spillpack", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd, **kw)


@pytest.fixture(scope="session", autouse=True)
def fork_servers():
    """run_cli's fork servers, stopped at the end of the session."""
    from tests.support import forkcli

    yield
    forkcli.close_all()


def events_of(stdout: str) -> list[dict]:
    import json

    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def one_line(r, *expect: str, code=1, said: int = 0) -> str:
    """A failure as the contract says: exit `code` (or one of them), one `spillpack: ... Try: ...`
    line on stderr with each of `expect` in it, no traceback, no 'unexpected'. `said`: lines a
    command prints before it fails (resume names the job it resumes)."""
    codes = code if isinstance(code, tuple) else (code,)
    assert r.returncode in codes, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()[said:]
    assert len(lines) == 1 and lines[0].startswith("spillpack: ") and ". Try: " in lines[0], r.stderr
    assert "unexpected" not in lines[0] and "Traceback" not in r.stderr, r.stderr
    for text in expect:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def slurm():
    """The Slurm tests' cluster (tests/slurm/cluster.py), one per worker process (defined here, not
    in a test module, so two modules using it are one fixture). Reused if one is up (started by hand or by CI), else started here and
    stopped by its last user. Every process that uses it holds a shared lock on one file for as
    long as it does, so a worker never stops the cluster under another worker's jobs (the Slurm
    modules are one xdist group, but a stop and restart between two users lost jobs before)."""
    import fcntl
    import importlib.util

    spec = importlib.util.spec_from_file_location("slurm_cluster", REPO / "tests/slurm/cluster.py")
    cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster)
    reason = cluster.why_unavailable()
    if reason and cluster.missing() and reason.startswith("Debian"):
        try:
            cluster.install()
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"Slurm packages could not be installed here: {e}")
        reason = cluster.why_unavailable()
    if reason:
        pytest.skip(reason)
    users = open("/tmp/spillpack-slurm-users.lock", "a+")
    fcntl.flock(users, fcntl.LOCK_EX)  # one starter at a time
    marker = Path("/tmp/spillpack-slurm-started-by-tests")
    if not cluster.running():
        cluster.start()
        marker.touch()  # the last user stops it; a cluster started by hand or by CI is left running
    fcntl.flock(users, fcntl.LOCK_SH)  # a user from here on
    try:
        yield cluster
    finally:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only when no other process uses it
            if marker.exists():
                cluster.stop()
                marker.unlink()
        except BlockingIOError:
            pass  # another worker still runs jobs on it: it stops the cluster when it is done
        users.close()
