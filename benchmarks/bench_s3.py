"""S3 throughput: checkpoint upload and weight staging, spillpack vs `aws s3 cp`, same files, same server.

One run starts moto's S3 server in its own process on 127.0.0.1, then times, alternating and
`--repeat` times each (best kept):
  checkpoint upload   S3Store.write(key, bytes)      vs  aws s3 cp FILE s3://...
  weight staging      runtime.state.staging.stage(uri)     vs  aws s3 cp --recursive s3://... DIR
Both sides run as fresh processes (interpreter and library start-up included, as a user pays
it), and spillpack's in-process transfer time is reported beside them.

    python benchmarks/bench_s3.py [--mb 256] [--repeat 2]
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUCKET = "spillpack-bench"

WORKER = r"""
import sys, time
from pathlib import Path
what, uri, path = sys.argv[1:4]
t0 = time.perf_counter()
if what == "upload":
    from runtime.state.uri import open_store
    parent, _, name = uri.rpartition("/")
    open_store(parent).write(name, Path(path).read_bytes())
else:
    from runtime.state.staging import stage
    stage(uri)
print(time.perf_counter() - t0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd, env) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{cmd[:3]} failed: {r.stderr[-2000:]}")
    return wall, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size; the weights are two files of half that")
    ap.add_argument("--repeat", type=int, default=2)
    ns = ap.parse_args()
    aws = shutil.which("aws") or "/root/.pyenv/shims/aws"
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    port = free_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "PYTHONPATH": str(REPO), "SPILLPACK_HOME": str(work / "home")}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        subprocess.run([aws, "s3", "mb", f"s3://{BUCKET}"], env=env, check=True, capture_output=True)
        ckpt = work / "state.safetensors"
        ckpt.write_bytes(os.urandom(ns.mb * 1024 * 1024))
        weights = work / "weights"
        weights.mkdir()
        for i in range(2):
            (weights / f"model-0000{i + 1}-of-00002.safetensors").write_bytes(os.urandom(ns.mb * 512 * 1024))
        (weights / "config.json").write_text('{"model_type": "llama"}')
        subprocess.run([aws, "s3", "cp", "--recursive", str(weights), f"s3://{BUCKET}/weights"], env=env, check=True, capture_output=True)

        best = {k: float("inf") for k in ("up_ours", "up_ours_inproc", "up_aws", "stage_ours", "stage_ours_inproc", "stage_aws")}
        for n in range(ns.repeat):
            wall, out = timed([sys.executable, "-c", WORKER, "upload", f"s3://{BUCKET}/ckpt/ours-{n}", str(ckpt)], env)
            best["up_ours"], best["up_ours_inproc"] = min(best["up_ours"], wall), min(best["up_ours_inproc"], float(out))
            wall, _ = timed([aws, "s3", "cp", str(ckpt), f"s3://{BUCKET}/ckpt/aws-{n}"], env)
            best["up_aws"] = min(best["up_aws"], wall)
            shutil.rmtree(work / "home", ignore_errors=True)  # a cold cache each time
            wall, out = timed([sys.executable, "-c", WORKER, "stage", f"s3://{BUCKET}/weights", ""], env)
            best["stage_ours"], best["stage_ours_inproc"] = min(best["stage_ours"], wall), min(best["stage_ours_inproc"], float(out))
            shutil.rmtree(work / "aws-weights", ignore_errors=True)
            wall, _ = timed([aws, "s3", "cp", "--recursive", f"s3://{BUCKET}/weights", str(work / "aws-weights")], env)
            best["stage_aws"] = min(best["stage_aws"], wall)
        warm, _ = timed([sys.executable, "-c", WORKER, "stage", f"s3://{BUCKET}/weights", ""], env)

        mb = ns.mb
        print(f"S3 throughput against moto on 127.0.0.1 ({os.cpu_count()} CPUs), {mb} MB, best of {ns.repeat}")
        print(f"{'':28}{'spillpack':>16}{'aws s3 cp':>16}{'ratio':>8}")
        for label, ours, theirs, inproc in (("checkpoint upload", "up_ours", "up_aws", "up_ours_inproc"),
                                            ("weight staging (cold)", "stage_ours", "stage_aws", "stage_ours_inproc")):
            print(f"{label:28}{mb / best[ours]:>11.0f} MB/s{mb / best[theirs]:>11.0f} MB/s{best[theirs] / best[ours]:>7.2f}x"
                  f"   (spillpack in-process transfer: {mb / best[inproc]:.0f} MB/s)")
        print(f"{'weight staging (warm cache)':28}{warm:>13.2f} s   (listing only, no download)")
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
