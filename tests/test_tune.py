"""tune end to end: exact resume after SIGTERM and SIGKILL, config round trip, bad input."""

import json
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import run_until

DATA = str(REPO / "examples/data/train.jsonl")
BASE = ["tune", "tiny", DATA, "--steps", "40", "--batch", "4", "--lr", "2e-3", "--warmup", "5",
        "--targets", "q_proj,v_proj,up_proj", "--rank", "8"]


def adapter_of(path):
    return load_file(str(path / "adapter_model.safetensors"))


def losses_of(path):
    return [json.loads(l)["loss"] for l in (path / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_home, tmp_path_factory):
    """An uninterrupted run: the result every interrupted run must reproduce bit for bit."""
    ref = tmp_path_factory.mktemp("ref")
    r = run_cli(BASE + ["--state", str(ref / "state"), "--ckpt-every", "7"], env={"SPILLPACK_HOME": str(tiny_home)})
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["complete"] and done["steps"] == 40
    assert done["final_loss"] < done["first_loss"]
    return ref / "state" / "adapter"


def assert_same(a, b):
    ta, tb = adapter_of(a), adapter_of(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert np.array_equal(ta[k], tb[k]), k
    assert losses_of(a) == losses_of(b)


@pytest.mark.slow
@pytest.mark.parametrize("at", [3, 18])
def test_sigterm_then_resume_is_bit_identical(home, tmp_path, reference, at):
    state = str(tmp_path / "s")
    args = BASE + ["--state", state, "--ckpt-every", "7"]
    rc, events, err = run_until(args, lambda e: e["event"] == "step" and e["step"] == at)
    assert rc == 75, err
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM"
    stopped = pre[0]["step"]
    assert stopped >= at
    # The checkpoint at the stop is committed before the preempted event.
    ck = [e for e in events if e["event"] == "checkpoint"]
    assert ck and ck[-1]["step"] == stopped

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    restore = [e for e in ev if e["event"] == "restore"]
    assert restore and restore[0]["step"] == stopped
    assert [e["step"] for e in ev if e["event"] == "step"][0] == stopped + 1
    assert_same(tmp_path / "s" / "adapter", reference)


@pytest.mark.slow
def test_sigterm_during_checkpoints(home, tmp_path, reference):
    """With a commit after every step, the signal lands while checkpoints are written."""
    args = BASE + ["--state", str(tmp_path / "s"), "--ckpt-every", "1"]
    rc, events, err = run_until(args, lambda e: e["event"] == "checkpoint" and e["step"] == 11)
    assert rc == 75, err
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path / "s" / "adapter", reference)


@pytest.mark.slow
def test_sigkill_repeats_only_uncommitted_steps(home, tmp_path, reference):
    args = BASE + ["--state", str(tmp_path / "s"), "--ckpt-every", "7"]
    rc, events, _ = run_until(args, lambda e: e["event"] == "step" and e["step"] == 17, sig=signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert not any(e["event"] == "preempted" for e in events)
    last_commit = max(e["step"] for e in events if e["event"] == "checkpoint")
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert [e for e in ev if e["event"] == "restore"][0]["step"] == last_commit
    assert_same(tmp_path / "s" / "adapter", reference)


def test_second_run_of_a_finished_job_changes_nothing(home, tmp_path, reference):
    args = BASE + ["--state", str(reference.parent), "--ckpt-every", "7"]
    before = adapter_of(reference)
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert not [e for e in ev if e["event"] == "step"]
    assert ev[-1]["event"] == "done" and ev[-1]["complete"]
    after = adapter_of(reference)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_stop_after_then_continue(home, tmp_path, reference):
    args = BASE + ["--state", str(tmp_path / "s"), "--ckpt-every", "7"]
    r = run_cli(args + ["--stop-after", "12"])
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["stopped_early"] and not done["complete"] and done["steps"] == 12
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path / "s" / "adapter", reference)


def test_emit_config_then_config_runs_the_same_job(home, tmp_path, reference):
    cfg = tmp_path / "tune.toml"
    r = run_cli(BASE + ["--state", str(tmp_path / "s"), "--ckpt-every", "7", "--emit-config", str(cfg)])
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and not (tmp_path / "s").exists()  # emitted, nothing run
    import tomllib

    data = tomllib.loads(cfg.read_text())
    assert data["spillpack_config"] == 1 and data["command"] == "tune"
    assert data["arguments"] == {"model": "tiny", "data": DATA}
    # Every default is written out, including derived ones.
    assert data["options"]["alpha"] == 16.0 and data["options"]["schedule"] == "cosine" and data["options"]["name"] == "tune-train"
    r = run_cli(["tune", "--config", str(cfg)])
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path / "s" / "adapter", reference)


