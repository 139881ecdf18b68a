"""`spillpack status`: the story of a job interrupted by SIGTERM, hard killed, and resumed on
other machines and engines, as a person reads it and as JSON lines (golden files), and from
real processes stopped by real signals."""

import json
import os
import signal
import struct

import orjson
import pytest

from conftest import REPO, events_of, run_cli
from tests.support.jobproc import start

GOLDEN = REPO / "tests" / "golden"
DATA = str(REPO / "examples/data/train.jsonl")


def write_history(state, records, progress=()):
    """A state's history as the job writes it (runtime/state/jobstate.py), with fixed values."""
    (state / "history").mkdir(parents=True)
    (state / "progress").mkdir()
    (state / "job.json").write_text("{}")
    (state / "invocation.json").write_text(json.dumps({"spillpack_config": 1, "command": "tune", "arguments": {},
                                                      "options": {"name": "mine"}}))
    for n, r in enumerate(records):
        (state / "history" / f"{int(r['time'] * 1e6):017d}-{r['writer']}-{n:05d}.json").write_bytes(orjson.dumps(r))
    for p in progress:
        (state / "progress" / f"{p['writer']}.json").write_bytes(orjson.dumps(p))


def story_state(root):
    a = {"host": "gpu-a", "pid": 101, "writer": "aaaa"}
    b = {"host": "mac-b", "pid": 202, "writer": "bbbb"}
    c = {"host": "node-c", "pid": 303, "writer": "cccc"}
    u = str(root / "s" / "commits")
    write_history(root / "s", [
        {**a, "what": "open", "time": 1.8e9, "engine": "torch-cpu", "device": "Intel Xeon, 8 cores, 31.2 GB", "scheduler": "slurm",
         "job_id": "42", "partition": "spot"},
        {**a, "what": "engine", "time": 1.8e9 + 1, "engine": "torch-cpu", "device": "Intel Xeon (x86_64)", "software": "torch 2.13.0", "dtype": "float32"},
        {**a, "what": "checkpoint", "time": 1.8e9 + 10, "step": 5, "seq": 1, "uri": f"{u}/00000001.json", "seconds": 0.041},
        # The checkpoint the signal triggered is logged first; its interruption is told before it.
        {**a, "what": "checkpoint", "time": 1.8e9 + 20.4, "step": 7, "seq": 2, "uri": f"{u}/00000002.json", "seconds": 0.038},
        {**a, "what": "interrupted", "time": 1.8e9 + 20.5, "signal": "SIGTERM", "step": 7, "abandoned_quantum": True,
         "seconds": 0.62, "grace_s": 30.0, "signalled": 1.8e9 + 19.9},
        {**b, "what": "open", "time": 1.8e9 + 100, "engine": "mlx", "device": "Apple M2 Max, 12 cores, 64.0 GB"},
        {**b, "what": "engine", "time": 1.8e9 + 100.2, "engine": "mlx", "device": "Apple M2 Max GPU (Metal)", "software": "mlx 0.32.4", "dtype": "bfloat16"},
        {**b, "what": "place", "time": 1.8e9 + 100.5, "cloud": "aws", "zone": "us-east-1a", "instance_type": "g5.xlarge"},
        {**b, "what": "resume", "time": 1.8e9 + 101, "step": 7, "uri": f"{u}/00000002.json"},
        {**b, "what": "checkpoint", "time": 1.8e9 + 110, "step": 10, "seq": 3, "uri": f"{u}/00000003.json", "seconds": 0.2},
        {**c, "what": "open", "time": 1.8e9 + 200, "engine": "torch-cuda", "device": "NVIDIA A10G, 22.5 GB", "scheduler": "kubernetes",
         "pod": "spillpack-mine-x7k2p", "world": 4, "hosts": ["node-c", "node-c", "node-d", "node-d"]},
        {**c, "what": "engine", "time": 1.8e9 + 200.5, "engine": "torch-cuda", "device": "NVIDIA A10G (sm_86, 22 GB)",
         "software": "torch 2.13.0, CUDA 12.8, cuDNN 91000", "dtype": "bfloat16"},
        {**c, "what": "resume", "time": 1.8e9 + 201, "step": 10, "uri": f"{u}/00000003.json"},
        {**c, "what": "eval", "time": 1.8e9 + 229, "step": 20, "val_loss": 1.2345678, "tokens": 512, "seconds": 0.8, "best_step": 20},
        {**c, "what": "checkpoint", "time": 1.8e9 + 230, "step": 20, "seq": 4, "uri": f"{u}/00000004.json", "seconds": 0.05},
        {**c, "what": "done", "time": 1.8e9 + 231, "step": 20},
    ], progress=[{**b, "done": 14, "time": 1.8e9 + 113}])
    return root / "s"


def normalized(text, root):
    return text.replace(str(root), "ROOT")


