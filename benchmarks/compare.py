"""One benchmark on two trees of spillpack, side by side in one run: the guard against the next regression.

    python benchmarks/compare.py HEAD~20 HEAD                       # tune, Qwen2.5-0.5B shape, 3 steps
    python benchmarks/compare.py HEAD~5 HEAD --rounds 3 -- --shape tiny --steps 30
    python benchmarks/compare.py HEAD . --bench run -- --model tiny --prompts 64 --stop mixed --threads 1

Each revision is checked out once as a detached git worktree (cached under --trees, reused
by later runs); the benchmark script is always this tree's, so both sides run the same
command, data and model, and only the spillpack they import differs. Each measurement is its
own process, started in the revision's worktree with PYTHONPATH pointing at it, so it imports
that tree's `spillpack` and `runtime` and has its own peak RSS. The sides alternate
(A B A B ...) so drift in the machine's load falls on both; `uptime` is printed before and
after. Prints each measurement, each side's median and the ratio B / A of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BENCHES = {
    # bench -> (script, default arguments, the JSON field compared, larger is better)
    "tune": ("bench_tune.py", ["--shape", "qwen2.5-0.5b", "--steps", "3"], "tokens_per_s"),
    "run": ("bench_run.py", ["--model", "tiny", "--prompts", "64", "--stop", "mixed", "--threads", "1"], "tokens_per_s"),
}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def tree_of(rev: str, trees: Path) -> tuple[str, Path]:
    """The revision's commit and a worktree of it; "." is this working tree as it is, uncommitted changes and all."""
    if rev == ".":
        return git("rev-parse", "HEAD") + "+", REPO
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = trees / sha[:12]
    if not (path / "runtime").is_dir():
        trees.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True, text=True)
    return sha, path


def measure(tree: Path, script: str, args: list[str], field: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # cwd is the revision's tree: `python -m spillpack` puts the working directory first on sys.path.
    r = subprocess.run([sys.executable, str(HERE / script), *args, "--side", "spillpack", "--json"], cwd=tree, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare: the benchmark failed on {tree}:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"value": out[field], **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--bench", choices=sorted(BENCHES), default="tune")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per side, alternating")
    ap.add_argument("--trees", default=str(Path(tempfile.gettempdir()) / "spillpack-compare"),
                    help="where the revisions' worktrees are kept")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: the benchmark's own arguments
    a = ap.parse_args(argv[:cut])
    script, default_args, field = BENCHES[a.bench]
    args = argv[cut + 1:] or default_args
    sides = [tree_of(a.rev_a, Path(a.trees)), tree_of(a.rev_b, Path(a.trees))]
    labels = [a.rev_a, a.rev_b]
    print(f"{a.bench}: {script} {' '.join(args)}", flush=True)
    for label, (sha, path) in zip(labels, sides):
        print(f"  {label:>10} = {sha[:9]}  {path}", flush=True)
    print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (uptime)", flush=True)
    values = [[], []]
    for rnd in range(a.rounds):
        for i in (0, 1) if rnd % 2 == 0 else (1, 0):  # A B, B A, ...: neither side always runs first
            r = measure(sides[i][1], script, args, field)
            values[i].append(r["value"])
            extra = f"  peak RSS {r['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in r else ""
            print(f"  round {rnd + 1} {labels[i]:>10}: {field} {r['value']:.1f}{extra}  "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    med = [statistics.median(v) for v in values]
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (uptime)")
    print(f"{labels[0]}: {med[0]:.1f}  {labels[1]}: {med[1]:.1f}  ratio {labels[1]} / {labels[0]}: {med[1] / med[0]:.3f}x "
          f"({field}, median of {a.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
