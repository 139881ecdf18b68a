"""torch-cpu's threads: one per allotted CPU found free at start, SPILLPACK_THREADS to choose,
OMP_NUM_THREADS winning over both, OpenMP's passive wait set before torch loads, and doctor and
the start event saying how many and why (runtime/base/threads.py)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, events_of, run_cli
from runtime.base.threads import choose, idle_cpus, quiet_openmp


def test_threads_follow_the_free_cpus():
    assert choose(4, {}, idle=4.0).count == 4
    assert choose(4, {}, idle=3.6) == choose(4, {}, idle=4.0)
    t = choose(4, {}, idle=1.2)  # three CPUs held by other processes
    assert t.count == 1 and t.why == "1.2 of 4 allotted CPUs idle at start (other processes hold the rest)"
    assert choose(4, {}, idle=2.5).count == 3
    assert choose(4, {}, idle=0.0).count == 1  # never none
    assert choose(1, {}, idle=0.0) == choose(1, {})  # one CPU: nothing to sample
    assert choose(1, {}).count == 1


def test_spillpack_threads_and_omp_num_threads_win_in_that_order():
    assert (choose(2, {"SPILLPACK_THREADS": "8"}, idle=0.0).count, choose(2, {"SPILLPACK_THREADS": "8"}).why) == (8, "SPILLPACK_THREADS")
    both = choose(2, {"SPILLPACK_THREADS": "8", "OMP_NUM_THREADS": "3"}, idle=2.0)
    assert (both.count, both.why) == (3, "OMP_NUM_THREADS")


def test_idle_cpus_sees_a_busy_core():
    """Two idle samples on this machine: a busy loop on one of its CPUs takes about one CPU away."""
    import os

    cpus = len(os.sched_getaffinity(0))
    quiet = idle_cpus(cpus, 0.3)
    assert quiet is not None and 0.0 <= quiet <= cpus + 0.01
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\nwhile time.time() < t: pass"])
    try:
        loaded = idle_cpus(cpus, 0.5)
    finally:
        busy.kill()
        busy.wait()
    assert loaded <= cpus - 0.6, (quiet, loaded)  # the busy loop's CPU is not idle, whatever else runs here


def test_passive_wait_is_set_unless_the_user_chose():
    env = {}
    quiet_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    quiet_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize("entry", ["runtime", "spillpack"])
def test_every_entry_point_sets_passive_wait_before_torch_loads(entry):
    """`python -m runtime` / `python -m spillpack` and the console script's main(): torch, once
    imported, finds OMP_WAIT_POLICY set (libgomp reads it when it loads)."""
    probe = ("import sys, runpy, builtins\n"
             "real = builtins.__import__\n"
             "def spy(name, *a, **k):\n"
             "    if name == 'torch' and 'torch' not in sys.modules:\n"
             "        import os; print('OMP_WAIT_POLICY at torch import:', os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = spy\n"
             f"sys.argv = ['{entry}', 'doctor', '--no-measure']\n"
             f"runpy.run_module('{entry}', run_name='__main__')\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "OMP_WAIT_POLICY at torch import: PASSIVE" in r.stderr


def test_doctor_and_start_say_the_threads_and_why(home, tmp_path):
    r = run_cli(["doctor", "--no-measure", "--headless"], env={"SPILLPACK_THREADS": "1", "OMP_NUM_THREADS": ""})
    assert r.returncode == 0, r.stderr
    d = events_of(r.stdout)[-1]
    assert (d["threads"], d["threads_why"], d["engines"]["torch-cpu"]["detail"].endswith("1 threads")) == (1, "SPILLPACK_THREADS", True)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hello"}) + "\n")
    r = run_cli(["run", "tiny", str(rows), "--state", str(tmp_path / "s"), "--max-tokens", "2", "--engine", "torch-cpu"],
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert (start["threads"], start["threads_why"]) == (1, "OMP_NUM_THREADS")
    r = run_cli(["doctor", "--no-measure"], env={"SPILLPACK_THREADS": "0", "OMP_NUM_THREADS": ""})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "spillpack: SPILLPACK_THREADS='0' is not a positive whole number of threads. Try: SPILLPACK_THREADS=2, or unset it"
