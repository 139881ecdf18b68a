"""What --report-to costs a tune step, through the CLI as a user runs it: the median `step_s`
of the job's own step events, without a tracker and with each one, in alternating rounds (this
kind of host swings by 1.5x within minutes); the first steps are left out (warm-up).

    python benchmarks/bench_trackers.py                                  # tiny, 200 steps, 3 rounds, tensorboard
    python benchmarks/bench_trackers.py --trackers tensorboard mlflow wandb --steps 300 --rounds 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 5


def step_times(a, report_to: str | None) -> tuple[list[float], float]:
    state = Path(tempfile.mkdtemp(prefix="bench-trackers-")) / "s"
    cmd = [sys.executable, "-m", "spillpack", "tune", a.model, a.data, "--steps", str(a.steps), "--batch", str(a.batch),
           "--state", str(state), "--ckpt-every", str(a.ckpt_every), "--targets", "q_proj,v_proj", "--rank", "8"]
    if report_to:
        cmd += ["--report-to", report_to]
    env = {**os.environ, "SPILLPACK_HEADLESS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("SPILLPACK_REPORT_TO", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    events = [json.loads(line) for line in r.stdout.splitlines()]
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    if warnings:
        sys.exit(f"--report-to {report_to}: {warnings[0]}")
    done = events[-1]
    return [e["step_s"] for e in events if e["event"] == "step" and e["step"] > WARMUP], done["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default=str(REPO / "examples/data/train.jsonl"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trackers", nargs="+", default=["tensorboard"])
    ap.add_argument("--json", action="store_true", help="one JSON line at the end")
    a = ap.parse_args()
    sides = [None, *a.trackers]
    times = {s: [] for s in sides}
    job_s = {s: [] for s in sides}
    load0 = os.getloadavg()[0]
    for _ in range(a.rounds):
        for side in sides:
            t, secs = step_times(a, side)
            times[side] += t
            job_s[side].append(secs)
    base = statistics.median(times[None])
    out = {"model": a.model, "steps": a.steps, "rounds": a.rounds, "median_step_s": {}, "ratio": {}, "job_s": {},
           "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    for side in sides:
        name = side or "none"
        med = statistics.median(times[side])
        out["median_step_s"][name] = round(med, 5)
        out["ratio"][name] = round(med / base, 3)
        out["job_s"][name] = round(statistics.median(job_s[side]), 2)
        if not a.json:
            print(f"--report-to {name:12s} median step {med * 1000:.2f} ms ({med / base:.3f}x), job {out['job_s'][name]:.2f} s")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
