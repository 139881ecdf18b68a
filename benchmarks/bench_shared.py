"""`spillpack run` and `tune` on shared cores: a busy process holds one CPU while each runs at
default settings and at every thread count, side by side in one run.

    python benchmarks/bench_shared.py                    # tiny, 32 rows and 12 steps, 2 rounds
    python benchmarks/bench_shared.py --model /path/to/SmolLM2-135M-Instruct --rows 8

The competitor is a Python busy loop pinned to the last allowed CPU, started before each
measurement and killed after it (bounded by --busy-s). Each measurement is its own `spillpack`
process; settings alternate round by round. `default` is what a user gets (threads chosen from
the CPUs free at start, OpenMP's passive wait); `N threads` sets OMP_NUM_THREADS=N; `N threads,
spinning` also sets OMP_WAIT_POLICY=ACTIVE (OpenMP's spin-waiting, the behaviour before).
Prints tokens/s per setting (median) and default / best. Load average beside every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUSY = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nt = time.time() + float(sys.argv[2])\nwhile time.time() < t: pass\n"
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()


def rows_file(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 24))}) + "\n")
    return path


def train_file(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40))
            a = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(40))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SPILLPACK_THREADS", "OMP_WAIT_POLICY")}


def one(kind: str, model: str, data: Path, a, env: dict) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"bench-shared-{kind}-"))
    if kind == "run":
        cmd = ["run", model, str(data), "--max-tokens", str(a.max_tokens), "--batch", "8"]
    else:
        cmd = ["tune", model, str(data), "--steps", str(a.steps), "--batch", "4", "--ckpt-every", "100000"]
    busy = subprocess.Popen([sys.executable, "-c", BUSY, str(max(os.sched_getaffinity(0))), str(a.busy_s)])
    try:
        r = subprocess.run([sys.executable, "-m", "spillpack", *cmd, "--state", str(state), "--headless", "--engine", "torch-cpu"],
                           capture_output=True, text=True, env={**clean_env(), "SPILLPACK_HEADLESS": "1", **env}, cwd=REPO)
    finally:
        busy.kill()
        busy.wait()
    shutil.rmtree(state, ignore_errors=True)
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    start = next(e for e in events if e["event"] == "start")
    if kind == "run":
        tps = [e for e in events if e["event"] == "row"][-1]["tokens_per_s"]  # generated tokens over generation time
    else:
        steps = [e for e in events if e["event"] == "step"][1:]
        tps = sum(e["tokens_per_s"] * e["step_s"] for e in steps) / sum(e["step_s"] for e in steps)
    return {"tokens_per_s": tps, "threads": start.get("threads"), "why": start.get("threads_why")}


def main() -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still kills its busy loop (finally)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy-s", type=float, default=600, help="the competitor's bound in seconds")
    ap.add_argument("--only", choices=["run", "tune"])
    a = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    data = {"run": rows_file(work / "rows.jsonl", a.rows), "tune": train_file(work / "train.jsonl", 64)}
    settings = {"default": {}}
    for n in range(1, cpus + 1):
        settings[f"{n} threads"] = {"OMP_NUM_THREADS": str(n)}
    settings[f"{cpus} threads, spinning"] = {"OMP_NUM_THREADS": str(cpus), "OMP_WAIT_POLICY": "ACTIVE"}
    print(f"{cpus} CPUs, one held by a busy loop during each measurement; load before {os.getloadavg()[0]:.2f} (uptime)", flush=True)
    summary = {}
    for kind in ([a.only] if a.only else ["run", "tune"]):
        got = {k: [] for k in settings}
        for rnd in range(a.rounds):
            order = list(settings) if rnd % 2 == 0 else list(reversed(settings))
            for name in order:
                r = one(kind, a.model, data[kind], a, settings[name])
                got[name].append(r["tokens_per_s"])
                print(f"  {kind} {name:>20}: {r['tokens_per_s']:8.1f} tokens/s  ({r['threads']} threads: {r['why']}; "
                      f"load {os.getloadavg()[0]:.2f})", flush=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        best = max((v, k) for k, v in med.items() if k != "default")
        print(f"{kind}: default {med['default']:.1f} tokens/s, best {best[1]} {best[0]:.1f}: default / best "
              f"{med['default'] / best[0]:.2f}x  ({', '.join(f'{k} {v:.1f}' for k, v in med.items())})", flush=True)
        summary[kind] = {"default": med["default"], "best": best[0], "best_setting": best[1], "ratio": med["default"] / best[0],
                         "settings": med}
    print(f"load after {os.getloadavg()[0]:.2f} (uptime)")
    print(json.dumps({"bench": "shared", "model": a.model, **summary}))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
