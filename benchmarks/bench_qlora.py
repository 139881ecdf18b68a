"""A tune on SmolLM2-135M-Instruct's Q4_1 GGUF: the frozen base dequantized at load (dense) against
kept in its quantized blocks (QLoRA's shape), step time and peak RSS.

    PYTHONPATH=. python benchmarks/bench_qlora.py --steps 10 --rounds 2 --threads 2

Each tune is its own `spillpack tune` process (peak RSS: its ru_maxrss), SPILLPACK_QUANT_GEMM
choosing dense or quantized, the two alternating for --rounds rounds; a side's step time is the
median of its steps after the first, over its rounds. Both sides write the same adapter (float32,
the same kernels and sum order: tests/test_qlora.py). Recorded through report.py.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


def tune(gguf: Path, kernel: str, state: Path, args) -> tuple[list[float], float]:
    """(step seconds after the first, peak RSS in MiB) of one tune."""
    cmd = [sys.executable, "-m", "spillpack", "tune", str(gguf), str(REPO / "examples/data/train.jsonl"), "--name", "b",
           "--state", str(state), "--steps", str(args.steps), "--batch", str(args.batch), "--max-seq", str(args.max_seq),
           "--rank", "16", "--lr", "1e-3", "--dtype", args.dtype, "--ckpt-every", str(args.steps)]
    env = {**os.environ, "SPILLPACK_HEADLESS": "1", "SPILLPACK_QUANT_GEMM": kernel, "SPILLPACK_THREADS": str(args.threads),
           "SPILLPACK_HOME": str(state.parent / "home")}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{kernel} tune failed: {err.decode()[-2000:]}")
    events = [json.loads(line) for line in out.decode().splitlines()]
    steps = [e["step_s"] for e in events if e["event"] == "step"][1:]
    peak = max(e.get("peak_mem_gb") or 0 for e in events) * 1024  # the process's peak RSS (GiB -> MiB)
    return steps, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the row as JSON (make bench), record nothing")
    args = ap.parse_args()
    from support.real_model import smollm2_gguf

    gguf = smollm2_gguf()
    got = {"dense": ([], []), "quantized": ([], [])}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kernel in ("dense", "quantized"):
                steps, peak = tune(gguf, kernel, Path(tmp) / f"{kernel}-{r}", args)
                got[kernel][0].extend(steps)
                got[kernel][1].append(peak)
                load.append(os.getloadavg()[0])
                print(f"round {r + 1} {kernel}: {statistics.median(steps):.3f} s/step, peak {peak:.0f} MiB", flush=True)
    fig = {k: (statistics.median(s), max(p)) for k, (s, p) in got.items()}
    cell = lambda k: f"{fig[k][0]:.3f} s/step at {args.batch} x {args.max_seq} tokens, peak {fig[k][1]:.0f} MiB"
    print(f"dense base: {cell('dense')}\nquantized base: {cell('quantized')}\n"
          f"speed {fig['dense'][0] / fig['quantized'][0]:.2f}x, memory {fig['quantized'][1] / fig['dense'][1]:.2f}x; "
          f"load {min(load):.1f}-{max(load):.1f}")
    row = {"command": f"bench_qlora.py: tune SmolLM2-135M Q4_1 GGUF, base kept quantized, --batch {args.batch} --max-seq {args.max_seq}",
           "dtype": args.dtype, "threads": args.threads, "ours": cell("quantized"), "peer": cell("dense"),
           "peer_name": "the same tune, base dequantized at load", "ratio": round(fig["dense"][0] / fig["quantized"][0], 2),
           "load": f"{min(load):.1f}-{max(load):.1f}"}
    if args.json:  # run_all.py records it
        print(json.dumps({"rows": [row]}))
    elif not args.no_record:
        import report

        report.record([row])
        report.write()


if __name__ == "__main__":
    main()
