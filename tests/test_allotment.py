"""The CPUs and memory a process is allotted (a pod's limits, a container's, a Slurm step's):
read from cgroup files laid out as the kernel lays them out, then from a real cgroup this
machine creates, with the CLI run inside it as a user's job runs inside a pod."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import REPO, events_of
from runtime.base.allotment import cpus, memory_limit

DATA = str(REPO / "examples/data/train.jsonl")
GB = 2**30


def tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_cgroup_v2_quota_and_limit_with_the_tightest_ancestor(tmp_path):
    root = tree(tmp_path, {
        "kubepods/cpu.max": "max 100000\n", "kubepods/memory.max": str(64 * GB),
        "kubepods/memory.current": str(10 * GB), "kubepods/memory.stat": "anon 1\ninactive_file 0\n",
        "kubepods/pod1/cpu.max": "150000 100000\n", "kubepods/pod1/memory.max": str(16 * GB),
        "kubepods/pod1/memory.current": str(5 * GB), "kubepods/pod1/memory.stat": "anon 1\ninactive_file %d\n" % (2 * GB),
    })
    c = cpus("0::/kubepods/pod1\n", root)
    if len(os.sched_getaffinity(0)) > 2:
        assert (c.count, c.source) == (2, "cgroup CPU quota")  # 1.5 CPUs of time: two threads keep it busy
    (root / "kubepods/pod1/cpu.max").write_text("50000 100000\n")  # half a CPU: one thread, on any machine
    if len(os.sched_getaffinity(0)) > 1:
        assert (cpus("0::/kubepods/pod1\n", root).count, cpus("0::/kubepods/pod1\n", root).source) == (1, "cgroup CPU quota")
    m = memory_limit("0::/kubepods/pod1\n", root)
    assert (m.limit, m.working_set, m.available) == (16 * GB, 3 * GB, 13 * GB)  # the file cache is not held


def test_cgroup_v2_without_limits_and_v1_unlimited_are_none(tmp_path):
    root = tree(tmp_path, {"a/cpu.max": "max 100000\n", "a/memory.max": "max\n", "a/memory.current": "5"})
    assert memory_limit("0::/a\n", root) is None
    assert cpus("0::/a\n", root).source in ("cores", "CPU affinity")
    v1 = tree(tmp_path / "v1", {"memory/x/memory.limit_in_bytes": "9223372036854771712\n",
                                "memory/x/memory.usage_in_bytes": "100", "cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n",
                                "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    lines = "5:memory:/x\n3:cpu,cpuacct:/x\n"
    assert memory_limit(lines, v1) is None
    assert cpus(lines, v1).source in ("cores", "CPU affinity")


def test_cgroup_v1_limit_and_quota(tmp_path):
    root = tree(tmp_path, {"memory/docker/abc/memory.limit_in_bytes": str(4 * GB),
                           "memory/docker/abc/memory.usage_in_bytes": str(GB),
                           "memory/docker/abc/memory.stat": "cache 5\ntotal_inactive_file %d\n" % (GB // 2),
                           "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
                           "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    lines = "9:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    m = memory_limit(lines, root)
    assert (m.limit, m.available) == (4 * GB, 4 * GB - GB // 2)
    c = cpus(lines, root)
    assert (c.count, c.source) == (1, "cgroup CPU quota") and c.describe() == f"1 of {os.cpu_count()} cores (cgroup CPU quota)"


def test_a_container_whose_cgroup_path_names_the_host_reads_its_own_root(tmp_path):
    # Without a cgroup namespace the path is the host's, but the container sees its own cgroup at the mount's root.
    root = tree(tmp_path, {"memory/memory.limit_in_bytes": str(2 * GB), "memory/memory.usage_in_bytes": "0"})
    assert memory_limit("7:memory:/docker/0123abcd\n", root).limit == 2 * GB


# A real cgroup: the job runs inside it the way it runs inside a pod with limits.
def _real_cgroup(tmp_path, cpu_quota: float, memory: int):
    name = f"spillpack-test-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    made: list[Path] = []
    try:
        if v2.exists():
            enabled = Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split()
            if not {"cpu", "memory"} <= set(enabled):
                Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+cpu +memory")
            d = Path("/sys/fs/cgroup") / name
            d.mkdir()
            made.append(d)
            (d / "cpu.max").write_text(f"{int(cpu_quota * 100000)} 100000")
            (d / "memory.max").write_text(str(memory))
        else:
            mem, cpu = Path("/sys/fs/cgroup/memory") / name, Path("/sys/fs/cgroup/cpu") / name
            for d in (mem, cpu):
                d.mkdir()
                made.append(d)
            (mem / "memory.limit_in_bytes").write_text(str(memory))
            (cpu / "cpu.cfs_period_us").write_text("100000")
            (cpu / "cpu.cfs_quota_us").write_text(str(int(cpu_quota * 100000)))
    except OSError as e:
        for d in reversed(made):
            d.rmdir()
        pytest.skip(f"cannot create a cgroup with limits here ({e}): needs root and a writable cgroup filesystem")
    return made


@pytest.fixture
def cgroup(tmp_path):
    made = _real_cgroup(tmp_path, cpu_quota=1.0, memory=3 * GB)
    yield made
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            pass


def run_in(cgroup_dirs, args, env=None):
    enter = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in cgroup_dirs)
    cmd = ["sh", "-c", f'{enter} && exec "$@"', "sh", sys.executable, "-m", "spillpack", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "SPILLPACK_HEADLESS": "1", **(env or {})})


def test_a_job_in_a_cgroup_plans_for_its_limit_and_runs_one_thread_per_allotted_cpu(home, tmp_path, cgroup, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    r = run_in(cgroup, ["tune", "tiny", DATA, "--steps", "2", "--plan"])
    assert r.returncode == 0, r.stderr
    plan = events_of(r.stdout)[0]
    assert plan["available_from"] == "cgroup memory limit" and 2.5 < plan["available_gb"] <= 3.0, plan

    r = run_in(cgroup, ["doctor"])
    assert r.returncode == 0, r.stderr
    doctor = events_of(r.stdout)[-1]
    assert (doctor["cpus"], doctor["plan_memory_from"]) == (1, "cgroup memory limit"), doctor
    if (os.cpu_count() or 1) > 1:
        assert doctor["cpus_from"] == "cgroup CPU quota"
        assert doctor["engines"]["torch-cpu"]["detail"].endswith(", 1 threads"), doctor["engines"]["torch-cpu"]

    state = tmp_path / "s"
    r = run_in(cgroup, ["tune", "tiny", DATA, "--steps", "2", "--state", str(state)])
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["memory_from"] == "cgroup memory limit" and start["memory_gb"] <= 3.0
    story = subprocess.run([sys.executable, "-m", "spillpack", "status", str(state)], capture_output=True, text=True,
                           cwd=REPO, env={**os.environ, "SPILLPACK_HEADLESS": "0"}).stdout
    if (os.cpu_count() or 1) > 1:
        assert f"1 of {os.cpu_count()} cores (cgroup CPU quota)" in story and "3.0 of " in story, story
    history = [json.loads(line) for p in sorted((state / "history").iterdir()) for line in p.read_text().splitlines()]
    assert any("cgroup memory limit" in json.dumps(h) for h in history)
