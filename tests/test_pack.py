"""`spillpack pack` and the bundle it writes, run the way a cluster runs it: a copy of the
directory, the source data gone, a clean environment, real signals, PID 1 in a namespace."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, clean_env, events_of, run_cli

# A small, fast tune: 4 steps, a checkpoint after each.
JOB = ["--steps", "4", "--batch", "2", "--max-seq", "96", "--ckpt-every", "1", "--lr", "1e-3", "--name", "packed"]


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "src" / "task"
    d.mkdir(parents=True)
    lines = (REPO / "examples/data/train.jsonl").read_text().splitlines()[:24]
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    return d / "train.jsonl"


def pack(args, **kw):
    return run_cli(["pack", *args], **kw)


def run_bundle(bundle: Path, args=(), env=None, cwd="/", **kw):
    return subprocess.run([str(bundle / "run.sh"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300, **kw)


def new_home(tmp_path: Path, tiny_home: Path, name: str) -> Path:
    h = tmp_path / name / "home"
    shutil.copytree(tiny_home / "models", h / "models")
    (h.parent / "tmp").mkdir()
    return h


def adapter(state: Path) -> dict:
    return load_file(str(state / "adapter" / "adapter_model.safetensors"))


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b) and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# -- refusals (fast) -----------------------------------------------------------------


def test_existing_output_is_refused_with_exit_2(phome, data, tmp_path):
    (tmp_path / "out").mkdir()
    r = pack(["tune", "tiny", str(data), "-o", str(tmp_path / "out")])
    assert r.returncode == 2, r.stderr
    assert "already exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_input_exits_1_and_leaves_nothing(phome, tmp_path):
    r = pack(["tune", "tiny", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out" / "b")])
    assert r.returncode == 1, r.stderr
    assert "nope.jsonl does not exist" in r.stderr and "Try:" in r.stderr
    assert not (tmp_path / "out").exists()


def test_path_that_cannot_be_made_bundle_relative_exits_1(phome, tmp_path):
    r = pack(["tune", "tiny", "https://example.com/train.jsonl", "-o", str(tmp_path / "b")])
    assert r.returncode == 1 and "cannot be made bundle-relative" in r.stderr, r.stderr
    fifo = tmp_path / "d" / "fifo.jsonl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    r = pack(["tune", "tiny", str(fifo), "-o", str(tmp_path / "b")])
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


def test_manifest_is_one_type_read_back_field_by_field(tmp_path):
    from runtime.bootstrap.manifest import FileEntry, Manifest
    from runtime.base.errors import SpillpackError

    m = Manifest(packer="spillpack 0", command="tune", name="x", python="3.11", platforms=["manylinux_2_17_x86_64"],
                 zipapp={}, with_torch="cpu", files={"files/job.json": FileEntry(3, "ab" * 32, "command line")})
    (tmp_path / "MANIFEST.json").write_bytes(m.to_json())
    assert Manifest.read(tmp_path) == m and m.wheels_key == "torch-cpu-py3.11"
    good = json.loads(m.to_json())
    damaged = [b"{", json.dumps({**good, "files": {"files/job.json": {"size": "3"}}}).encode(),
               json.dumps({**good, "platforms": "linux"}).encode(), json.dumps({k: v for k, v in good.items() if k != "python"}).encode()]
    for raw in damaged:
        (tmp_path / "MANIFEST.json").write_bytes(raw)
        with pytest.raises(SpillpackError) as e:
            Manifest.read(tmp_path)
        assert "is damaged" in e.value.line() and "\n" not in e.value.line()


def test_with_mlx_needs_an_apple_silicon_target(phome, data, tmp_path):
    r = pack(["tune", "tiny", str(data), "--platform", "manylinux_2_17_x86_64", "--with-mlx", "-o", str(tmp_path / "b")])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--with-mlx" in r.stderr and "Try:" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


# -- the bundle, end to end ----------------------------------------------------------


@pytest.mark.slow
def test_bundle_runs_elsewhere_survives_sigterm_and_equals_direct_run(phome, data, tmp_path, tiny_home):
    cfg = tmp_path / "tune.json"
    assert run_cli(["tune", "tiny", str(data), *JOB, "--emit-config", str(cfg)]).returncode == 0
    r = pack([str(cfg), "-o", str(tmp_path / "out" / "b")])
    assert r.returncode == 0, r.stderr
    summary = r.stderr.strip().splitlines()[-1]
    assert "1 data file" in summary and "Run it:" in summary and "run.sh" in summary
    job = json.loads((tmp_path / "out/b/files/job.json").read_text())
    assert job["arguments"]["data"] == "files/data/train.jsonl" and job["options"]["state"] is None

    # The job run directly, as the oracle.
    direct = run_cli(["tune", "tiny", str(data), *JOB, "--state", str(tmp_path / "direct")])
    assert direct.returncode == 0, direct.stderr

    # Copy the bundle elsewhere, move the source data away.
    bundle = tmp_path / "elsewhere" / "b"
    shutil.copytree(tmp_path / "out" / "b", bundle)
    shutil.move(str(data.parent), str(tmp_path / "moved-away"))

    home1 = new_home(tmp_path, tiny_home, "node1")
    r1 = run_bundle(bundle, env=clean_env(home1))
    assert r1.returncode == 0, r1.stderr
    assert events_of(r1.stdout)[-1]["event"] == "done"
    assert_same(adapter(home1 / "jobs" / "packed"), adapter(tmp_path / "direct"))

    # Preempted: SIGTERM after the first checkpoint -> 75 -> run.sh again -> done, same adapter.
    home2 = new_home(tmp_path, tiny_home, "node2")
    p = subprocess.Popen([str(bundle / "run.sh")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env(home2), cwd="/")
    for line in p.stdout:
        if json.loads(line)["event"] == "checkpoint":
            p.send_signal(signal.SIGTERM)
            break
    rest, _ = p.communicate(timeout=120)
    assert p.returncode == 75
    assert events_of(rest)[-1]["event"] == "preempted"
    r2 = run_bundle(bundle, env=clean_env(home2))
    assert r2.returncode == 0, r2.stderr
    ev = events_of(r2.stdout)
    assert ev[0]["event"] == "restore" and ev[0]["step"] >= 1 and ev[-1]["steps"] == 4
    assert_same(adapter(home2 / "jobs" / "packed"), adapter(tmp_path / "direct"))


@pytest.mark.slow
def test_sigterm_to_pid_1_in_a_pid_namespace_gives_checkpoint_and_75(phome, data, tmp_path, tiny_home):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root")
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    home = new_home(tmp_path, tiny_home, "node")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", str(tmp_path / "b" / "run.sh")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(home), cwd="/")
    for line in p.stdout:
        if json.loads(line)["event"] == "step":
            break
    # The container's init is unshare's child; a runtime's `stop` sends SIGTERM to it from outside.
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    assert len(children) == 1
    init = int(children[0])
    nspid = next(l for l in Path(f"/proc/{init}/status").read_text().splitlines() if l.startswith("NSpid:"))
    assert nspid.split()[-1] == "1", nspid  # it really is PID 1 in its namespace
    os.kill(init, signal.SIGTERM)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    ev = events_of(rest)
    assert [e["event"] for e in ev[-2:]] == ["checkpoint", "preempted"]


@pytest.mark.slow
def test_two_packs_are_byte_identical_and_a_data_byte_changes_only_the_manifest(home, wheel_cache, data, tmp_path):
    (home / "cache").mkdir()
    (wheel_cache / "wheels").mkdir(exist_ok=True)
    (home / "cache" / "wheels").symlink_to(wheel_cache / "wheels")  # wheels shared, zipapps built fresh each time
    args = ["tune", "tiny", str(data), *JOB]
    assert pack([*args, "-o", str(tmp_path / "a")]).returncode == 0
    shutil.rmtree(home / "cache" / "pyz")
    assert pack([*args, "-o", str(tmp_path / "b")]).returncode == 0
    assert tree(tmp_path / "a") == tree(tmp_path / "b")

    raw = bytearray(data.read_bytes())
    at = raw.index(b'"content": "') + len(b'"content": "')
    at += next(i for i, b in enumerate(raw[at:]) if chr(b).isalpha())
    raw[at] ^= 0x20  # one letter's case: still valid data (pack refuses a file the job could not read)
    data.write_bytes(bytes(raw))
    shutil.rmtree(home / "cache" / "pyz")
    assert pack([*args, "-o", str(tmp_path / "c")]).returncode == 0
    a, c = tree(tmp_path / "a"), tree(tmp_path / "c")
    assert a["spillpack.pyz"] == c["spillpack.pyz"]
    assert a["MANIFEST.json"] != c["MANIFEST.json"]
    assert [k for k in a if a[k] != c[k]] == ["MANIFEST.json", "files/data/train.jsonl"]


@pytest.mark.slow
def test_a_flipped_byte_is_one_line_naming_the_file(phome, data, tmp_path, tiny_home):
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    home = new_home(tmp_path, tiny_home, "node")
    ok = run_bundle(tmp_path / "b", ["--verify"], env=clean_env(home))
    assert ok.returncode == 0 and "match MANIFEST.json" in ok.stderr
    f = tmp_path / "b" / "files" / "data" / "train.jsonl"
    raw = bytearray(f.read_bytes())
    raw[100] ^= 0x20
    f.write_bytes(bytes(raw))
    for args in (["--verify"], []):
        r = run_bundle(tmp_path / "b", args, env=clean_env(home))
        assert r.returncode == 1, r.stderr
        lines = [l for l in r.stderr.splitlines() if l.startswith("spillpack:")]
        assert len(lines) == 1 and "files/data/train.jsonl" in lines[0] and "Try:" in lines[0], r.stderr
    assert not (home / "jobs" / "packed" / "commits").exists()  # nothing ran on damaged data


@pytest.mark.slow
def test_macos_pack_carries_that_platforms_compiled_wheels(phome, data, tmp_path, tiny_home):
    r = pack(["tune", "tiny", str(data), "--platform", "macosx_11_0_arm64", "--platform", "manylinux_2_17_x86_64",
              "-o", str(tmp_path / "b")])
    assert r.returncode == 0, r.stderr
    names = zipfile.ZipFile(tmp_path / "b" / "spillpack.pyz").namelist()
    mac = "site-packages/_spillpack_platforms/macosx_11_0_arm64/"
    lin = "site-packages/_spillpack_platforms/manylinux_2_17_x86_64/"
    for base in (mac, lin):
        assert any(n.startswith(base + "tokenizers/") and n.endswith(".so") for n in names)
        assert any(n.startswith(base + "numpy/_core/_multiarray_umath") for n in names)
    assert any(n.startswith(mac) and n.endswith("-darwin.so") for n in names)
    manifest = json.loads((tmp_path / "b" / "MANIFEST.json").read_text())
    assert manifest["platforms"] == ["macosx_11_0_arm64", "manylinux_2_17_x86_64"]

    # Only the mac part: on this Linux machine it says so in one line.
    assert pack(["tune", "tiny", str(data), "--platform", "macosx_11_0_arm64", "-o", str(tmp_path / "m")]).returncode == 0
    home = new_home(tmp_path, tiny_home, "node")
    r = run_bundle(tmp_path / "m", env=clean_env(home))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "macosx_11_0_arm64" in r.stderr and "this machine is linux" in r.stderr


@pytest.mark.slow
def test_zipapp_starts_with_read_only_home_and_twice_at_once(phome, data, tmp_path, tiny_home):
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    home = new_home(tmp_path, tiny_home, "node")
    run_sh = str(tmp_path / "b" / "run.sh")
    if os.geteuid() == 0:  # permission bits do not stop root: make HOME a read-only mount instead
        cmd = ["unshare", "--mount", "sh", "-c", f"mount --bind {home.parent} {home.parent} && "
               f"mount -o remount,ro,bind {home.parent} {home.parent} && touch {home.parent}/probe 2>/dev/null && exit 9; "
               f"exec {run_sh} --help"]
    else:
        os.chmod(home.parent, 0o555)
        cmd = [run_sh, "--help"]
    env = clean_env(home, {"TMPDIR": str(tmp_path / "nodetmp")})
    try:
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert "usage: spillpack tune" in out
    finally:
        os.chmod(home.parent, 0o755)
    assert not (home.parent / ".shiv").exists()
    assert len(list((tmp_path / "nodetmp" / f"spillpack-{os.getuid()}").glob("spillpack.pyz_*"))) == 1


@pytest.mark.slow
def test_missing_torch_is_one_line(phome, data, tmp_path, tiny_home):
    if not Path("/usr/bin/python3").exists() or subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a python3 without torch")
    if subprocess.run(["/usr/bin/python3", "-c", "import sys; assert sys.version_info[:2] == %r" % (sys.version_info[:2],)]).returncode:
        pytest.skip("needs a torch-less python3 of this version")
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    home = new_home(tmp_path, tiny_home, "node")
    r = run_bundle(tmp_path / "b", env=clean_env(home, {"PATH": "/usr/bin:/bin"}))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "has no torch" in r.stderr and "--with-torch cpu" in r.stderr


@pytest.mark.slow
def test_with_torch_installs_its_wheels_on_first_start_and_runs_without_a_system_torch(phome, data, tmp_path, tiny_home):
    """--with-torch cpu on a node whose python3 has no torch: the bundle's own wheels are
    unpacked into the bundle on first start (never into the system) and the job runs."""
    if not Path("/usr/bin/python3").exists() or subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a python3 without torch")
    if subprocess.run(["/usr/bin/python3", "-c", "import sys; assert sys.version_info[:2] == %r" % (sys.version_info[:2],)]).returncode:
        pytest.skip("needs a torch-less python3 of this version")
    r = pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b"), "--with-torch", "cpu"], timeout=900)
    assert r.returncode == 0, r.stderr
    wheels = sorted(p.name for p in (tmp_path / "b" / "wheels").rglob("*.whl"))
    assert any(w.startswith("torch-") for w in wheels), wheels
    home = new_home(tmp_path, tiny_home, "node")
    env = clean_env(home, {"PATH": "/usr/bin:/bin"})
    r = run_bundle(tmp_path / "b", env=env)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert done["event"] == "done" and done["complete"] and done["steps"] == 4
    assert subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0  # system untouched
    # The second start finds the installed torch and does not unpack again.
    installed = sorted((tmp_path / "b" / ".spillpack").iterdir())
    stamp = {p: p.stat().st_mtime_ns for p in installed}
    r = run_bundle(tmp_path / "b", env=env)
    assert r.returncode == 0, r.stderr
    assert {p: p.stat().st_mtime_ns for p in installed} == stamp


@pytest.mark.slow
def test_with_mlx_carries_mlx_for_an_air_gapped_mac(phome, data, tmp_path):
    r = pack(["tune", "tiny", str(data), "--platform", "macosx_14_0_arm64", "--with-mlx", "-o", str(tmp_path / "b")], timeout=900)
    assert r.returncode == 0, r.stderr
    assert "macosx_14_0_arm64: mlx (bundled), torch-cpu (target's torch)" in r.stderr.strip().splitlines()[-1]
    whls = sorted(p.name for p in (tmp_path / "b" / "wheels" / "macosx_14_0_arm64").glob("*.whl"))
    assert [w.split("-")[0] for w in whls] == ["mlx", "mlx_metal"], whls
    manifest = json.loads((tmp_path / "b" / "MANIFEST.json").read_text())
    assert manifest["with_mlx"] is True and manifest["with_torch"] is None
    assert manifest["engines"]["macosx_14_0_arm64"][0] == "mlx (bundled)"
    for w in whls:
        entry = manifest["files"][f"wheels/macosx_14_0_arm64/{w}"]
        assert entry["size"] == (tmp_path / "b" / "wheels" / "macosx_14_0_arm64" / w).stat().st_size > 0


@pytest.mark.slow
def test_resume_of_a_bundle_folder_runs_from_anywhere_through_its_manifest(phome, data, tmp_path, tiny_home):
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    env = {"PYTHONPATH": str(REPO)}
    r = run_cli(["resume", str(tmp_path / "b")], env={**env, "SPILLPACK_HOME": str(phome)}, cwd="/")
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert ev[-1]["event"] == "done" and ev[-1]["steps"] == 4

    # A damaged bundled data file is one line naming it, and nothing runs.
    f = tmp_path / "b" / "files" / "data" / "train.jsonl"
    raw = bytearray(f.read_bytes())
    raw[50] ^= 0x20
    f.write_bytes(bytes(raw))
    home2 = new_home(tmp_path, tiny_home, "node")
    r = run_cli(["resume", str(tmp_path / "b")], env={**env, "SPILLPACK_HOME": str(home2)}, cwd="/")
    assert r.returncode == 1, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("spillpack:")]
    assert len(lines) == 1 and "files/data/train.jsonl" in lines[0] and "damaged" in lines[0], r.stderr
    assert not (home2 / "jobs" / "packed" / "commits").exists()


@pytest.mark.slow
def test_the_zipapp_carries_the_runtime_and_no_laptop_code(phome, data, tmp_path):
    """spillpack.pyz holds every runtime module and nothing of the laptop side: not the packer,
    not `status --plot` (matplotlib is never carried), not the scheduler examples."""
    assert pack(["tune", "tiny", str(data), *JOB, "-o", str(tmp_path / "b")]).returncode == 0
    names = zipfile.ZipFile(tmp_path / "b" / "spillpack.pyz").namelist()
    carried = {n.split("site-packages/", 1)[1] for n in names if "site-packages/" in n and n.endswith(".py")}
    runtime_modules = {m for m in carried if m.startswith("runtime/")}
    assert runtime_modules == {str(p.relative_to(REPO)) for p in (REPO / "runtime").rglob("*.py")}
    assert not [m for m in carried if m.startswith(("spillpack/", "matplotlib/", "shiv/"))]
    assert not [m for m in carried if m.rsplit("/", 1)[-1] in ("plot.py", "examples.py")]