def test_story_golden(home, tmp_path):
    state = story_state(tmp_path)
    human = run_cli(["status", str(state)], env={"SPILLPACK_HEADLESS": "0"})
    assert human.returncode == 0, human.stderr
    lines = run_cli(["status", str(state), "--headless"])
    assert lines.returncode == 0, lines.stderr
    if os.environ.get("SPILLPACK_UPDATE_GOLDEN"):
        (GOLDEN / "status.txt").write_text(normalized(human.stdout, tmp_path))
        (GOLDEN / "status.jsonl").write_text(normalized(lines.stdout, tmp_path))
    assert normalized(human.stdout, tmp_path) == (GOLDEN / "status.txt").read_text()
    assert normalized(lines.stdout, tmp_path) == (GOLDEN / "status.jsonl").read_text()
    # One JSON line per annotation, in the order things happened.
    events = events_of(lines.stdout)
    assert len(events) == len(human.stdout.splitlines())
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    kill = next(e for e in events if e["kind"] == "hard_kill")
    assert (kill["committed"], kill["reached"], kill["repeated"]) == (10, 14, 4)
    starts = next(e for e in events if e["kind"] == "starts")
    assert (starts["starts"], starts["preemptions"], starts["hard_kills"]) == (3, 1, 1)
    assert next(e for e in events if e["kind"] == "eval")["val_loss"] == 1.2345678
    # Resumed on other engines: what ran where (a hard kill's repeated steps counted once), and
    # the tolerance promised instead of bit-identity.
    promise = events[-1]
    assert promise["kind"] == "resume_promise" and promise["promise"] == "within tolerance"
    assert [(p["engine"], p["first"], p["last"]) for p in promise["ran"]] == [("torch-cpu", 1, 7), ("mlx", 8, 10), ("torch-cuda", 11, 20)]
    assert "cosine >= 0.999" in promise["tolerance"]  # bfloat16 bases: docs/state.md's half-precision promise


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png(home, tmp_path):
    state = tmp_path / "s"
    r = run_cli(["tune", "tiny", DATA, "--steps", "6", "--ckpt-every", "2", "--targets", "q_proj", "--rank", "2", "--state", str(state)])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "loss.png"
    r = run_cli(["status", str(state), "--plot", str(out)])
    assert r.returncode == 0, r.stderr
    width, height = png_size(out)
    assert (width, height) == (650, 400)


@pytest.mark.slow
def test_story_of_real_interruptions(home, tmp_path):
    """SIGTERM, then SIGKILL after a known step on another engine, then the end: all told."""
    from runtime.engines.hardware import probe

    state = tmp_path / "s"
    args = ["tune", "tiny", DATA, "--steps", "24", "--ckpt-every", "4", "--targets", "q_proj,v_proj", "--rank", "4", "--state", str(state)]
    p = start(args)
    for line in p.stdout:
        if json.loads(line)["event"] == "step" and json.loads(line)["step"] >= 2:
            p.send_signal(signal.SIGTERM)
            break
    p.communicate(timeout=120)
    assert p.returncode == 75

    second = "mlx" if probe("mlx").usable else "torch-cpu"
    p = start(args + ["--engine", second])
    seen = 0
    for line in p.stdout:
        e = json.loads(line)
        if e["event"] == "step":
            seen = e["step"]
            if seen >= 10 and seen % 4 != 0:
                p.send_signal(signal.SIGSTOP)  # frozen: nothing more happens until the kill
                break
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    human = run_cli(["status", str(state)], env={"SPILLPACK_HEADLESS": "0"}).stdout
    events = events_of(run_cli(["status", str(state), "--headless"]).stdout)
    kinds = [e["kind"] for e in events if e["kind"] not in ("resume_promise", "starts")]  # the closing lines
    assert kinds.count("process") == 3 and kinds.count("resume") == 2 and kinds[-1] == "done"
    starts = next(e for e in events if e["kind"] == "starts")  # the requeue guard's counts
    assert (starts["starts"], starts["preemptions"], starts["hard_kills"], starts["stalled_in_a_row"]) == (3, 1, 1, 0)
    intr = next(e for e in events if e["kind"] == "interrupted")
    after = events[events.index(intr) + 1]
    assert intr["signal"] == "SIGTERM" and after["kind"] == "checkpoint" and after["step"] == intr["step"]
    assert intr["seconds"] < intr["grace_s"] == 30.0 and "within the 30 s grace" in human
    kill = next(e for e in events if e["kind"] == "hard_kill")
    assert kill["committed"] == seen // 4 * 4 and seen - 1 <= kill["reached"] <= seen
    assert kill["repeated"] == kill["reached"] - kill["committed"] > 0
    procs = [e for e in events if e["kind"] == "process"]
    assert [p["engine"] for p in procs] == ["torch-cpu", second, "torch-cpu"] and all(p["device"] for p in procs)
    assert f"interrupted by SIGTERM at step {intr['step']}" in human and "HARD KILL" in human
    promise = events[-1]
    assert promise["kind"] == "resume_promise"
    if second == "mlx":  # what ran where, and the cross-engine tolerance rather than bit-identity
        assert promise["promise"] == "within tolerance" and promise["why"].startswith("the engine and software changed")
        assert [(p["engine"], p["first"], p["last"]) for p in promise["ran"]] == \
            [("torch-cpu", 1, intr["step"]), ("mlx", intr["step"] + 1, kill["committed"]), ("torch-cpu", kill["committed"] + 1, 24)]
        assert f"steps {intr['step'] + 1}-{kill['committed']} on mlx (" in human
    else:
        assert promise["promise"] == "bit-identical"
