"""The Slurm example on a real single-node cluster (tests/slurm/cluster.py): a packed tune
job is submitted with examples/schedulers/slurm/mine.sbatch, preempted for real (a job in
the high-priority partition; and once with `scancel --signal=TERM --batch`, what
`--signal=B:TERM@N` does before a time limit), requeued, resumed from its checkpoint in
the same appended log, and finished with the same adapter as an uninterrupted run."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one cluster: one worker

_spec = importlib.util.spec_from_file_location("slurm_cluster", REPO / "tests/slurm/cluster.py")
cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster)

# Long enough to be still running when the preemption lands, short enough for the suite.
JOB = ["--steps", "400", "--batch", "1", "--max-seq", "96", "--ckpt-every", "25", "--lr", "1e-3", "--name", "mine"]
VENV_BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_home):
    """The bundle mine/ with the example script beside it, and a home holding tiny."""
    root = tmp_path_factory.mktemp("slurm-job")
    home = root / "home"
    shutil.copytree(tiny_home / "models", home / "models")
    data = root / "src" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("\n".join((REPO / "examples/data/train.jsonl").read_text().splitlines()[:24]) + "\n")
    r = run_cli(["pack", "tune", "tiny", str(data), *JOB, "-o", str(root / "mine"), "--scheduler", "slurm"],
                env={"SPILLPACK_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-3000:]
    # The script pack wrote is the example, but for the comments that name this job's state.
    code = [l for l in (root / "mine.sbatch").read_text().splitlines() if not l.startswith("# ")]
    assert code == [l for l in (REPO / "examples/schedulers/slurm/mine.sbatch").read_text().splitlines() if not l.startswith("# ")]
    return root, home


def job_env(home: Path, extra=None) -> dict:
    """What sbatch exports to the job: a node's python3 with torch on PATH, and the cluster; one
    torch thread, so the reference and the preempted job (two jobs, each choosing its count from
    the load it meets) split their sums alike."""
    return {"SPILLPACK_THREADS": "1", "PATH": f"{VENV_BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home.parent), "SPILLPACK_HOME": str(home),
            "TMPDIR": "/tmp", "SLURM_CONF": str(cluster.conf_path()),
            "SPILLPACK_METADATA_URL": "http://127.0.0.1:9", "SOURCE_DATE_EPOCH": os.environ["SOURCE_DATE_EPOCH"], **(extra or {})}


def sbatch(args, cwd, env) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def log_events(log: Path) -> list[dict]:
    """The events of a job's log so far: whole lines only (a polled log may end in one being written)."""
    if not log.exists():
        return []
    text = log.read_text(errors="replace")
    return [json.loads(l) for l in text[: text.rfind("\n") + 1].splitlines() if l.startswith("{")]


def wait_for(pred, what: str, log: Path, timeout=600.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log.read_text(errors='replace')[-4000:] if log.exists() else 'no log'}")


def in_queue(job_id: str, env) -> bool:
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return bool(r.stdout.strip())


def adapter(state: Path) -> dict:
    return load_file(str(state / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference(packed):
    """The oracle: the same bundle run once, uninterrupted."""
    root, home = packed
    r = subprocess.run([str(root / "mine/run.sh"), "--state", str(root / "ref")], env=job_env(home), cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return adapter(root / "ref")


@pytest.mark.parametrize("how", ["high-priority-job", "scancel-signal-batch"])
def test_preempted_job_requeues_resumes_and_equals_an_uninterrupted_run(slurm, packed, reference, how):
    root, home = packed
    env = job_env(home)
    state = root / f"state-{how}"
    job_id = sbatch(["--partition=low", "--cpus-per-task=2", "--mem=1G", "--gres=none", "mine.sbatch", "--state", str(state)], root, env)
    log = root / f"spillpack-mine-{job_id}.log"
    wait_for(lambda: any(e["event"] == "step" for e in log_events(log)), "a step of the job", log)

    if how == "high-priority-job":
        # Needs the node's every core: Slurm must preempt (requeue) the low-partition job.
        sbatch(["--partition=high", "--cpus-per-task=2", "--mem=1G", "--output=/dev/null", "--wrap", "sleep 1"], root, env)
    else:
        r = subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr

    wait_for(lambda: not in_queue(job_id, env) and any(e["event"] == "done" for e in log_events(log)),
             "the job's end after its requeue", log)
    text = log.read_text(errors="replace")
    events = log_events(log)
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 2 and kinds.count("done") == 1, kinds
    pre = next(e for e in events if e["event"] == "preempted")
    restore = next(e for e in events if e["event"] == "restore")
    assert kinds.index("preempted") < kinds.index("restore")
    assert restore["step"] == pre["step"] > 0  # resumed exactly where the checkpoint was
    assert pre["signal"] == "SIGTERM"
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text and "SLURM_RESTART_COUNT=2" not in text
    if how == "scancel-signal-batch":
        assert "requeueing job" in text and "refused" not in text  # the script's own scontrol requeue did it
    done = events[-1]
    assert done["event"] == "done" and done["complete"] and done["steps"] == 400
    got = adapter(state)
    assert sorted(got) == sorted(reference)
    for k in got:
        np.testing.assert_array_equal(got[k], reference[k], err_msg=k)
