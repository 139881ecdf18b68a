"""The requeue guard: a job whose starts never get past their checkpoint stops with exit 1 and
one line saying why; a job that progresses is never stopped by it, however often preempted.

The end-to-end tests play the platform: SIGTERM, then SIGKILL once the grace is over. The
grace-shorter-than-a-checkpoint case kills the job the moment its history says it began
committing (the `stopping` record), as a platform whose grace is shorter than a commit does.
"""

import json
import signal
import time

import pytest

from runtime.core import requeue
from tests.conftest import events_of, run_cli
from tests.support.jobproc import start

TINY = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "400", "--rank", "64",
        "--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]


def _history(state) -> list[dict]:
    out = []
    for p in (state / "history").glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:
            continue
    return out


def _kill_while_committing(args, state) -> int:
    """Start the job, SIGTERM it after a step, SIGKILL it as soon as it starts committing."""
    before = sum(r["what"] == "stopping" for r in _history(state))
    p = start(args)
    for line in p.stdout:
        if json.loads(line)["event"] == "step":
            p.send_signal(signal.SIGTERM)
            break
    end = time.monotonic() + 120
    while time.monotonic() < end and sum(r["what"] == "stopping" for r in _history(state)) == before and p.poll() is None:
        time.sleep(0.001)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    return p.returncode


@pytest.mark.slow
def test_guard_stops_a_job_whose_grace_is_shorter_than_its_checkpoint(home, tmp_path):
    state = tmp_path / "state"
    args = TINY + ["--state", str(state), "--ckpt-every", "2", "--grace-s", "0.005", "--max-stalled-starts", "2"]
    first = run_cli(args + ["--stop-after", "2"])  # one committed checkpoint: the state knows what a commit takes
    assert first.returncode == 0, first.stderr
    ckpt_s = max(r["seconds"] for r in _history(state) if r["what"] == "checkpoint")
    for _ in range(2):
        assert _kill_while_committing(args, state) == -signal.SIGKILL
    committed = sorted((state / "commits").glob("*.json"))
    assert [json.loads(c.read_text())["step"] for c in committed] == [2]  # neither start got past step 2

    r = run_cli(args)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("spillpack: the last 2 starts of this job made no progress past its checkpoint at step 2")
    assert "grace period (0.005 s) is shorter than a checkpoint takes" in line and f"up to {ckpt_s:g} s" in line
    assert "Try: a longer grace" in line and "--max-stalled-starts 0" in line
    assert [e["event"] for e in events_of(r.stdout)][-1] == "error"
    assert [json.loads(c.read_text())["step"] for c in sorted((state / "commits").glob("*.json"))] == [2]  # nothing trained

    # Refused again on the next requeue (the guard's own start counts for nothing) ...
    assert run_cli(args).returncode == 1
    story = events_of(run_cli(["status", str(state), "--headless"]).stdout)
    counts = next(e for e in story if e["kind"] == "starts")
    assert (counts["starts"], counts["hard_kills"], counts["stalled_in_a_row"]) == (5, 2, 2)
    assert sum(e["kind"] == "requeue_guard" for e in story) == 2
    # ... and a start with the longer grace the line asks for runs (a changed setting begins a new count).
    r = run_cli(args[:-4] + ["--grace-s", "30", "--max-stalled-starts", "2", "--stop-after", "4"])
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in events_of(r.stdout) if e["event"] == "restore"] == [2]


@pytest.mark.slow
def test_guard_never_stops_a_job_that_progresses(home, tmp_path):
    """Preempted four times with --max-stalled-starts 1: each start commits something, so it runs to the end."""
    state = tmp_path / "state"
    # 40 steps: a start signalled at its second step never reaches the end first, even where steps take milliseconds.
    args = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "40", "--state", str(state), "--ckpt-every", "100",
            "--max-stalled-starts", "1"]
    for n in range(4):
        p = start(args)
        seen = 0
        for line in p.stdout:
            if json.loads(line)["event"] == "step":
                seen += 1
                if seen == 2:
                    p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 75, err[-2000:]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["complete"] and done["steps"] == 40
    counts = next(e for e in events_of(run_cli(["status", str(state), "--headless"]).stdout) if e["kind"] == "starts")
    assert (counts["starts"], counts["preemptions"], counts["stalled_in_a_row"]) == (5, 4, 0)


def _rec(writer, what, t, **kw):
    return {"writer": writer, "what": what, "time": t, **kw}


def test_a_node_that_dies_at_the_same_step_every_time():
    """Three hard kills, each reaching step 7 past the checkpoint at step 5: the line names the step."""
    history = [_rec("a", "open", 1, settings="s", grace_s=30), _rec("a", "checkpoint", 2, step=5, seconds=0.2),
               _rec("a", "interrupted", 3, step=5)]
    progress = {}
    for i, w in enumerate("bcd"):
        history += [_rec(w, "open", 10 + i, settings="s", grace_s=30), _rec(w, "resume", 10.5 + i, step=5)]
        progress[w] = {"writer": w, "done": 7}
    every = requeue.starts(history, progress)
    streak = requeue.stalled(every, "s")
    assert [s.writer for s in streak] == ["d", "c", "b"]  # "a" committed: the streak ends there
    line, fix = requeue.diagnose(streak, every, "step", 3)
    assert line == ("the last 3 starts of this job made no progress past its checkpoint at step 5: it dies at step 7 every time "
                    "(killed with no record: out of memory, a lost machine)")
    assert "--max-stalled-starts 0" in fix
    assert requeue.stalled(every, "other settings") == []  # a changed config or grace begins a new count
    history.append(_rec("e", "open", 20, settings="s"))
    history.append(_rec("e", "failed", 21, step=5, error="spillpack: x"))
    assert requeue.stalled(requeue.starts(history, progress), "s") == []  # an exit 1 is a person's retry, not a requeue
