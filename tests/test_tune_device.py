"""tune's device-facing promises, end to end on torch-cpu: dropout that resumes exactly, the
device and software recorded per process (and `status` saying which resume promise applied),
an estimate from the engine's measured rate, and a peak memory that is the job's own."""

import json
import signal

import numpy as np
import pytest

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import run_until
from runtime.commands.status import resume_promise
from runtime.jobs.tune import engine_estimate

DATA = str(REPO / "examples/data/train.jsonl")
BASE = ["tune", "tiny", DATA, "--steps", "12", "--batch", "4", "--lr", "2e-3", "--warmup", "2",
        "--targets", "q_proj,v_proj,up_proj", "--rank", "8", "--ckpt-every", "3"]


def adapter_and_losses(state):
    from safetensors.numpy import load_file

    adapter = load_file(str(state / "adapter" / "adapter_model.safetensors"))
    losses = [json.loads(l)["loss"] for l in (state / "adapter" / "train_log.jsonl").read_text().splitlines()]
    return adapter, losses


def assert_same(a, b):
    (ta, la), (tb, lb) = a, b
    assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)
    assert la == lb


@pytest.fixture(scope="module")
def dropout_reference(tiny_home, tmp_path_factory):
    ref = tmp_path_factory.mktemp("dropout-ref") / "s"
    r = run_cli(BASE + ["--dropout", "0.1", "--state", str(ref)], env={"SPILLPACK_HOME": str(tiny_home)})
    assert r.returncode == 0, r.stderr
    return ref


def test_dropout_resumes_exactly(home, tmp_path, dropout_reference):
    state = tmp_path / "s"
    args = BASE + ["--dropout", "0.1", "--state", str(state)]
    r = run_cli(args + ["--stop-after", "5"])
    assert r.returncode == 0, r.stderr
    r = run_cli(args)  # a new process: torch's global generator starts over, dropout's masks must not
    assert r.returncode == 0, r.stderr
    assert [e for e in events_of(r.stdout) if e["event"] == "restore"][0]["step"] == 5
    assert_same(adapter_and_losses(state), adapter_and_losses(dropout_reference))
    # Dropout really drops: without it the same job trains differently.
    r = run_cli(BASE + ["--state", str(tmp_path / "plain")])
    assert r.returncode == 0, r.stderr
    assert adapter_and_losses(tmp_path / "plain")[1] != adapter_and_losses(dropout_reference)[1]


@pytest.mark.slow
def test_dropout_sigterm_then_resume_is_bit_identical(home, tmp_path, dropout_reference):
    args = BASE + ["--dropout", "0.1", "--state", str(tmp_path / "s")]
    rc, events, err = run_until(args, lambda e: e["event"] == "step" and e["step"] == 4, sig=signal.SIGTERM)
    assert rc == 75, err
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert_same(adapter_and_losses(tmp_path / "s"), adapter_and_losses(dropout_reference))


def test_each_process_records_its_device_and_status_says_which_promise_applied(home, tmp_path):
    state = tmp_path / "s"
    args = BASE + ["--state", str(state)]
    first = run_cli(args + ["--stop-after", "3"])
    assert first.returncode == 0, first.stderr
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    records = [json.loads(p.read_text()) for p in sorted((state / "history").iterdir())]
    engines = [x for x in records if x["what"] == "engine"]
    assert len(engines) == 2
    import torch

    for x in engines:
        assert x["engine"] == "torch-cpu" and x["dtype"] == "float32"
        assert x["software"] == f"torch {torch.__version__}" and x["device"]

    st = run_cli(["status", str(state)])
    assert st.returncode == 0, st.stderr
    told = events_of(st.stdout)
    assert next(e for e in told if e["kind"] == "resume_promise")["promise"] == "bit-identical"
    ran = [e for e in told if e["kind"] == "engine"]
    assert len(ran) == 2 and all(e["device"] == engines[0]["device"] for e in ran)


def test_resume_promise_names_what_changed():
    a = {"engine": "torch-cuda", "device": "NVIDIA A100-SXM4-80GB (sm_80, 79 GB)", "software": "torch 2.13.0, CUDA 12.8, cuDNN 91000", "dtype": "bfloat16"}
    b = {**a, "device": "NVIDIA H100 80GB HBM3 (sm_90, 79 GB)"}
    assert resume_promise([a, dict(a)])["promise"] == "bit-identical"
    told = resume_promise([a, b])
    assert told["promise"] == "within tolerance" and "the device changed" in told["why"] and "H100" in told["why"]
    c = {**a, "engine": "torch-cpu", "device": "x86", "software": "torch 2.13.0", "dtype": "float32"}
    assert "engine and device and software and base dtype" in resume_promise([a, c])["why"]
    assert resume_promise([a]) is None


def test_estimate_uses_the_engines_measured_rate(home, tmp_path):
    r = run_cli(BASE + ["--state", str(tmp_path / "s"), "--stop-after", "1"])
    assert r.returncode == 0, r.stderr
    start = events_of(r.stdout)[0]
    assert start["event"] == "start" and start["rate_gflops"] > 0 and start["rate_dtype"] == "float32"
    # Measured once, remembered for the next job on this machine (doctor writes the same file).
    path = home / "cache" / "rates.json"
    rates = json.loads(path.read_text())
    (key, rate), = rates.items()
    assert key.startswith("torch-cpu: ") and rate["matmul_gflops"] == start["rate_gflops"]
    # A machine ten times slower gets an estimate ten times longer.
    path.write_text(json.dumps({key: {**rate, "matmul_gflops": rate["matmul_gflops"] / 10}}))
    r = run_cli(BASE + ["--state", str(tmp_path / "s2"), "--stop-after", "1"])
    slow = events_of(r.stdout)[0]
    assert slow["rate_gflops"] == pytest.approx(rate["matmul_gflops"] / 10)
    config = json.loads((home / "models" / "tiny" / "config.json").read_text())
    assert slow["estimated_seconds"] == pytest.approx(10 * start["estimated_seconds"], abs=0.6)
    # 12 steps of 4 examples of 10-300 tokens each, at the remembered rate.
    assert engine_estimate(config, 12 * 4 * 10, slow["rate_gflops"]) <= slow["estimated_seconds"]
    assert slow["estimated_seconds"] <= engine_estimate(config, 12 * 4 * 300, slow["rate_gflops"])


def test_peak_memory_is_the_jobs_own():
    """A second job in one process (a build's stages) reports its own peak, not the first's."""
    import torch

    from runtime.engines.torch.device import PeakMemory

    big = np.ones(300 * 2**20 // 8)  # 300 MB resident
    peak = PeakMemory(torch.device("cpu"))
    held = peak.gb()
    del big
    peak.reset()
    if peak.gb() >= held:
        pytest.skip("this kernel does not let a process reset its peak resident set (/proc/self/clear_refs)")
    assert held - peak.gb() > 0.2
