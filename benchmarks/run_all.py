"""`make bench`: every side-by-side benchmark at its quick setting, one after the other, and the
README's performance table regenerated from their figures (between the `perf-table` markers),
naming the commit, the CPU and the load the figures were measured under.

Each script is also meant to be run on its own with larger settings (see its docstring). The
ratios are measured within one run, but other processes competing for the cores distort them:
the table says the load average before and after, so a figure measured under load says so.
`--no-readme` runs the benchmarks without touching README.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
README = REPO / "README.md"
START, END = "<!-- perf-table: written by `make bench` (benchmarks/run_all.py) -->", "<!-- /perf-table -->"
TABLE_RUNS = {  # the table's rows: JSON-reporting benchmarks
    "tune tiny": ["bench_tune.py", "--shape", "tiny", "--steps", "20", "--json"],
    "run tiny mixed": ["bench_run.py", "--model", "tiny", "--prompts", "128", "--stop", "mixed", "--threads", "1"],
    "run tiny length": ["bench_run.py", "--model", "tiny", "--prompts", "128", "--stop", "length", "--threads", "1"],
    "shared cores": ["bench_shared.py", "--rounds", "1"],
}
OTHER_RUNS = [
    ["bench_engines.py", "--steps", "3"],
    ["bench_pack.py"],
    ["bench_s3.py", "--mb", "128", "--repeat", "1"],
]


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
    t = results.get("tune tiny")
    if t:
        out.append(f"| `bench_tune.py --shape tiny --steps 20` | {t['spillpack']['tokens_per_s']:.0f} tokens/s, "
                   f"{t['spillpack']['peak_rss_gb']:.2f} GB | transformers + PEFT {t['peer']['tokens_per_s']:.0f} tokens/s, "
                   f"{t['peer']['peak_rss_gb']:.2f} GB | {t['speed_ratio']:.2f}x speed, {t['memory_ratio']:.2f}x memory |")
    for key in ("run tiny mixed", "run tiny length"):
        r = results.get(key)
        if r:
            out.append(f"| `bench_run.py --model tiny --prompts 128 --stop {r['stop']} --threads 1` | "
                       f"{r['spillpack']['tokens_per_s']:.0f} tokens/s | generate {r['transformers']['tokens_per_s']:.0f} tokens/s | "
                       f"{r['ratio']:.2f}x, {r['token_identical_rows']} rows identical |")
    s = results.get("shared cores")
    if s:
        for kind in ("run", "tune"):
            if kind in s:
                k = s[kind]
                out.append(f"| `bench_shared.py`: {kind} on tiny, one CPU held by a busy loop | default {k['default']:.1f} tokens/s | "
                           f"best setting ({k['best_setting']}) {k['best']:.1f} tokens/s | {k['ratio']:.2f}x of best |")
    return out


def write_readme(results: dict, load_before: float, load_after: float) -> None:
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    head = (f"Measured by `make bench` at commit {commit} on {machine()}, load average {load_before:.1f} before and "
            f"{load_after:.1f} after" + (" (measured under load: other processes shared the cores)" if max(load_before, load_after) > 1.5 else "")
            + ".")
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
    for name, args in TABLE_RUNS.items():
        out = run(args)
        if out is None:
            failed.append(args[0])
        else:
            results[name] = last_json(out)
    for args in OTHER_RUNS:
        if run(args) is None:
            failed.append(args[0])
    if "--no-readme" not in sys.argv and results:
        write_readme(results, load_before, os.getloadavg()[0])
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
