"""Small promises kept exactly: --stop-after N rows is N rows, estimated_seconds is a number for
every job command, a build stopped by one signal emits one `preempted`, and doctor and models
print events like every other command."""

import json
import signal

import pytest

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import run_until

EXAMPLES = REPO / "examples" / "data"


@pytest.fixture
def rows(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Say {i}", "max_tokens": 3 + i % 4}) + "\n" for i in range(12)))
    return p


@pytest.mark.parametrize("n", [1, 3])
def test_row_job_stops_at_exactly_n_rows(home, tmp_path, rows, n):
    state = tmp_path / "s"
    r = run_cli(["run", "tiny", str(rows), "--batch", "8", "--max-tokens", "6", "--stop-after", str(n), "--state", str(state)])
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert sum(e["event"] == "row" for e in ev) == n
    done = ev[-1]
    assert done["event"] == "done" and done["rows"] == n and done["stopped_early"]
    r = run_cli(["run", "tiny", str(rows), "--batch", "8", "--max-tokens", "6", "--state", str(state), "--out", str(tmp_path / "o.jsonl")])
    assert r.returncode == 0, r.stderr
    ids = [json.loads(line)["custom_id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(12)]


def test_estimated_seconds_is_a_number_for_every_job_command(home, tmp_path, rows):
    evals = EXAMPLES / "evals.jsonl"
    jobs = {
        "tune": ["tune", "tiny", str(EXAMPLES / "train.jsonl"), "--steps", "1"],
        "run": ["run", "tiny", str(rows), "--max-tokens", "2"],
        "eval": ["eval", "tiny", str(evals), "--max-tokens", "2"],
        "distill": ["distill", "tiny", str(EXAMPLES / "prompts.jsonl"), "--max-tokens", "2"],
        "build": ["build", str(EXAMPLES), "--max-tokens", "2", "--steps", "1"],
    }
    for command, args in jobs.items():
        r = run_cli(args + ["--state", str(tmp_path / command), "--stop-after", "tune:1" if command == "build" else "1"])
        assert r.returncode == 0, (command, r.stderr)
        start = next(e for e in events_of(r.stdout) if e["event"] == "start")
        est = start["estimated_seconds"]
        assert isinstance(est, (int, float)) and not isinstance(est, bool) and est >= 0, (command, est)


@pytest.mark.slow
def test_a_build_stopped_by_one_signal_emits_one_preempted(home, tmp_path):
    args = ["build", str(EXAMPLES), "--max-tokens", "4", "--steps", "30", "--state", str(tmp_path / "b")]
    rc, events, err = run_until(args, lambda e: e["event"] == "step" and e.get("stage") == "tune" and e["step"] >= 2)
    assert rc == 75, err
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["stage"] == "tune" and pre[0]["signal"] == "SIGTERM"
    rc, events, err = run_until(args, lambda e: e["event"] == "row" and e.get("stage") == "eval", sig=signal.SIGHUP)
    assert rc == 75, err
    assert [e["signal"] for e in events if e["event"] == "preempted"] == ["SIGHUP"]


def test_doctor_and_models_print_events(home):
    r = run_cli(["doctor", "--no-measure"])
    assert r.returncode == 0, r.stderr
    (report,) = events_of(r.stdout)
    assert report["event"] == "doctor" and report["command"] == "doctor" and report["engines"]["torch-cpu"]["usable"]
    r = run_cli(["models"])
    models = events_of(r.stdout)
    assert models and all(m["event"] == "model" and m["command"] == "models" for m in models)
    assert any(m["name"] == "tiny" for m in models)
