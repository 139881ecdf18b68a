"""A stop from the first instruction on: SIGTERM or SIGHUP at any moment of a job's start
(imports, resolving, loading, the first steps, an S3 weight download) exits 75, and the same
command run again ends exactly as an uninterrupted run does."""

import json
import signal

import pytest

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import signal_after, start
from test_tune import assert_same
from tests.support.s3_fixtures import fault_proxy, s3, s3_uri  # noqa: F401

DATA = str(REPO / "examples/data/train.jsonl")
TUNE = ["tune", "tiny", DATA, "--steps", "12", "--batch", "4", "--lr", "2e-3", "--targets", "q_proj,v_proj", "--rank", "4",
        "--ckpt-every", "3"]


# Long enough to be still running 3 s after its start on a fast machine (a tiny step takes ~20 ms
# with one thread; 12 steps ended before the 3 s signal in two workers).
LONG = [*TUNE[:4], "240", *TUNE[5:-1], "20"]


def finished(args, tiny_home, tmp_path_factory):
    ref = tmp_path_factory.mktemp("ref")
    r = run_cli(args + ["--state", str(ref / "state")], env={"SPILLPACK_HOME": str(tiny_home)}, timeout=1800)
    assert r.returncode == 0, r.stderr
    return ref / "state" / "adapter"


@pytest.fixture(scope="module")
def reference(tiny_home, tmp_path_factory):
    return finished(TUNE, tiny_home, tmp_path_factory)


@pytest.fixture(scope="module")
def long_reference(tiny_home, tmp_path_factory):
    return finished(LONG, tiny_home, tmp_path_factory)


def stopped_then_rerun(args, at, sig, env=None):
    p = start(args, env)
    signal_after(p, at, sig)
    out, err = p.communicate(timeout=1800)
    assert p.returncode == 75, f"exit {p.returncode} for {sig.name} at {at}s: {err}"
    events = events_of(out)
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == sig.name, events
    assert not any(e["event"] == "error" for e in events)
    assert "Traceback" not in err
    return pre[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("at", [0.2, 0.5, 1, 2, 3])
def test_stop_while_starting_exits_75_and_resumes(home, tmp_path, long_reference, at, sig):
    state = tmp_path / "s"
    args = LONG + ["--state", str(state)]
    pre = stopped_then_rerun(args, at, sig)
    if pre["step"] is None:  # stopped before it opened the state: nothing of it was written
        assert not (state / "commits").exists() or not list((state / "commits").iterdir())
    r = run_cli(args, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert_same(state / "adapter", long_reference)


def test_stop_before_the_state_is_opened_writes_nothing(home, tmp_path):
    """The handler catches a stop during the CLI's own imports: exit 75, a `preempted` event, no state."""
    state = tmp_path / "s"
    p = start(TUNE + ["--state", str(state)])
    signal_after(p, 0.0)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    pre = [e for e in events_of(out) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["step"] is None and pre[0]["signal"] == "SIGTERM"
    assert not state.exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_stop_during_an_s3_weight_download(home, tmp_path, reference, s3, s3_uri, fault_proxy, sig):
    """The download is abandoned (the stalled transfer does not hold the exit), the partial file
    is never taken for complete, and the rerun stages the weights and ends as an uninterrupted run."""
    from runtime.state.staging import MANIFEST, cache_dir

    weights = s3_uri + "/weights/tiny"
    for f in sorted((home / "models" / "tiny").iterdir()):
        s3.put(weights[len(f"s3://{s3.bucket}/"):] + "/" + f.name, f.read_bytes())
    held = fault_proxy.stall(r"/weights/tiny/model\.safetensors", method="GET")
    state = tmp_path / "s"
    args = ["tune", weights, *TUNE[2:], "--state", str(state)]
    p = start(args, env={"AWS_ENDPOINT_URL": fault_proxy.endpoint})
    try:
        assert held.arrived.wait(120), "the download never started"
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)  # the stalled GET is never answered while it runs
    finally:
        held.release()
    assert p.returncode == 75, err
    pre = [e for e in events_of(out) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == sig.name and pre[0]["step"] is None
    assert not state.exists()  # stopped before the state was opened
    dest = cache_dir(weights, "weights")
    assert "model.safetensors" not in (json.loads((dest / MANIFEST).read_text()) if (dest / MANIFEST).exists() else {})
    assert not (dest / "model.safetensors").exists()

    r = run_cli(args, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert (dest / "model.safetensors").read_bytes() == (home / "models" / "tiny" / "model.safetensors").read_bytes()
    assert not list(dest.rglob("*.tmp"))
    assert_same(state / "adapter", reference)
