"""`run` on SmolLM2's GGUF under a real memory limit (a cgroup the test makes, tests/support/cgroup.py):
below what its weights need resident, the job streams them from the file's map and answers as the
unlimited run does, with no OOM kill and the cgroup's peak under the limit; the same weights as a
float32 GGUF larger than the limit run too (slow); a SIGTERM inside the
limit exits 75 and the rerun resumes to the same answers; a limit too small even to stream is one
line naming the minimum, and no state. The GGUF's pages are dropped from the page cache before each
limited run, so the limited job faults them in itself (charged to its own cgroup). A tune under a
limit below what its base needs resident streams the base from the file and ends with the unlimited
tune's adapter."""

import json
import os
import signal
import sys

import numpy as np
import pytest

from conftest import REPO, events_of, one_line, run_cli
from tests.support.cgroup import MemoryLimit, limit_unavailable
from tests.support.real_model import smollm2_gguf

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
# One thread and the scratch kernel on both sides: the same products in the same order, so the
# answers compare exactly (float32).
ENV = {"SPILLPACK_THREADS": "1", "SPILLPACK_QUANT_GEMM": "scratch"}
ARGS = ["--dtype", "float32", "--batch", "2", "--commit-rows", "1"]
MB = 2**20

pytestmark = pytest.mark.skipif(limit_unavailable() is not None, reason=f"no memory cgroup: {limit_unavailable()}")


