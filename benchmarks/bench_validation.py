"""What a tune's held-out pass costs against the training it interrupts, through the CLI as a
user runs it: `tune --val-fraction F --eval-every N`, read from its own events.

For each eval: cost = its seconds / the seconds of the N steps before it, share = its held-out
tokens / the training tokens of those N steps. The promise: cost <= share + 10%
of share. A training step runs forward and backward; the held-out pass forward only, so the
cost is expected well under the share.

    python benchmarks/bench_validation.py                        # tiny, 40 steps, eval every 10
    python benchmarks/bench_validation.py --model DIR --steps 30 --eval-every 10 --val-fraction 0.1
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default=str(REPO / "examples/data/train.jsonl"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=2048)
    a = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bench-val-")) / "s"
    cmd = [sys.executable, "-m", "spillpack", "tune", a.model, a.data, "--steps", str(a.steps), "--batch", str(a.batch),
           "--val-fraction", str(a.val_fraction), "--eval-every", str(a.eval_every), "--max-seq", str(a.max_seq),
           "--state", str(state), "--ckpt-every", "1000000"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPILLPACK_HEADLESS": "1"}, cwd=REPO)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    events = [json.loads(line) for line in r.stdout.splitlines()]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    rows = []
    for e in (e for e in events if e["event"] == "eval"):
        window = [steps[s] for s in range(e["step"] - a.eval_every + 1, e["step"] + 1) if s in steps and s > 1]  # step 1 warms up
        train_s = sum(w["step_s"] for w in window)
        train_tokens = sum(w["tokens_per_s"] * w["step_s"] for w in window)
        share = e["tokens"] / (train_tokens * a.eval_every / len(window))
        cost = e["seconds"] / (train_s * a.eval_every / len(window))
        rows.append({"step": e["step"], "val_loss": e["val_loss"], "eval_s": e["seconds"], "train_s": round(train_s, 3),
                     "share": round(share, 4), "cost": round(cost, 4), "cost_over_share": round(cost / share, 3)})
        print(json.dumps(rows[-1]))
    ratio = statistics.median(r["cost_over_share"] for r in rows)
    print(json.dumps({"model": a.model, "evals": len(rows), "median_cost_over_share": ratio, "promise": "<= 1.10",
                      "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
