"""tune with its data, weights, state and --out on S3, run as a user runs it (subprocesses of the
CLI against moto over HTTP): preempted and resumed, killed mid-upload, raced by a second copy,
and served by a flaky server, it ends with the same adapter tensors as an uninterrupted local
run; and no file it wrote holds the credentials."""

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import orjson
import pytest
from safetensors.numpy import load as st_load

from tests.conftest import REPO, events_of, run_cli
from tests.support.s3_fixtures import CANARY_KEY_ID, CANARY_SECRET, fault_proxy, s3, s3_uri  # noqa: F401

pytestmark = pytest.mark.slow

DATA = REPO / "examples" / "data" / "train.jsonl"
ARGS = ["--steps", "6", "--ckpt-every", "2", "--batch", "1", "--targets", "q_proj,v_proj", "--name", "s3job"]


@pytest.fixture(scope="module")
def reference(tiny_home, tmp_path_factory):
    """The adapter of an uninterrupted run with everything local."""
    home = tmp_path_factory.mktemp("reference-home")
    shutil.copytree(tiny_home / "models", home / "models")
    r = run_cli(["tune", "tiny", str(DATA), *ARGS, "--state", str(home / "state")], env={"SPILLPACK_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    return st_load((home / "state" / "adapter" / "adapter_model.safetensors").read_bytes())


def assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


@pytest.fixture
def job(home, s3, s3_uri):
    """Data and weights uploaded to S3; the tune command line with everything on S3."""
    key = s3_uri[len(f"s3://{s3.bucket}/"):]
    s3.put(f"{key}/data/train.jsonl", DATA.read_bytes())
    for f in sorted((home / "models" / "tiny").iterdir()):
        s3.put(f"{key}/weights/tiny/{f.name}", f.read_bytes())
    args = ["tune", f"{s3_uri}/weights/tiny", f"{s3_uri}/data/train.jsonl", *ARGS, "--state", f"{s3_uri}/state"]
    return args, key


def start(args, env=None) -> subprocess.Popen:
    full = {**os.environ, "SPILLPACK_HEADLESS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full, cwd=REPO)


def wait_for_step(proc, step: int) -> list[dict]:
    seen = []
    for line in proc.stdout:
        seen.append(orjson.loads(line))
        if seen[-1]["event"] == "step" and seen[-1]["step"] >= step:
            return seen
    raise AssertionError(f"the job ended before step {step}: {proc.stderr.read()}")


def commits(s3, key) -> list[dict]:
    return [orjson.loads(s3.get(k)) for k in s3.keys(f"{key}/state/commits/")]


def test_preempted_and_resumed_on_s3_matches_local_and_leaks_no_credentials(job, reference, s3, home, tmp_path):
    args, key = job
    args = [*args, "--out", f"s3://{s3.bucket}/{key}/out"]
    env = {"SPILLPACK_STATUS": str(tmp_path / "status.json")}
    proc = start(args, env)
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGTERM)
    out1, err1 = proc.communicate(timeout=120)
    assert proc.returncode == 75, err1
    preempted = [e for e in events_of(out1) if e["event"] == "preempted"]
    assert len(preempted) == 1
    assert [c["step"] for c in commits(s3, key)][-1] == preempted[0]["step"]

    second = run_cli(args, env=env)
    assert second.returncode == 0, second.stderr
    evs = events_of(second.stdout)
    assert [e["step"] for e in evs if e["event"] == "restore"] == [preempted[0]["step"]]
    assert evs[-1]["event"] == "done" and evs[-1]["complete"] and evs[-1]["adapter"] == f"s3://{s3.bucket}/{key}/out"
    assert_same_tensors(st_load(s3.get(f"{key}/out/adapter_model.safetensors")), reference)
    assert_same_tensors(st_load(s3.get(f"{key}/state/adapter/adapter_model.safetensors")), reference)

    emitted = run_cli([*args, "--emit-config", str(tmp_path / "job.json")])
    assert emitted.returncode == 0, emitted.stderr
    # Every byte the job wrote: its S3 objects, its files under SPILLPACK_HOME, status file, config, stdout/stderr.
    blobs = {f"s3://{s3.bucket}/{k}": s3.get(k) for k in s3.keys(key)}
    blobs.update({str(p): p.read_bytes() for root in (home, tmp_path) for p in root.rglob("*") if p.is_file()})
    for name, text in (("out1", out1), ("err1", err1), ("out2", second.stdout), ("err2", second.stderr),
                       ("emit-out", emitted.stdout), ("emit-err", emitted.stderr)):
        blobs[name] = text.encode()
    assert any("/state/history/" in n for n in blobs) and any("/cache/weights/" in n for n in blobs)
    leaked = [n for n, b in blobs.items() if CANARY_KEY_ID.encode() in b or CANARY_SECRET.encode() in b]
    assert leaked == []


def test_killed_mid_upload_leaves_no_checkpoint_and_resumes_from_the_previous(job, reference, s3, fault_proxy):
    args, key = job
    # The first checkpoint is two PUTs (tensors, meta); hold the second checkpoint's tensors half-way.
    held = fault_proxy.stall(r"/state/checkpoints/", skip=2)
    proc = start(args, {"AWS_ENDPOINT_URL": fault_proxy.endpoint})
    try:
        assert held.arrived.wait(180), proc.stderr.read() if proc.poll() is not None else "no upload held"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        held.release()
    done = commits(s3, key)
    assert [(c["kind"], c["step"]) for c in done] == [("checkpoint", 2)]
    visible = {k.split("/state/")[1].split("/")[1] for k in s3.keys(f"{key}/state/checkpoints/")}
    assert visible == {f"00000001-{done[0]['writer']}"}  # nothing of the half-sent checkpoint

    again = run_cli(args)
    assert again.returncode == 0, again.stderr
    assert [e["step"] for e in events_of(again.stdout) if e["event"] == "restore"] == [2]
    assert_same_tensors(st_load(s3.get(f"{key}/state/adapter/adapter_model.safetensors")), reference)


def test_two_copies_racing_one_wins_each_commit_and_nothing_is_lost(job, reference, s3, fault_proxy):
    args, key = job
    fault_proxy.gate(r"/state/commits/00000001\.json", count=2)  # both reach the first commit before either lands
    env = {"AWS_ENDPOINT_URL": fault_proxy.endpoint}
    a, b = start(args, env), start(args, env)
    results = [(p.returncode, out, err) for p in (a, b) for out, err in [p.communicate(timeout=300)]]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 1], [r[2][-400:] for r in results]
    loser = next(err for code, _, err in results if code == 1)
    line = [l for l in loser.splitlines() if l.startswith("spillpack: ")]
    assert len(line) == 1 and "another process committed to" in line[0] and "(commit 1)" in line[0] and "Try: " in line[0]
    done = commits(s3, key)
    assert [c["seq"] for c in done][-1] == 3 and len({c["writer"] for c in done}) == 1
    assert_same_tensors(st_load(s3.get(f"{key}/state/adapter/adapter_model.safetensors")), reference)


def test_faults_on_the_wire_are_retried_and_the_job_completes(job, reference, s3, fault_proxy):
    args, key = job
    fault_proxy.fail(500, times=2, method="GET", path=r"/data/train\.jsonl")
    fault_proxy.cut(times=2, method="GET", path=r"/data/train\.jsonl")
    fault_proxy.cut(times=1, method="GET", path=r"/weights/tiny/model\.safetensors")
    fault_proxy.fail(503, times=3, method="PUT", path=r"/state/checkpoints/")
    fault_proxy.fail(503, times=2, method="PUT", path=r"/state/commits/")
    fault_proxy.cut(times=1, method="PUT", path=r"/state/commits/00000002\.json")  # lands; the answer is lost
    r = run_cli(args, env={"AWS_ENDPOINT_URL": fault_proxy.endpoint})
    assert r.returncode == 0, r.stderr
    assert events_of(r.stdout)[-1]["event"] == "done"
    assert [c["seq"] for c in commits(s3, key)] == [2, 3]  # the oldest pruned; seq 2 counted as this job's own
    injected = [s for _, _, s in fault_proxy.log if s in (500, 503, -1)]
    assert len(injected) == 2 + 2 + 1 + 3 + 2 + 1
    assert_same_tensors(st_load(s3.get(f"{key}/state/adapter/adapter_model.safetensors")), reference)