def test_option_next_to_config_wins(home, tmp_path):
    cfg = tmp_path / "tune.json"
    assert run_cli(BASE + ["--state", str(tmp_path / "s"), "--emit-config", str(cfg)]).returncode == 0
    r = run_cli(["tune", "--config", str(cfg), "--steps", "3"])
    assert r.returncode == 0, r.stderr
    assert events_of(r.stdout)[-1]["steps"] == 3
    emitted = tmp_path / "again.json"
    assert run_cli(["tune", "--config", str(cfg), "--lr", "0.5", "--emit-config", str(emitted)]).returncode == 0
    assert json.loads(emitted.read_text())["options"]["lr"] == 0.5


def test_events_have_the_common_keys(home, tmp_path):
    r = run_cli(BASE[:3] + ["--steps", "2", "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    common = {"event", "time", "command", "step", "loss", "tokens_per_s", "peak_mem_gb", "eta_s", "engine"}
    assert [e["event"] for e in ev] == ["start", "step", "step", "checkpoint", "done"]
    for e in ev:
        assert common <= set(e) and e["command"] == "tune" and e["engine"] == "torch-cpu"
    start = ev[0]
    assert {"job", "model", "placement", "state", "estimated_seconds", "message"} <= set(start)
    assert ev[-1]["adapter"] and ev[-1]["first_loss"] > 0


def _error(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("spillpack: ") and ". Try: " in lines[0]
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("content,needle", [
    ("", "is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n', "line 1 has no assistant content"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n', "line 2 is not JSON"),
    ('{"text": "x"}\n', "line 1 has neither"),
])
def test_bad_data_is_one_line(home, tmp_path, content, needle):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    r = run_cli(["tune", "tiny", str(data), "--state", str(tmp_path / "s")])
    assert r.returncode == 1
    assert needle in _error(r)
    assert not (tmp_path / "s").exists()  # bad input touches no state


@pytest.mark.parametrize("opt,needle", [(["--rank", "0"], "--rank must be positive"), (["--lr", "-1"], "--lr must be positive"),
                                        (["--targets", "q_proj,nope"], "unknown LoRA target 'nope'")])
def test_bad_options_are_one_line(home, tmp_path, opt, needle):
    r = run_cli(["tune", "tiny", DATA, "--state", str(tmp_path / "s")] + opt)
    assert r.returncode == 1 and needle in _error(r)
    assert not (tmp_path / "s").exists()


def test_missing_data_file(home, tmp_path):
    r = run_cli(["tune", "tiny", str(tmp_path / "nope.jsonl")])
    assert r.returncode == 1 and "does not exist" in _error(r)


def test_long_sequences_are_dropped_and_counted(home, tmp_path):
    r = run_cli(["tune", "tiny", DATA, "--steps", "1", "--max-seq", "80", "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    start = events_of(r.stdout)[0]
    import re

    dropped = int(re.search(r"(\d+) longer than --max-seq dropped", start["message"]).group(1))
    assert 0 < dropped < 200


def test_state_of_another_job_is_refused_and_untouched(home, tmp_path):
    state = tmp_path / "s"
    assert run_cli(BASE[:3] + ["--steps", "2", "--state", str(state)]).returncode == 0
    before = sorted(p.relative_to(state) for p in state.rglob("*"))
    r = run_cli(BASE[:3] + ["--steps", "2", "--lr", "3e-4", "--state", str(state)])
    assert r.returncode == 1
    assert "holds a different job: lr is 0.0001 there and 0.0003 here" in _error(r)
    assert sorted(p.relative_to(state) for p in state.rglob("*")) == before


def test_unwritable_state(home, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    import os

    if os.access(ro, os.W_OK):  # root ignores modes; use a path under a file instead
        (tmp_path / "file").write_text("")
        target = tmp_path / "file" / "state"
    else:
        target = ro / "state"
    r = run_cli(BASE[:3] + ["--steps", "1", "--state", str(target)])
    assert r.returncode == 1 and "not writable" in _error(r)

