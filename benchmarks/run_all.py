"""`make bench`: every side-by-side benchmark at its quick setting, one after the other.

Each script is also meant to be run on its own with larger settings (see its docstring);
the figures in README come from those runs. Run on a quiet machine: the ratios are measured
within one run, but two processes competing for the cores distort them.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = [
    ["bench_tune.py", "--shape", "tiny", "--steps", "20"],
    ["bench_run.py", "--model", "tiny", "--prompts", "256", "--stop", "mixed", "--threads", "1"],
    ["bench_engines.py", "--steps", "3"],
    ["bench_pack.py"],
    ["bench_s3.py", "--mb", "128", "--repeat", "1"],
    # llama-cpp-python is built from its sdist on first use (cached under ~/.cache/spillpack-bench/)
    ["bench_llamacpp.py", "--rows", "32", "--batch", "8", "32"],
]


def main() -> int:
    failed = []
    for args in RUNS:
        print(f"\n== {' '.join(args)}", flush=True)
        r = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], cwd=HERE.parent,
                           env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        if r.returncode != 0:
            failed.append(args[0])
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
