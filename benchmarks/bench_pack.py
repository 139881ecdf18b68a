"""Packing cost and bundle start-up overhead, each against the plain baseline in the same run.

1. Pack a tune job whose data is 1 GB (generated JSONL), against `cp -r` + `sha256sum` of the
   same data: what anyone would do by hand to move data with a checksum. Target <= 1.3x.
   The wheels and the zipapp come from the cache, as on every pack after the first; the
   cold zipapp build is timed separately.
2. `./run.sh --help` against `python -c "import torch"`, once the zipapp is extracted.
   Target <= 0.3 s more.

Run: PYTHONPATH=. python benchmarks/bench_pack.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1 << 30


def timed(cmd, **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, **kw)
    return time.perf_counter() - t0


def best(n, fn) -> float:
    return min(fn() for _ in range(n))


def make_data(path: Path) -> None:
    line = b'{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "positive"}]}\n'
    rnd = os.urandom(1 << 20).hex().encode()
    with open(path, "wb") as f:
        written = 0
        while written < GB:
            chunk = b"".join(line % rnd[i:i + 200] for i in range(0, len(rnd) - 200, 200))
            f.write(chunk)
            written += len(chunk)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-", dir=os.environ.get("BENCH_DIR")))
    env = {**os.environ, "SPILLPACK_HOME": str(tmp / "home"), "PYTHONPATH": str(REPO), "SPILLPACK_HEADLESS": "1"}
    try:
        src = tmp / "src"
        src.mkdir()
        make_data(src / "train.jsonl")
        size = (src / "train.jsonl").stat().st_size
        pack = [sys.executable, "-m", "spillpack", "pack", "tune", "tiny", str(src / "train.jsonl")]

        # Warm the wheel cache (a download, not what is measured), and time a cold zipapp build.
        tiny = tmp / "tiny.jsonl"
        tiny.write_bytes((REPO / "examples/data/train.jsonl").read_bytes())
        subprocess.run([*pack[:-1], str(tiny), "-o", str(tmp / "warm")], check=True, capture_output=True, env=env)
        shutil.rmtree(tmp / "home" / "cache" / "pyz")
        cold = timed([*pack[:-1], str(tiny), "-o", str(tmp / "cold")], env=env)

        runs_pack, runs_cp = [], []
        for i in range(2):
            subprocess.run(["sync"])
            runs_cp.append(timed(["sh", "-c", f"cp -r {src} {tmp}/cp{i} && sha256sum {tmp}/cp{i}/* >/dev/null"]))
            shutil.rmtree(tmp / f"cp{i}")
            subprocess.run(["sync"])
            runs_pack.append(timed([*pack, "-o", str(tmp / f"b{i}")], env=env))
            if i == 0:
                bundle = tmp / "b0"
            else:
                shutil.rmtree(tmp / f"b{i}")
        p, c = min(runs_pack), min(runs_cp)
        print(f"pack, {size / 1e9:.2f} GB of data: {p:.2f} s; cp -r + sha256sum: {c:.2f} s; ratio {p / c:.2f}x (target <= 1.3x)")
        print(f"small pack with a cold zipapp build (wheels cached): {cold:.2f} s")

        # Start-up: extract once, then compare.
        run_env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp), "SPILLPACK_HOME": str(tmp / "home"),
                   "TMPDIR": str(tmp)}
        subprocess.run([str(bundle / "run.sh"), "--help"], check=True, capture_output=True, env=run_env)
        torch_s = best(5, lambda: timed([sys.executable, "-c", "import torch"], env=run_env))
        help_s = best(5, lambda: timed([str(bundle / "run.sh"), "--help"], env=run_env))
        verify_s = timed([str(bundle / "run.sh"), "--verify"], env=run_env)
        print(f"./run.sh --help: {help_s:.3f} s; python -c 'import torch': {torch_s:.3f} s; "
              f"difference {help_s - torch_s:+.3f} s (target <= +0.3 s)")
        print(f"./run.sh --verify of the 1 GB bundle: {verify_s:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
