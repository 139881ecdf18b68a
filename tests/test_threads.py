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
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16",
                   "OPENBLAS_NUM_THREADS": "1"}
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_NUM_THREADS": "4"}
    quiet_openmp(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["OPENBLAS_NUM_THREADS"] == "4"


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


def test_a_resume_keeps_the_thread_count_its_state_records():
    from runtime.base import threads

    ran = [{"what": "open", "engine": "torch-cpu"}, {"what": "engine", "engine": "torch-cpu", "threads": 1},
           {"what": "engine", "engine": "mlx"}]
    try:
        kept = threads.keep(ran, 4, {})
        assert kept.count == 1 and kept.why.startswith("kept from this job's earlier starts") and threads.job_threads(4) == kept
        assert threads.keep(ran, 4, {"SPILLPACK_THREADS": "3"}) is None  # the user's choice wins
        assert threads.keep([{"what": "engine", "engine": "torch-cpu", "threads": 8}], 4, {}) is None  # fewer CPUs now
        assert threads.keep([], 4, {}) is None and threads.job_threads(4) != kept  # a new job (a build's next stage) chooses
    finally:
        threads.keep([], 1, {})


def test_a_tune_resumed_on_more_free_cpus_keeps_its_threads_and_its_bits(home, tmp_path):
    """Stopped after running on 1 thread, resumed with nothing named on a machine with more CPUs:
    it keeps 1 thread and ends bit-identical to an uninterrupted 1-thread run (another count
    changes every tensor's last bits)."""
    from safetensors.numpy import load_file

    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: on 1 the choice is 1 thread anyway")
    tune = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "6", "--batch", "2", "--engine", "torch-cpu"]
    one = {"SPILLPACK_THREADS": "1", "OMP_NUM_THREADS": ""}
    r = run_cli(tune + ["--state", str(tmp_path / "ref")], env=one)
    assert r.returncode == 0, r.stderr
    r = run_cli(tune + ["--state", str(tmp_path / "s"), "--stop-after", "3"], env=one)
    assert r.returncode == 0, r.stderr
    r = run_cli(tune + ["--state", str(tmp_path / "s")], env={"OMP_NUM_THREADS": ""})
    assert r.returncode == 0, r.stderr
    evs = events_of(r.stdout)
    start = next(e for e in evs if e["event"] == "start")
    assert start["threads"] == 1 and start["threads_why"].startswith("kept"), start
    assert next(e for e in evs if e["event"] == "restore")["step"] == 3
    got, want = (load_file(str(tmp_path / s / "adapter" / "adapter_model.safetensors")) for s in ("s", "ref"))
    assert sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in got)


def test_status_tells_a_resume_on_another_thread_count_within_tolerance():
    from runtime.commands.story import resume_promise

    p = {"engine": "torch-cpu", "device": "Xeon (x86_64)", "software": "torch 2.13.0", "dtype": "float32"}
    same = resume_promise([{**p, "threads": 1, "first": 1, "last": 3}, {**p, "threads": 1, "first": 4, "last": 6}], "step")
    assert same["promise"] == "bit-identical"
    other = resume_promise([{**p, "threads": 1, "first": 1, "last": 3}, {**p, "threads": 2, "first": 4, "last": 6}], "step")
    assert other["promise"] == "within tolerance" and other["why"].startswith("the CPU thread count changed"), other


def test_a_narrow_model_runs_on_one_thread_unless_the_user_chose(home, tmp_path, monkeypatch):
    """A model narrower than NARROW_WIDTH runs on one thread whatever is free (its ops are too small
    to split); a wider one keeps the free CPUs' count; SPILLPACK_THREADS and OMP_NUM_THREADS still
    win. End to end: a `run` of tiny (128 wide) with nothing named starts on one thread, saying why,
    and its engine record in the state says the same count."""
    import os

    from runtime.base import threads

    monkeypatch.setattr(threads, "_chosen", lambda allotted: threads.Threads(2, "2 CPUs allotted, all free"))
    try:
        threads.for_model(128)
        t = threads.job_threads(2)
        assert t.count == 1 and t.why == "a model 128 wide runs on one thread: its ops are too small to split (2 CPUs allotted, all free)"
        threads.for_model(576)
        assert threads.job_threads(2).count == 2
        monkeypatch.setattr(threads, "_chosen", lambda allotted: threads.Threads(2, "SPILLPACK_THREADS"))
        threads.for_model(128)
        assert threads.job_threads(2).count == 2  # the user's choice
    finally:
        threads.keep([], 1, {})
    monkeypatch.undo()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: on 1 the choice is 1 thread anyway")
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hello"}) + "\n")
    r = run_cli(["run", "tiny", str(rows), "--state", str(tmp_path / "s"), "--max-tokens", "2", "--engine", "torch-cpu"],
                env={"OMP_NUM_THREADS": "", "SPILLPACK_THREADS": ""})
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    # one thread, for its width (or because another process held a CPU at start: the suite's other worker)
    assert start["threads"] == 1 and (start["threads_why"].startswith("a model 128 wide runs on one thread")
                                      or "idle at start" in start["threads_why"]), start
    history = [json.loads(line) for f in sorted((tmp_path / "s" / "history").iterdir()) for line in f.read_text().splitlines()]
    assert [h["threads"] for h in history if h.get("what") == "engine"] == [1]