def rows_file(path):
    path.write_text("".join(json.dumps({"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                         "max_tokens": 16}}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def contents(out):
    return [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] for line in out.read_text().splitlines()]


def drop_cached(path):
    """The file's clean pages out of the page cache: the next reader faults them in (and is charged)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def start_of(stdout):
    return next(e for e in events_of(stdout) if e["event"] == "start")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_home):
    """The unlimited run (weights resident): its answers, and its plan (what the limits derive from)."""
    d = tmp_path_factory.mktemp("limit")
    rows, out = rows_file(d / "rows.jsonl"), d / "ref.jsonl"
    env = {**ENV, "SPILLPACK_HOME": str(tiny_home)}
    r = run_cli(["run", str(smollm2_gguf()), str(rows), "--name", "ref", "--state", str(d / "ref"), "--out", str(out), *ARGS],
                env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    plan = start_of(r.stdout)["memory_plan"]
    assert plan["weights"] == "resident", plan
    return rows, contents(out), plan


def limited(limit_bytes, args, tmp_path, name, model=None):
    model = model or smollm2_gguf()
    limit = MemoryLimit.make(limit_bytes)
    assert limit is not None
    drop_cached(model)
    return limit, ["run", str(model), *args, "--name", name, "--state", str(tmp_path / name),
                   "--out", str(tmp_path / f"{name}.jsonl"), *ARGS]


def test_under_a_limit_below_the_weights_the_run_streams_and_answers_as_unlimited(reference, tmp_path, home):
    rows, answers, plan = reference
    cap = int((plan["estimated_peak_gb"] - 0.4 * plan["weights_gb"]) * 2**30)  # the resident plan does not fit it
    assert cap < (0.22 + 0.538) * 2**30  # below torch's import and the float32 weights
    limit, argv = limited(cap, [str(rows)], tmp_path, "lim")
    try:
        r = limit.run(argv, env=ENV, timeout=600)
        assert r.returncode == 0, r.stderr
        assert limit.oom_kills() == 0
        assert 0 < limit.peak_bytes() <= cap
        print(f"limit {cap / MB:.0f} MiB, cgroup peak {limit.peak_bytes() / MB:.0f} MiB")
    finally:
        limit.close()
    p = start_of(r.stdout)["memory_plan"]
    assert p["weights"] == "streamed" and p["weights_why"].startswith("streamed from the file: resident, it would take"), p
    assert "(cgroup memory limit)" in p["weights_why"] and p["streamed_gb"] > 0.08 and p["estimated_peak_gb"] * 2**30 <= cap
    assert contents(tmp_path / "lim.jsonl") == answers and "Paris" in answers[0]


@pytest.mark.slow
def test_a_model_larger_than_the_limit_runs_with_its_weights_streamed(reference, tmp_path, home):
    """The same weights as a float32 GGUF (515 MiB, written from the Q4_1 file as bench_llamacpp.py
    writes it): under a limit well below the file, the page cache holds what it can and the rest is
    read again from the file as each step needs it; the answers are the reference's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_llamacpp import f32_gguf

    rows, answers, plan = reference
    model = f32_gguf(smollm2_gguf(), tmp_path / "SmolLM2-135M-Instruct.F32.gguf")
    cap = int((plan["runtime_gb"] + 0.12) * 2**30)  # the process, and about 120 MiB for a 515 MiB file's pages
    assert cap < 0.8 * model.stat().st_size
    limit, argv = limited(cap, [str(rows)], tmp_path, "f32", model)
    try:
        r = limit.run(argv, env=ENV, timeout=900)
        assert r.returncode == 0, r.stderr
        assert limit.oom_kills() == 0 and 0 < limit.peak_bytes() <= cap
        print(f"float32 GGUF of {model.stat().st_size / MB:.0f} MiB under {cap / MB:.0f} MiB: cgroup peak "
              f"{limit.peak_bytes() / MB:.0f} MiB")
    finally:
        limit.close()
    p = start_of(r.stdout)["memory_plan"]
    assert p["weights"] == "streamed" and p["streamed_gb"] * 2**30 > cap, p
    assert contents(tmp_path / "f32.jsonl") == answers


@pytest.mark.slow
def test_a_sigterm_inside_the_limit_exits_75_and_resumes_to_the_same_answers(reference, tmp_path, home):
    rows, answers, plan = reference
    cap = int((plan["estimated_peak_gb"] - 0.4 * plan["weights_gb"]) * 2**30)
    limit, argv = limited(cap, [str(rows)], tmp_path, "sig")
    try:
        proc = limit.popen(argv, env=ENV)
        seen = []
        for line in proc.stdout:  # the first committed row, then the signal
            seen.append(json.loads(line))
            if seen[-1]["event"] == "checkpoint":
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 75, err
        assert any(e["event"] == "preempted" for e in events_of(out)), out
        r = limit.run(argv, env=ENV, timeout=600)
        assert r.returncode == 0, r.stderr
        assert limit.oom_kills() == 0 and limit.peak_bytes() <= cap
    finally:
        limit.close()
    events = events_of(r.stdout)
    assert any(e["event"] == "restore" and e["step"] >= 1 for e in events), events
    assert start_of(r.stdout)["memory_plan"]["weights"] == "streamed"
    assert contents(tmp_path / "sig.jsonl") == answers


def test_a_limit_too_small_even_to_stream_is_one_line_naming_the_minimum(reference, tmp_path, home):
    rows, _, plan = reference
    floor = plan["estimated_peak_gb"] - plan["weights_gb"]  # the streamed peak, less one layer: below it
    cap = int((floor - 0.02) * 2**30)
    limit, argv = limited(cap, [str(rows)], tmp_path, "small")
    try:
        r = limit.run(argv, env=ENV, timeout=300)
        assert limit.oom_kills() == 0
    finally:
        limit.close()
    line = one_line(r, "needs at least", "GB even with its weights streamed from the file", "the cgroup memory limit allows")
    need = float(line.split("needs at least ")[1].split(" GB")[0])
    assert need * 2**30 > cap and "Try: a memory limit of at least" in line
    assert not (tmp_path / "small").exists()  # nothing written to the state


# ---- a tune under the limit: its frozen base streamed from the file's map

TUNE = ["--steps", "20", "--batch", "2", "--max-seq", "64", "--dtype", "float32"]
TUNE_ENV = {"SPILLPACK_THREADS": "1"}  # one thread: the same products in the same order on both sides


def tune_args(tmp_path, name, *extra):
    return ["tune", str(smollm2_gguf()), str(REPO / "examples/data/train.jsonl"), "--name", name,
            "--state", str(tmp_path / name), *TUNE, *extra]


@pytest.mark.slow
def test_under_a_limit_below_the_resident_tune_the_tune_streams_its_base_to_the_same_adapter(tmp_path, home):
    from safetensors.numpy import load_file

    r = run_cli(tune_args(tmp_path, "ref"), env=TUNE_ENV, timeout=600)  # unlimited: the base resident
    assert r.returncode == 0, r.stderr
    assert start_of(r.stdout)["memory_plan"]["weights"] == "resident"
    # The least a resident base needs where its dense copy is over half the memory (kept in its blocks,
    # as it would be under the limit): the limit goes below it.
    r = run_cli(tune_args(tmp_path, "plan", "--plan", "--max-mem-gb", "1.0"), env=TUNE_ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    resident = events_of(r.stdout)[-1]
    assert resident["weights"] == "resident" and resident["base_quantized"] is True, resident
    cap = int((min(c["estimated_peak_gb"] for c in resident["candidates"]) - 0.05) * 2**30)
    limit = MemoryLimit.make(cap)
    assert limit is not None
    drop_cached(smollm2_gguf())
    try:
        r = limit.run(tune_args(tmp_path, "lim"), env=TUNE_ENV, timeout=600)
        assert r.returncode == 0, r.stderr
        assert limit.oom_kills() == 0 and 0 < limit.peak_bytes() <= cap
        print(f"tune under {cap / MB:.0f} MiB: cgroup peak {limit.peak_bytes() / MB:.0f} MiB")
    finally:
        limit.close()
    plan = start_of(r.stdout)["memory_plan"]
    assert plan["weights"] == "streamed" and "(cgroup memory limit)" in plan["weights_why"], plan
    assert plan["weights_why"].startswith("streamed from the file: resident, it would take") and plan["streamed_gb"] > 0.08
    ref, got = (load_file(str(tmp_path / n / "adapter" / "adapter_model.safetensors")) for n in ("ref", "lim"))
    assert ref.keys() == got.keys() and ref
    for k in ref:
        assert float(np.abs(ref[k] - got[k]).max()) <= 1e-6, k
