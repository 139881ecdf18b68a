"""Three shards of one `run` as three local processes on one s3:// state (moto over HTTP): shards
SIGKILLed and SIGTERMed at random rows and run again end with the merged output byte-identical to
an unsharded run, every custom_id once; two shards finishing at the same moment (both held at a
barrier right before the merge) produce one merge.

moto decides a conditional PUT in two unlocked steps, so the processes talk to it through the
test proxy, which forwards the merge claim's PUTs one at a time: what S3 itself guarantees."""

import json
import os
import random
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO, events_of, run_cli
from tests.support.s3_fixtures import fault_proxy, s3, s3_uri  # noqa: F401
from tests.test_shards import rows_file

pytestmark = pytest.mark.slow

ROWS = 15
COMMON = ["--max-tokens", "8", "--batch", "2", "--commit-rows", "1", "--shards", "3"]
CLAIM = r"/merge-claim\.json"


@pytest.fixture
def job(home, tmp_path, s3, s3_uri, fault_proxy):
    inp = rows_file(tmp_path / "in.jsonl", ROWS)
    ref = run_cli(["run", "tiny", str(inp), *COMMON[:-2], "--state", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.jsonl")])
    assert ref.returncode == 0, ref.stderr
    fault_proxy.serialize(CLAIM)
    args = ["run", "tiny", str(inp), *COMMON, "--state", f"{s3_uri}/state", "--out", f"{s3_uri}/out.jsonl"]
    env = {"AWS_ENDPOINT_URL": fault_proxy.endpoint}
    return args, env, (tmp_path / "ref.jsonl").read_bytes(), s3_uri[len(f"s3://{s3.bucket}/"):]


def start(args, env):
    full = {**os.environ, "SPILLPACK_HEADLESS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full, cwd=REPO)


def watch(p, sig=None, after_rows=0):
    """Read the process's events; send `sig` once it reported `after_rows` rows. Returns (rc, events, stderr)."""
    out, seen, sent = [], 0, False
    for line in p.stdout:
        out.append(line)
        if sig is not None and not sent and json.loads(line)["event"] == "row":
            seen += 1
            if seen >= after_rows:
                p.send_signal(sig)
                sent = True
    err = p.stderr.read()
    return p.wait(timeout=300), events_of("".join(out)), err


def together(runs):
    """Start every (args, env, sig, after_rows) at once; wait for all."""
    results = [None] * len(runs)
    procs = [start(a, e) for a, e, _, _ in runs]

    def one(i):
        results[i] = watch(procs[i], runs[i][2], runs[i][3])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def merged_events(*results):
    return [e for _, evs, _ in results for e in evs if e["event"] == "merged"]


def test_shards_killed_at_random_rows_on_s3_rerun_and_merge_byte_identical(job, s3, fault_proxy):
    args, env, expected, key = job
    rng = random.Random(16)
    first = together([
        (args + ["--shard", "0"], env, signal.SIGKILL, rng.randint(1, 3)),
        (args + ["--shard", "1"], env, signal.SIGTERM, rng.randint(1, 3)),
        (args + ["--shard", "2"], env, None, 0),
    ])
    (rc0, _, _), (rc1, evs1, err1), (rc2, evs2, err2) = first
    assert rc0 == -9
    assert rc1 == 75 and evs1[-1]["event"] == "preempted", err1
    assert rc2 == 0 and evs2[-1]["complete"] and evs2[-1]["merged"] is False, err2
    assert not s3.keys(f"{key}/out.jsonl") and not merged_events(*first)

    again = together([(args + ["--shard", "0"], env, None, 0), (args + ["--shard", "1"], env, None, 0)])
    for rc, evs, err in again:
        assert rc == 0, err
        restored = [e for e in evs if e["event"] == "restore"]
        assert restored and restored[0]["step"] > 0  # committed rows were kept, not done again
    assert len(merged_events(*again)) == 1
    out = s3.get(f"{key}/out.jsonl")
    assert out == expected == s3.get(f"{key}/state/results.jsonl")
    ids = [json.loads(x)["custom_id"] for x in out.splitlines()]
    assert len(ids) == len(set(ids)) == ROWS

    told = events_of(run_cli(["status", f"s3://{s3.bucket}/{key}/state"], env=env).stdout)
    by = {s["shard"]: s for s in told if s["kind"] == "shard"}
    merge = next(e for e in told if e["kind"] == "merge")
    assert by[0]["hard_kills"] == 1 and by[1]["interruptions"] == 1 and all(s["done"] for s in by.values())
    assert merge["merged"] and merge["rows"] == ROWS


def test_two_shards_finishing_at_the_same_moment_merge_once(job, s3, fault_proxy, tmp_path):
    args, env, expected, key = job
    r2 = run_cli(args + ["--shard", "2"], env=env)
    assert r2.returncode == 0, r2.stderr
    # Both held right before the merge, each with its shard committed: both find every shard done.
    barrier = {**env, "SPILLPACK_TEST_MERGE_BARRIER": f"{tmp_path / 'barrier'}:2"}
    both = together([(args + ["--shard", "0"], barrier, None, 0), (args + ["--shard", "1"], barrier, None, 0)])
    for rc, evs, err in both:
        assert rc == 0 and evs[-1]["complete"], err
    assert len(merged_events(*both)) == 1
    claims = [status for method, path, status in fault_proxy.log if method == "PUT" and "merge-claim.json" in path]
    assert sorted(claims) == [200, 412]  # both tried; the server let exactly one through
    for name in ("state/results.jsonl", "out.jsonl", "state/merged.json"):
        puts = [s for m, p, s in fault_proxy.log if m == "PUT" and p.split("?")[0].endswith(f"{key}/{name}")]
        assert puts == [200], (name, puts)  # written once, by the one merger
    assert s3.get(f"{key}/out.jsonl") == expected
    history = [json.loads(s3.get(k)) for k in s3.keys(f"{key}/state/history/")]
    assert sum(r["what"] == "merged" for r in history) == 1
