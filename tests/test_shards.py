"""Row jobs split over workers (--shards N): the split, the shard a process is, bad input refused
before anything is written, the merge byte-identical to an unsharded run, a merge cut short
completed by `resume STATE`, and status telling each shard and the merge.
The S3 runs (killed shards, two shards finishing at once) are in test_shards_s3.py."""

import json
import os
from pathlib import Path

import pytest

from runtime.base.errors import SpillpackError
from runtime.jobs import shards
from tests.conftest import REPO, events_of, one_line, run_cli

EVALS = REPO / "examples/data/evals.jsonl"


def rows_file(path: Path, n: int, max_tokens: int = 8) -> Path:
    lines = [json.loads(x) for x in EVALS.read_text().splitlines()[:n]]
    for i, x in enumerate(lines):
        x["body"]["max_tokens"] = max_tokens + i % 3
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_plan_split_and_where_the_index_comes_from():
    p = shards.Plan(3, 0)
    ranges = [p.range(10, i) for i in range(3)]
    assert ranges == [(0, 3), (3, 6), (6, 10)]  # contiguous, covering every row once
    assert [shards.Plan(4, 0).range(2, i) for i in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]
    o = {"shards": 3, "shard": None}
    assert shards.plan({"shards": 1, "shard": None}, "run", {"SLURM_ARRAY_TASK_ID": "7"}) == shards.Plan(1, 0)
    assert shards.plan({"shards": 3, "shard": 1}, "run", {"SPILLPACK_SHARD": "2"}).index == 1  # --shard wins
    assert shards.plan(o, "run", {"SPILLPACK_SHARD": "2", "SLURM_ARRAY_TASK_ID": "0"}) == shards.Plan(3, 2, "SPILLPACK_SHARD")
    assert shards.plan(o, "run", {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "JOB_COMPLETION_INDEX": "0"}).index == 2
    assert shards.plan(o, "run", {"JOB_COMPLETION_INDEX": "1", "SKYPILOT_NODE_RANK": "0"}).index == 1
    assert shards.plan(o, "run", {"SKYPILOT_NODE_RANK": "0"}).index == 0
    assert shards.plan(o, "run", {}).index is None  # no shard: only complete the merge
    with pytest.raises(SpillpackError, match="out of range"):
        shards.plan(o, "run", {"SLURM_ARRAY_TASK_ID": "3"})
    with pytest.raises(SpillpackError, match="not a shard index"):
        shards.plan(o, "run", {"JOB_COMPLETION_INDEX": "x"})


