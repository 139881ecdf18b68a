"""Sharded row jobs: rows/s of a tiny `run` split into 1, 2 and 4 shards, and the merge of 100k rows.

    PYTHONPATH=. python benchmarks/bench_shards.py --rows 96 --max-tokens 16 --shards 1 2 4
    PYTHONPATH=. python benchmarks/bench_shards.py --merge-only --merge-rows 100000

Throughput: the same input run as N shard processes of `spillpack run ... --shards N --shard I`,
all started at once, each pinned to one core (taskset, core I mod the cores there are) with one
torch thread (OMP_NUM_THREADS=1), on a local state. The time is wall clock from the start of
the first process to the exit of the last, so it holds each process's start-up (Python, torch,
the model) and the merge; rows/s = rows / that time. Every run's merged output is compared
with the 1-shard run's: byte-identical or the benchmark fails.

Merge: a state with 4 shards of committed rows (100k OpenAI batch output lines in all,
written through JobState like a real run writes them, in segments of 256 rows), then the
merge as the last shard runs it (runtime/jobs/shards.py Merger.attempt: read every shard's
segments, order by input, write results.jsonl and the merge record), timed alone.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def input_file(path: Path, rows: int, max_tokens: int) -> Path:
    words = (REPO / "runtime/models/tiny_corpus.txt").read_text().split()
    with open(path, "w") as f:
        for i in range(rows):
            start = (i * 97) % (len(words) - 40)
            text = " ".join(words[start:start + 8 + i % 24])
            f.write(json.dumps({"custom_id": f"r{i:06d}", "body": {"messages": [{"role": "user", "content": text}],
                                                                  "max_tokens": max_tokens}}) + "\n")
    return path


def throughput(home: Path, inp: Path, shards: int, max_tokens: int, batch: int, work: Path) -> tuple[float, bytes]:
    state, out = work / f"state-{shards}", work / f"out-{shards}.jsonl"
    cores = os.cpu_count() or 1
    env = {**os.environ, "SPILLPACK_HOME": str(home), "SPILLPACK_HEADLESS": "1", "OMP_NUM_THREADS": "1",
           "SPILLPACK_METADATA_URL": "http://127.0.0.1:9", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "spillpack", "run", "tiny", str(inp), "--max-tokens", str(max_tokens), "--batch", str(batch),
            "--state", str(state), "--out", str(out), "--shards", str(shards), "--preemption-notice", "off"]
    pin = shutil.which("taskset")
    t0 = time.perf_counter()
    procs = []
    for i in range(shards):
        cmd = args + ["--shard", str(i)]
        if pin:
            cmd = [pin, "-c", str(i % cores)] + cmd
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO))
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a shard failed: {err[-2000:]}")
    return time.perf_counter() - t0, out.read_bytes()


def merge_time(rows: int, work: Path, shards: int = 4) -> float:
    import orjson

    from runtime.core.events import Events
    from runtime.data.rows import parse_rows
    from runtime.jobs import rowjob, shards as sh
    from runtime.jobs.run import _finish
    from runtime.state.jobstate import JobState
    from runtime.state.uri import open_store

    raw = b"".join(orjson.dumps({"custom_id": f"r{i:06d}", "prompt": f"prompt {i}"}) + b"\n" for i in range(rows))
    parsed = parse_rows(raw, "in.jsonl", 16, 0.0, 1.0, 0)
    identity = {"command": "run", "bench": True, "shards": shards}
    root = JobState(open_store(str(work / "merge-state")), identity)
    root.open()
    plan = sh.Plan(shards, 0)
    for i in range(shards):
        lo, hi = plan.range(rows, i)
        st = root.shards.shard(i, {**identity, "shard": i, "rows": [lo, hi]})
        st.open()
        for s in range(lo, hi, 256):
            seg = b"".join(orjson.dumps(_line(parsed[j])) + b"\n" for j in range(s, min(s + 256, hi)))
            st.rows.commit(seg, min(s + 256, hi) - s)
        st.shards.mark_done(hi - lo)
    task = rowjob.RowTask("run", "model", "input", _finish)
    merger = sh.Merger(root, plan, task, parsed, None, Events("run", True, out=open(os.devnull, "w")),
                       rowjob.write_uri, rowjob.uri_exists)
    t0 = time.perf_counter()
    merged = merger.attempt(complete=False)
    seconds = time.perf_counter() - t0
    assert merged.by_me and merged.record["rows"] == rows
    assert (work / "merge-state/results.jsonl").read_bytes().count(b"\n") == rows
    return seconds


def _line(row) -> dict:
    rid = f"{row.index:024x}"
    return {"id": f"batch_req_{rid}", "custom_id": row.custom_id,
            "response": {"status_code": 200, "request_id": rid,
                         "body": {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "tiny",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "positive " * 4},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 20, "completion_tokens": 16, "total_tokens": 36}}},
            "error": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--merge-rows", type=int, default=100_000)
    ap.add_argument("--merge-only", action="store_true")
    a = ap.parse_args()
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not a.merge_only:
            home = work / "home"
            os.environ["SPILLPACK_HOME"] = str(home)
            from runtime.models.tiny import ensure_tiny

            ensure_tiny()
            inp = input_file(work / "in.jsonl", a.rows, a.max_tokens)
            first = None
            for n in a.shards:
                seconds, out = throughput(home, inp, n, a.max_tokens, a.batch, work)
                first = out if first is None else first
                same = "byte-identical to the first" if out == first else "DIFFERENT"
                if out != first:
                    raise SystemExit(f"{n} shards: the merged output differs from the first run's")
                print(f"{n} shard{'s' if n > 1 else ' '}: {a.rows} rows in {seconds:6.2f} s = {a.rows / seconds:6.2f} rows/s ({same})")
        s = merge_time(a.merge_rows, work)
        print(f"merge of {a.merge_rows} rows from 4 shards: {s:.2f} s")
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")


if __name__ == "__main__":
    main()
