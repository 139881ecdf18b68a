"""The grace budget from the platform: SPILLPACK_GRACE_S (or --grace-s) is the promise, and a
step that cannot finish within it is abandoned so the job exits 75, with its checkpoint, in time."""

import json
import math
import os
import signal
import time

import pytest

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import start
from tests.support.memory_shapes import make_data

DATA = str(REPO / "examples/data/train.jsonl")


def tune(accum: int, steps: int, data: str = DATA) -> list[str]:
    return ["tune", "tiny", data, "--steps", str(steps), "--batch", "4", "--grad-accum", str(accum), "--targets", "q_proj,v_proj",
            "--rank", "4", "--ckpt-every", "1", "--max-seq", "2048"]


@pytest.mark.slow
@pytest.mark.parametrize("threads", ["1", "2"])
def test_slow_step_is_abandoned_within_a_5_second_grace(home, tmp_path, threads):
    # Long rows (about 1,000 tokens), enough of them that a step is never the whole data set: a
    # step of about 12 s on this machine, whatever its speed, scaled from a measured one (the
    # second: the first also pays for warming up). On two threads each micro-batch's rows are
    # split between them (row_threads.py): a stop abandons the step while a worker still runs its part.
    if threads == "2" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    env = {"SPILLPACK_THREADS": threads, "OMP_NUM_THREADS": ""}
    data = str(make_data(tmp_path / "long.jsonl", 512, 400, seed=2))
    r = run_cli(tune(4, 2, data) + ["--state", str(tmp_path / "calib")], env=env, timeout=1800)
    assert r.returncode == 0, r.stderr
    step_s = min(e["step_s"] for e in events_of(r.stdout) if e["event"] == "step")
    accum = min(128, max(8, math.ceil(4 * 12.0 / step_s)))

    state = tmp_path / "s"
    p = start(tune(accum, 4, data) + ["--state", str(state)], env={**env, "SPILLPACK_GRACE_S": "5"})
    events = []
    for line in p.stdout:
        events.append(json.loads(line))
        if events[-1]["event"] == "checkpoint" and events[-1]["step"] == 1:
            break
    time.sleep(0.5)  # well inside step 2
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=600)
    took = time.monotonic() - sent
    assert p.returncode == 75, err
    events += events_of(out)
    assert next(e for e in events if e["event"] == "start")["threads"] == int(threads)
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["abandoned_quantum"] is True and pre[0]["step"] == 1 and pre[0]["grace_s"] == 5.0
    assert took < 5.0, f"exit {took:.2f} s after SIGTERM, past the 5 s grace"
    assert [e["step"] for e in events if e["event"] == "step"] == [1]  # step 2 was thrown away, not finished

    r = run_cli(tune(accum, 4, data) + ["--state", str(state), "--stop-after", "2"], env=env, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in events_of(r.stdout) if e["event"] == "restore"] == [1]


def test_grace_option_and_variable_are_checked(home, tmp_path):
    r = run_cli(tune(1, 2) + ["--grace-s", "0", "--state", str(tmp_path / "s")])
    assert r.returncode == 1 and "--grace-s must be positive" in r.stderr
    r = run_cli(tune(1, 2) + ["--state", str(tmp_path / "s")], env={"SPILLPACK_GRACE_S": "soon"})
    assert r.returncode == 1 and "SPILLPACK_GRACE_S='soon' is not a positive number" in r.stderr, r.stderr