def test_bad_shard_input_is_one_line_and_writes_nothing(home, tmp_path):
    inp = rows_file(tmp_path / "in.jsonl", 6)
    state = tmp_path / "st"
    base = ["run", "tiny", str(inp), "--state", str(state), "--max-tokens", "4"]
    first = run_cli(base + ["--shards", "3", "--shard", "1", "--stop-after", "0"])
    assert first.returncode == 0, first.stderr
    assert (state / "job.json").exists() and (state / "shards/1/job.json").exists()
    before = snapshot(state)

    one_line(run_cli(base + ["--shards", "2", "--shard", "0"]), "shards is 3 there and 2 here")
    one_line(run_cli(base), "shards is 3 there and None here")
    one_line(run_cli(base + ["--shards", "3", "--shard", "3"]), "--shard 3 is out of range", "0 to 2")
    one_line(run_cli(base + ["--shards", "3"], env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1"}),
                   "shard 4 (from SLURM_ARRAY_TASK_ID=5) is out of range")
    other = rows_file(tmp_path / "other.jsonl", 5)
    one_line(run_cli(["run", "tiny", str(other), "--state", str(state), "--max-tokens", "4", "--shards", "3", "--shard", "0"]),
                   "holds a different job: input_sha256")
    # A shard's own state is claimed by its job: another job's shard there is refused as well.
    one_line(run_cli(["run", "tiny", str(other), "--state", str(state / "shards/1"), "--max-tokens", "4"]),
                   "holds a different job")
    assert snapshot(state) == before


@pytest.mark.slow
def test_shards_merge_equals_an_unsharded_run_and_resume_completes_a_cut_merge(home, tmp_path):
    inp = rows_file(tmp_path / "in.jsonl", 10)
    common = ["run", "tiny", str(inp), "--max-tokens", "8", "--batch", "3", "--commit-rows", "2"]
    ref = run_cli(common + ["--state", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.jsonl")])
    assert ref.returncode == 0, ref.stderr
    expected = (tmp_path / "ref.jsonl").read_bytes()

    state, out = tmp_path / "st", tmp_path / "out.jsonl"
    args = common + ["--state", str(state), "--out", str(out), "--shards", "3"]
    status = tmp_path / "status.json"
    # Each shard as its scheduler names it: --shard, a Slurm array index, a Kubernetes completion index.
    r0 = run_cli(args + ["--shard", "0"], env={"SPILLPACK_STATUS": str(status)})
    assert r0.returncode == 0, r0.stderr
    st = json.loads(status.read_text())
    assert st["shard"] == 0 and st["shards"] == 3 and st["rows_done"] == 3 and st["total"] == 3 and st["phase"] == "done"
    done0 = events_of(r0.stdout)[-1]
    assert done0["complete"] and done0["merged"] is False and done0["rows"] == 3 and not out.exists()
    only_merge = run_cli(["resume", str(state)])
    one_line(only_merge, "shards 1, 2 of them are not finished", said=1)
    r2 = run_cli(args, env={"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10"})
    assert r2.returncode == 0 and events_of(r2.stdout)[-1]["shard"] == 2, r2.stderr
    r1 = run_cli(args, env={"JOB_COMPLETION_INDEX": "1"})
    assert r1.returncode == 0, r1.stderr
    evs = events_of(r1.stdout)
    merged = [e for e in evs if e["event"] == "merged"]
    assert len(merged) == 1 and merged[0]["shard"] == 1 and merged[0]["step"] == 10
    assert evs[-1]["merged"] and evs[-1]["merged_here"] and evs[-1]["failed_rows"] == 0
    assert out.read_bytes() == expected == (state / "results.jsonl").read_bytes()
    ids = [json.loads(x)["custom_id"] for x in out.read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == 10

    # A merger killed after creating results.jsonl leaves no record and no --out: resume completes it.
    (state / "merged.json").unlink()
    out.unlink()
    merge = next(e for e in events_of(run_cli(["status", str(state)]).stdout) if e["kind"] == "merge")
    assert merge["cut_short"] and merge["claimed_by_shard"] == 1
    done = run_cli(["resume", str(state)])
    assert done.returncode == 0, done.stderr
    record = json.loads((state / "merged.json").read_text())
    assert record["completed_cut_short"] and record["shard"] is None and record["rows"] == 10
    assert out.read_bytes() == expected
    # A rerun of a shard after the merge delivers and reports; it generates nothing.
    again = run_cli(args + ["--shard", "2"])
    assert again.returncode == 0 and not any(e["event"] == "row" for e in events_of(again.stdout))

    told = events_of(run_cli(["status", str(state)]).stdout)
    shards = [e for e in told if e["kind"] == "shard"]
    merge = next(e for e in told if e["kind"] == "merge")
    assert [(s["shard"], s["rows_done"], s["rows"], s["done"]) for s in shards] == [(0, 3, 3, True), (1, 3, 3, True), (2, 4, 4, True)]
    assert merge["merged"] and merge["rows"] == 10
    assert merge["text"].startswith("merged: 10 rows by a process without a shard")


@pytest.mark.slow
def test_sharded_eval_writes_the_same_files_as_an_unsharded_one(home, tmp_path):
    evals = rows_file(tmp_path / "evals.jsonl", 5, max_tokens=3)
    common = ["eval", "tiny", str(evals), "--metric", "contains"]
    ref = run_cli(common + ["--state", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr
    for i in (1, 0):
        r = run_cli(common + ["--state", str(tmp_path / "st"), "--shards", "2", "--shard", str(i)])
        assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["accuracy"] == events_of(ref.stdout)[-1]["accuracy"] and done["merged"]
    for name in ("results.jsonl", "eval.json", "answers.jsonl"):
        assert (tmp_path / "st" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


@pytest.mark.slow
def test_sharded_build_two_workers_wait_at_each_stage_and_score_as_one(home, tmp_path):
    """Two build workers at once: shard 0 tunes while shard 1 waits, each does its shard of the
    eval (before and after in one pass); the scores and files equal an unsharded build's."""
    import subprocess
    import sys

    folder = tmp_path / "f"
    folder.mkdir()
    for name, n in (("evals.jsonl", 5), ("train.jsonl", 8)):
        (folder / name).write_text("".join((REPO / "examples/data" / name).read_text().splitlines(True)[:n]))
    common = ["build", str(folder), "--steps", "3", "--max-tokens", "4", "--batch", "2"]
    ref = run_cli(common + ["--state", str(tmp_path / "ref")], timeout=600)
    assert ref.returncode == 0, ref.stderr
    env = {**os.environ, "SPILLPACK_HEADLESS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "spillpack", *common, "--state", str(tmp_path / "st"), "--shards", "2",
                               "--shard", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for i in (0, 1)]
    results = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    want = events_of(ref.stdout)[-1]["stages"]
    for out, err in results:
        assert events_of(out)[-1]["stages"] == want
    # Only shard 0 trains; shard 1 waits for its marker (and says so, unless the tune was done by the
    # time it got there: on a loaded machine it may be).
    trained = [[e for e in events_of(out) if e["event"] == "step" and e.get("loss") is not None] for out, _ in results]
    assert trained[0] and not trained[1], [len(t) for t in trained]
    for stage in ("eval",):
        for name in ("results.jsonl", "eval.json"):
            assert (tmp_path / "st/stages" / stage / name).read_bytes() == (tmp_path / "ref/stages" / stage / name).read_bytes()
    markers = [json.loads(p.read_text()) for p in (tmp_path / "st/commits").glob("*.json")]
    assert sorted(m["meta"]["stage"] for m in markers if m["kind"] == "stage") == ["eval", "tune"]
