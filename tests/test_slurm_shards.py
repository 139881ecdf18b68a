"""A sharded `run` on the real single-node Slurm cluster (tests/slurm/cluster.py): packed with
`--scheduler slurm --shards 3`, submitted as a job array, one array task preempted by a job in
the high-priority partition and requeued, and the merged output byte-identical to an unsharded
run of the same bundle, every custom_id once, merged by exactly one task."""

import json
import shutil
import subprocess

import pytest

from conftest import REPO, events_of, run_cli
from test_slurm import in_queue, job_env, log_events, sbatch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one cluster: one worker

ROWS = 60  # 20 rows a task: on a quiet machine 6 ended before Slurm's scheduler preempted one
SHARDS = 3


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_home):
    """The bundle rows/ with its array script beside it, and a home holding tiny."""
    root = tmp_path_factory.mktemp("slurm-shards")
    home = root / "home"
    shutil.copytree(tiny_home / "models", home / "models")
    src = root / "src" / "in.jsonl"
    src.parent.mkdir()
    lines = [json.loads(x) for x in (REPO / "examples/data/evals.jsonl").read_text().splitlines()[:ROWS]]
    for i, x in enumerate(lines):
        x["body"]["max_tokens"] = 160 + i % 5  # rows long enough that two tasks are still running when the preemption lands
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # One row at a time, committed at once: slow enough to be running when the preemption lands.
    r = run_cli(["pack", "run", "tiny", str(src), "--name", "rows", "--batch", "1", "--commit-rows", "1", "--shards", str(SHARDS),
                 "-o", str(root / "rows"), "--scheduler", "slurm"], env={"SPILLPACK_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-3000:]
    script = (root / "rows.sbatch").read_text()
    assert f"#SBATCH --array=0-{SHARDS - 1}\n" in script and 'scontrol requeue "$task"' in script
    # The script pack wrote is the example's, but for the comments, the shard count and the job's name.
    ours = [l for l in script.splitlines() if not l.startswith("# ") and "--array" not in l]
    example = [l for l in (REPO / "examples/schedulers/slurm/rows.sbatch").read_text().splitlines()
               if not l.startswith("# ") and "--array" not in l]
    assert ours == example
    return root, home


def test_array_task_preempted_and_requeued_merges_byte_identical_to_unsharded(slurm, packed):
    root, home = packed
    env = job_env(home)
    ref = subprocess.run([str(root / "rows/run.sh"), "--shards", "1", "--state", str(root / "ref"), "--out", str(root / "ref.jsonl")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = (root / "ref.jsonl").read_bytes()

    out = root / "out.jsonl"
    array = sbatch(["--partition=low", "--cpus-per-task=1", "--mem=1G", "--gres=none", "rows.sbatch",
                    "--state", str(root / "state"), "--out", str(out)], root, env)
    logs = [root / f"spillpack-rows-{array}_{i}.log" for i in range(SHARDS)]

    def rows_in(log):
        return sum(e["event"] == "row" for e in log_events(log))

    # Two tasks run at once on the node's two cores; once one has rows done, a job in the
    # high-priority partition needs a core, and Slurm preempts (requeues) a task for it.
    wait_for(lambda: sum(rows_in(l) >= 1 for l in logs) >= 2, "rows of two array tasks", logs[0])
    sbatch(["--partition=high", "--cpus-per-task=1", "--mem=1G", "--output=/dev/null", "--wrap", "sleep 5"], root, env)

    wait_for(lambda: not in_queue(array, env) and out.exists(), "the array's end", logs[0], timeout=1200)
    events = {i: log_events(l) for i, l in enumerate(logs)}
    preempted = [i for i, evs in events.items() if any(e["event"] == "preempted" for e in evs)]
    assert preempted, {i: [e["event"] for e in evs][-6:] for i, evs in events.items()}
    for i in preempted:
        kinds = [e["event"] for e in events[i]]
        text = logs[i].read_text(errors="replace")
        assert "SLURM_RESTART_COUNT=1" in text, text[-3000:]
        pre = next(e for e in events[i] if e["event"] == "preempted")
        assert pre["signal"] == "SIGTERM" and kinds[-1] == "done" and pre["step"] > 0, kinds
        # Requeued, it continued from the rows it had committed.
        restore = next(e for e in events[i] if e["event"] == "restore")
        assert kinds.index("preempted") < kinds.index("restore") and restore["step"] == pre["step"]
    for i, evs in events.items():
        assert [e["shard"] for e in evs if e["event"] == "start"][-1] == i  # the task's index is its shard
        assert evs[-1]["event"] == "done" and evs[-1]["complete"]
    merged = [e for evs in events.values() for e in evs if e["event"] == "merged"]
    assert len(merged) == 1 and merged[0]["step"] == ROWS

    got = out.read_bytes()
    assert got == expected
    ids = [json.loads(x)["custom_id"] for x in got.splitlines()]
    assert len(ids) == len(set(ids)) == ROWS
    told = events_of(run_cli(["status", str(root / "state")]).stdout)  # one JSON line per line of the story
    shards = [e for e in told if e["kind"] == "shard"]
    merge = next(e for e in told if e["kind"] == "merge")
    assert len(shards) == 3 and sum(s["interruptions"] for s in shards) >= 1 and merge["merged"]
