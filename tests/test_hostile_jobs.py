"""Hostile input against jobs and their state: each test is named by the behaviour it checks
and runs the CLI as a user does (a subprocess on the tiny model, real files, real FIFOs, real
mounts where a disk must be full or read-only). The pack side is tests/test_hostile_pack.py.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, events_of, run_cli, one_line
from tests.support.s3_fixtures import s3, s3_uri  # noqa: F401  (pytest fixtures)

CHAT = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("yes", "no", "maybe", "never", "always", "soon")]


def jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def tune(data, state, *extra, env=None, timeout=300):
    return run_cli(["tune", "tiny", str(data), "--steps", "2", "--state", str(state), *extra], env=env, timeout=timeout)


def steps_of(r) -> list[int]:
    return [e["step"] for e in events_of(r.stdout) if e["event"] == "step"]


def done_of(r) -> dict:
    ev = events_of(r.stdout)
    assert ev and ev[-1]["event"] == "done", r.stderr
    return ev[-1]


@pytest.fixture
def data(tmp_path):
    return jsonl(tmp_path / "train.jsonl", CHAT)


# -- a private mount namespace: a real read-only file system, a real full disk ------------------


def mounts_available() -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"], capture_output=True)
    return r.returncode == 0


needs_mounts = pytest.mark.skipif(not mounts_available(), reason="needs root and unshare to mount a tmpfs privately")


def in_mount_namespace(script: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace (its mounts vanish with it). $SP runs
    the CLI as run_cli does."""
    full_env = {**os.environ, "SPILLPACK_HEADLESS": "1", "SP": f"{sys.executable} -m spillpack", **(env or {})}
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


# -- 4: job names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "..", ".", "a/b", "a\nb"])
def test_a_job_name_is_one_safe_path_component(home, data, name):
    r = run_cli(["tune", "tiny", data, "--steps", "2", "--name", name])
    one_line(r, "is not a job name")
    assert not (home / "jobs").exists() and not (home / "x").exists() and not (home.parent / "x").exists()


def test_a_name_derived_from_a_hostile_file_name_is_made_safe(home, tmp_path):
    hostile = jsonl(tmp_path / "a\ntouch PWNED\n$(id);`x`.jsonl", CHAT)
    r = run_cli(["tune", "tiny", hostile, "--steps", "1"])
    assert r.returncode == 0, r.stderr
    assert [p.name for p in (home / "jobs").iterdir()] == ["tune-a-touch-PWNED-id-x"]


# -- 7, 8: resume continues the state it is given, without the old per-run options ------------------


@pytest.mark.slow
def test_resume_continues_a_moved_state_from_anywhere(home, data, tmp_path):
    first = tmp_path / "first"
    r = tune(data, first, "--steps", "3", "--ckpt-every", "1", "--stop-after", "1")
    assert r.returncode == 0 and done_of(r)["steps"] == 1, r.stderr
    moved = tmp_path / "moved"
    shutil.move(str(first), str(moved))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli(["resume", str(moved)], cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert [e["step"] for e in ev if e["event"] == "restore"] == [1]
    assert done_of(r)["complete"] and done_of(r)["steps"] == 3
    assert not first.exists() and not (elsewhere / "first").exists()
    assert (moved / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_resume_does_not_replay_stop_after_and_takes_its_own(home, data, tmp_path):
    state = tmp_path / "s"
    assert tune(data, state, "--steps", "4", "--stop-after", "1").returncode == 0
    r = run_cli(["resume", str(state), "--stop-after", "2"])
    assert r.returncode == 0 and done_of(r)["steps"] == 2 and not done_of(r)["complete"], r.stderr
    r = run_cli(["resume", str(state)])
    assert r.returncode == 0 and done_of(r)["complete"] and done_of(r)["steps"] == 4, r.stderr


# -- 9: a torn commit record, and what status calls a process that exited 1 --------------------------


@pytest.mark.slow
def test_a_torn_or_empty_commit_record_is_passed_over(home, data, tmp_path):
    state = tmp_path / "s"
    args = ["--steps", "4", "--ckpt-every", "1"]
    assert tune(data, state, *args, "--stop-after", "1").returncode == 0
    (state / "commits" / "00000002.json").write_bytes(b"")  # a file system that lost the record's bytes
    (state / "commits" / "00000003.json").write_bytes(b'{"seq": 3, "kind": "chec')  # ... or half of them
    r = tune(data, state, *args)
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in events_of(r.stdout) if e["event"] == "restore"] == [1]
    assert done_of(r)["complete"] and steps_of(r) == [2, 3, 4]


@pytest.mark.slow
def test_status_does_not_call_a_process_that_exited_1_a_hard_kill(home, data, tmp_path):
    state = tmp_path / "s"
    for _ in range(2):  # diverges at step 2 each time: exit 1 with its line, twice
        one_line(tune(data, state, "--steps", "4", "--lr", "1e30", "--ckpt-every", "1"), "diverged")
    r = run_cli(["status", str(state)])
    assert r.returncode == 0, r.stderr
    told = events_of(r.stdout)
    assert not [e for e in told if e["kind"] == "hard_kill"]
    assert [e["kind"] for e in told if e["kind"] in ("process", "failed")] == ["process", "failed", "process", "failed"]
    assert "HARD KILL" not in "\n".join(e["text"] for e in told)


# -- 10: identity travels with every checkpoint ----------------------------------------------------


@pytest.mark.slow
def test_a_missing_job_json_does_not_disable_the_identity_check(home, data, tmp_path):
    state = tmp_path / "s"
    assert tune(data, state, "--steps", "3", "--ckpt-every", "1", "--stop-after", "1").returncode == 0
    (state / "job.json").unlink()
    one_line(tune(data, state, "--steps", "3", "--ckpt-every", "1", "--lr", "5e-2"), "holds a different job: lr is 0.0001 there and 0.05 here")
    one_line(tune(data, state, "--steps", "3", "--ckpt-every", "1", "--rank", "4"), "holds a different job")
    r = tune(data, state, "--steps", "3", "--ckpt-every", "1")
    assert r.returncode == 0 and done_of(r)["complete"], r.stderr
    assert [e["step"] for e in events_of(r.stdout) if e["event"] == "restore"] == [1]
    assert json.loads((state / "job.json").read_text())["lr"] == 0.0001


# -- 11: a failed bad input leaves no job.json; the corrected command runs --------------------------


@pytest.mark.slow
def test_bad_input_fails_before_the_state_exists(home, data, tmp_path):
    state = tmp_path / "s"
    wizard = jsonl(tmp_path / "w.jsonl", [{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in (["--out", "/proc/nope/x"], ["--rank", "100000"], ["--targets", "q_proj,nope"]):
        one_line(tune(data, state, *args))
        assert not (state / "job.json").exists(), args
    for bad in (wizard, str(fifo)):
        one_line(tune(bad, state), bad)
        assert not (state / "job.json").exists(), bad
    r = tune(data, state, "--rank", "4")  # the corrected command
    assert r.returncode == 0 and done_of(r)["complete"], r.stderr


@pytest.mark.slow
def test_a_run_that_failed_before_its_first_commit_does_not_claim_the_state(home, data, tmp_path):
    state = tmp_path / "s"
    one_line(tune(data, state, "--steps", "4", "--lr", "1e30"), "diverged")  # no commit before step 2 diverges
    r = tune(data, state, "--steps", "4", "--lr", "1e-3")
    assert r.returncode == 0 and done_of(r)["complete"], r.stderr


# -- 12: outputs are checked before the first step ---------------------------------------------------


@pytest.mark.parametrize("out", ["/proc/nope/x", "FILE"])
def test_tune_out_is_checked_before_the_first_step(home, data, tmp_path, out):
    if out == "FILE":
        out = str(tmp_path / "a-file")
        Path(out).write_text("keep me")
    r = tune(data, tmp_path / "s", "--out", out)
    one_line(r, f"--out {out}")
    assert steps_of(r) == [] and not (tmp_path / "s" / "job.json").exists()
    if out.endswith("a-file"):
        assert Path(out).read_text() == "keep me"


@needs_mounts
@pytest.mark.slow
def test_out_on_a_read_only_file_system(home, data, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = in_mount_namespace(f"mount -t tmpfs tmpfs {ro} && mount -o remount,ro {ro} && "
                           f"$SP tune tiny {data} --steps 2 --state {tmp_path / 's'} --out {ro}/adapter")
    one_line(r, f"--out {ro}/adapter cannot be written", "Read-only file system")
    assert steps_of(r) == []


def test_row_job_out_is_checked_before_any_row(home, tmp_path):
    rows = jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "hi"}])
    for out, expect in (("/proc/nope/x.jsonl", "cannot be written"), (str(tmp_path), "is a directory")):
        r = run_cli(["run", "tiny", rows, "--max-tokens", "2", "--state", str(tmp_path / "s"), "--out", out])
        one_line(r, expect)
        assert not any(e["event"] == "row" for e in events_of(r.stdout)) and not (tmp_path / "s" / "job.json").exists()


def test_row_job_existing_out_is_refused_before_the_state_exists(home, tmp_path):
    rows = jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "hi"}])
    args = ["run", "tiny", rows, "--max-tokens", "2", "--state", str(tmp_path / "s")]
    taken = tmp_path / "taken.jsonl"
    taken.write_text("someone else's results\n")
    r = run_cli([*args, "--out", str(taken)])
    assert r.returncode == 2 and "already exists and would be overwritten" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists() and taken.read_text() == "someone else's results\n"
    out = tmp_path / "out.jsonl"
    r = run_cli([*args, "--out", str(out)])
    assert r.returncode == 0 and done_of(r)["out"] == str(out), r.stderr
    # What this state's own finished run wrote is no obstacle: the same command reports it again.
    again = run_cli([*args, "--out", str(out)])
    assert again.returncode == 0 and done_of(again)["complete"] and done_of(again)["out"] == str(out), again.stderr


# -- 13: non-finite values ---------------------------------------------------------------------------


def test_non_finite_options_are_refused(home, data, tmp_path):
    for flag in ("--lr", "--alpha", "--weight-decay"):
        for value in ("inf", "nan", "-inf"):
            one_line(tune(data, tmp_path / "s", f"{flag}={value}"), f"{flag} must be a finite number")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_non_finite_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(home, data, tmp_path):
    state = tmp_path / "s"
    r = tune(data, state, "--steps", "6", "--lr", "1e30", "--ckpt-every", "1")
    line = one_line(r, "training diverged", "loss of step 2 is nan", "last good checkpoint (step 1)", "--lr")
    assert steps_of(r) == [1]
    commits = sorted((state / "commits").iterdir())
    assert [json.loads(c.read_text())["step"] for c in commits] == [1]
    losses = [json.loads(x)["loss"] for f in (state / "log").iterdir() for x in f.read_text().splitlines()]
    assert len(losses) == 1 and losses[0] == losses[0] and abs(losses[0]) < 100
    assert not (state / "adapter").exists() and "nan" not in json.dumps(events_of(r.stdout)[-1]).lower().replace(line.lower(), "")


# -- 14: config values obey the same rules as the command line -----------------------------------------


@pytest.mark.parametrize("key,value,expect", [
    ("steps", True, "--steps takes a whole number"), ("steps", -3, "--steps must be positive"),
    ("steps", "three", "--steps takes a whole number"), ("schedule", "linear", "--schedule is one of cosine, constant"),
    ("rank", [16], "--rank takes a whole number"), ("lr", None, "--lr needs a value"), ("lr", 1e400, "--lr must be a finite"),
    ("name", "../x", "is not a job name"), ("seed", -1, "--seed must be 0 or more"),
])
def test_config_values_are_checked_like_the_command_line(home, data, tmp_path, key, value, expect):
    cfg = tmp_path / "job.json"
    assert run_cli(["tune", "tiny", data, "--steps", "2", "--state", str(tmp_path / "s"), "--emit-config", str(cfg)]).returncode == 0
    config = json.loads(cfg.read_text())
    config["options"][key] = value
    cfg.write_text(json.dumps(config))
    one_line(run_cli(["tune", "--config", str(cfg)]), expect)
    assert not (tmp_path / "s").exists()


# -- 15: inputs that never end, and ranks past a layer's width ---------------------------------------------


def test_a_fifo_is_refused_not_waited_on(home, tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    # Nobody ever writes to it: a reader would block forever (the timeout fails the test then).
    one_line(tune(fifo, tmp_path / "s", timeout=120), "is not a regular file")
    r = run_cli(["run", "tiny", str(fifo), "--state", str(tmp_path / "r")], timeout=120)
    one_line(r, "is not a regular file")


def test_dev_zero_is_refused(home, tmp_path):
    one_line(tune("/dev/zero", tmp_path / "s", timeout=120), "/dev/zero is not a regular file")
    one_line(run_cli(["tune", "--config", "/dev/zero"], timeout=120), "config /dev/zero is not a regular file")


def test_a_line_longer_than_the_bound_is_refused(home, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_bytes(b'{"prompt": "' + b"x" * (17 << 20) + b'", "completion": "y"}\n')
    one_line(tune(long, tmp_path / "s"), "line 1 is longer than the 16 MiB a line may hold")
    assert not (tmp_path / "s").exists()


def test_the_line_bound_holds_wherever_the_pieces_break():
    from runtime.data.jsonl import CHUNK_BYTES, MAX_LINE_BYTES, bounded_lines
    from runtime.base.errors import SpillpackError

    def pieces(data: bytes, size: int):
        return (data[i:i + size] for i in range(0, len(data), size))

    fits = b"a\n" + b"x" * MAX_LINE_BYTES + b"\n" + b"y" * MAX_LINE_BYTES  # the last line has no newline
    for size in (CHUNK_BYTES, 777_777, len(fits)):  # store-sized pieces, odd ones, the whole file at once
        assert bounded_lines(pieces(fits, size), "d", "t") == fits
    for size in (CHUNK_BYTES, 777_777, 3 * MAX_LINE_BYTES):
        for over in (b"a\nb\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\nc\n", b"a\nb\n" + b"x" * (MAX_LINE_BYTES + 1)):
            with pytest.raises(SpillpackError, match="d line 3 is longer than the 16 MiB"):
                bounded_lines(pieces(over, size), "d", "t")


def _put(s3, uri: str, data: bytes) -> str:
    s3.put(uri[len(f"s3://{s3.bucket}/"):], data)
    return uri


def test_data_on_s3_has_the_same_line_bound(home, tmp_path, s3, s3_uri):
    long = b'{"custom_id": "a", "prompt": "hi"}\n{"custom_id": "b", "prompt": "' + b"x" * (17 << 20) + b'"}\n'
    r = run_cli(["run", "tiny", _put(s3, f"{s3_uri}/in.jsonl", long), "--state", str(tmp_path / "r")])
    one_line(r, f"{s3_uri}/in.jsonl line 2 is longer than the 16 MiB a line may hold", "aws s3 cp")
    assert not (tmp_path / "r").exists()
    one_line(tune(_put(s3, f"{s3_uri}/train.jsonl", long), tmp_path / "t"), "train.jsonl line 2 is longer than the 16 MiB")
    assert not (tmp_path / "t").exists()


def test_an_s3_object_that_is_not_jsonl_is_not_read_to_its_end(home, s3, s3_uri):
    """64 MiB without a newline: the read stops once a line passes the bound, so little more
    than that is ever held (measured in a fresh process, from after the S3 client is made, so
    neither botocore's models nor the in-process moto server's copies count)."""
    uri = _put(s3, f"{s3_uri}/weights.bin", os.urandom(1 << 20).replace(b"\n", b" ") * 64)
    probe = ("import tracemalloc; tracemalloc.start()\n"
             "from runtime.data.jsonl import read_bytes\n"
             "from runtime.base.errors import SpillpackError\n"
             "from runtime.state.uri import open_store\n"
             f"open_store({s3_uri!r}).size('weights.bin')\n"
             "before = tracemalloc.get_traced_memory()[0]; tracemalloc.reset_peak()\n"
             f"try: read_bytes({uri!r}); print('read to the end')\n"
             "except SpillpackError as e: print(e.line())\n"
             "print((tracemalloc.get_traced_memory()[1] - before) >> 20)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    told, held_mib = r.stdout.splitlines()
    assert "weights.bin line 1 is longer than the 16 MiB" in told, r.stdout + r.stderr
    assert int(held_mib) < 32, held_mib  # the whole object is 64 MiB


def test_rank_is_bounded_by_the_layer_width(home, data, tmp_path):
    one_line(tune(data, tmp_path / "s", "--rank", "100000"), "--rank 100000 is more than the width of k_proj (64)")
    assert not (tmp_path / "s").exists()
    r = tune(data, tmp_path / "ok", "--rank", "64", "--targets", "k_proj")
    assert r.returncode == 0, r.stderr


# -- 16: an S3 endpoint nobody answers at -----------------------------------------------------------


@pytest.fixture
def dead_endpoint(monkeypatch) -> dict:
    """A local port nothing listens on: every connection is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def test_an_unreachable_s3_endpoint_is_one_line(home, data, tmp_path, dead_endpoint):
    r = tune(data, "s3://bucket/state")
    one_line(r, "cannot reach the S3 endpoint", "AWS_ENDPOINT_URL")
    assert steps_of(r) == []


def test_an_unreachable_s3_endpoint_gives_up_instead_of_retrying_for_long(dead_endpoint):
    """The store gives up on a connection that was never made, within its ~10 s budget
    (docs/environment.md), where botocore alone makes its 10 attempts per request with backoff
    (24-43 s for a create and a delete). Attempts are counted, not seconds: refused connections
    fail at once, so the budget's waits (0.5, 1, 2, 2, 2, 2 s) allow 7 for the probe and one for
    its clean-up; a slower machine only makes fewer."""
    pytest.importorskip("boto3")
    from runtime.base.errors import SpillpackError
    from runtime.state.s3 import S3Store

    store = S3Store("s3://bucket/state")
    attempts = []
    store.s3.meta.events.register("before-send.s3", lambda **_: attempts.append(1))
    with pytest.raises(SpillpackError, match="cannot reach the S3 endpoint"):
        store.check_writable()
    assert 1 <= len(attempts) < 10, len(attempts)


# -- 17: each internal error has its own line ------------------------------------------------------------


@pytest.mark.parametrize("content,expect", [(None, "\"content\" is null"),
                                            ([{"type": "image_url", "image_url": {"url": "x"}}], "'image_url' is not supported"),
                                            (7, "must be a string or a list of text parts")])
def test_bad_content_is_one_line_in_tune_and_a_row_error_in_run(home, tmp_path, content, expect):
    bad = jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "y"}]}])
    one_line(tune(bad, tmp_path / "s"), "line 1: message 1 (user): ", expect)
    rows = jsonl(tmp_path / "r.jsonl", [{"custom_id": "bad", "body": {"messages": [{"role": "user", "content": content}]}},
                                        {"custom_id": "good", "prompt": "hi"}])
    r = run_cli(["run", "tiny", rows, "--max-tokens", "2", "--state", str(tmp_path / "r")])
    assert r.returncode == 0, r.stderr
    out = [json.loads(x) for x in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["bad", "good"]
    assert expect in out[0]["error"]["message"] and out[1]["error"] is None


@pytest.mark.slow
def test_content_as_text_parts_is_the_same_as_a_string(home, tmp_path):
    parts = lambda t: [{"type": "text", "text": t}]
    as_parts = jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": m["role"], "content": parts(m["content"])} for m in r["messages"]]}
                                            for r in CHAT])
    as_text = jsonl(tmp_path / "t.jsonl", CHAT)
    a, b = tune(as_parts, tmp_path / "a"), tune(as_text, tmp_path / "b")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert done_of(a)["final_loss"] == done_of(b)["final_loss"]
    rows = lambda content: [{"custom_id": "x", "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4}}]
    ra = run_cli(["run", "tiny", jsonl(tmp_path / "ra.jsonl", rows(parts("hello"))), "--state", str(tmp_path / "ra")])
    rb = run_cli(["run", "tiny", jsonl(tmp_path / "rb.jsonl", rows("hello")), "--state", str(tmp_path / "rb")])
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    body = lambda s: json.loads((tmp_path / s / "results.jsonl").read_text())["response"]["body"]
    assert body("ra")["choices"] == body("rb")["choices"] and body("ra")["usage"] == body("rb")["usage"]


def test_targets_comma_and_seed_minus_one(home, data, tmp_path):
    one_line(tune(data, tmp_path / "s", "--targets", ","), "--targets ',' names no layer")
    one_line(tune(data, tmp_path / "s", "--seed", "-1"), "--seed must be 0 or more")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_corrupt_job_json(home, data, tmp_path):
    state = tmp_path / "s"
    assert tune(data, state, "--steps", "3", "--ckpt-every", "1", "--stop-after", "1").returncode == 0
    (state / "job.json").write_text('{"comm')
    one_line(tune(data, state, "--steps", "3", "--ckpt-every", "1"), "job.json is damaged", f"delete {state}/job.json")
    (state / "job.json").unlink()  # what the line says to do: the commits still say which job this is
    r = tune(data, state, "--steps", "3", "--ckpt-every", "1")
    assert r.returncode == 0 and done_of(r)["complete"], r.stderr


def test_an_unwritable_spillpack_home(home, data, tmp_path):
    r = run_cli(["tune", "tiny", data, "--steps", "2"], env={"SPILLPACK_HOME": "/proc/spillpack-home"})
    one_line(r, "SPILLPACK_HOME /proc/spillpack-home cannot be used", "export SPILLPACK_HOME=")


@needs_mounts
@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_job_continues_once_there_is_room(home, data, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "out"
    r = in_mount_namespace(
        f"mount -t tmpfs -o size=160k tmpfs {disk} && "
        f"$SP tune tiny {data} --steps 3 --ckpt-every 1 --state {disk}/s > {out}.1 2> {out}.err; echo $? > {out}.rc; "
        f"mount -o remount,size=20m {disk} && $SP tune tiny {data} --steps 3 --ckpt-every 1 --state {disk}/s")
    first = subprocess.CompletedProcess([], int(Path(f"{out}.rc").read_text()), Path(f"{out}.1").read_text(), Path(f"{out}.err").read_text())
    one_line(first, "no space left on the disk of", "then the same command again")
    assert r.returncode == 0, r.stderr
    assert done_of(r)["complete"] and done_of(r)["steps"] == 3


# -- 19: old checkpoints removed; losses in an append-only log; resume exact --------------------------------


@pytest.mark.slow
def test_old_checkpoint_folders_go_and_losses_live_in_the_log(home, data, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ["--steps", "9", "--ckpt-every", "2"]
    assert tune(data, whole, *args).returncode == 0
    assert tune(data, split, *args, "--stop-after", "5").returncode == 0
    (split / "checkpoints" / "00000002-deadbeef").mkdir()  # a writer that died before its record
    (split / "checkpoints" / "00000002-deadbeef" / "state.safetensors").write_bytes(b"torn")
    r = tune(data, split, *args)
    assert r.returncode == 0, r.stderr
    for state in (whole, split):
        folders = sorted(p.name for p in (state / "checkpoints").iterdir())
        assert len(folders) == 2, folders
        for f in folders:
            meta = json.loads((state / "checkpoints" / f / "meta.json").read_text())
            assert "losses" not in meta and len(json.dumps(meta)) < 2000
    log = lambda s: (s / "adapter" / "train_log.jsonl").read_text()
    assert log(whole) == log(split) and len(log(whole).splitlines()) == 9
    assert (whole / "adapter" / "adapter_model.safetensors").read_bytes() == (split / "adapter" / "adapter_model.safetensors").read_bytes()


# -- 20: messages that name the right thing ------------------------------------------------------------------


def test_a_run_state_used_by_tune_says_so(home, data, tmp_path):
    state = tmp_path / "s"
    rows = jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "hi"}])
    assert run_cli(["run", "tiny", rows, "--max-tokens", "2", "--state", str(state)]).returncode == 0
    one_line(tune(data, state), "holds a run job, not a tune job")


def test_a_config_of_another_version_is_not_told_to_add_version_1(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"spillpack_config": 99, "command": "tune", "arguments": {}, "options": {}}))
    line = one_line(run_cli(["tune", "--config", str(cfg)]), "version 99")
    assert '"spillpack_config": 1' not in line


def _known_flags() -> set[str]:
    from spillpack.cli import LAPTOP_COMMANDS
    from runtime.cli import build_parser

    flags = set()
    parser = build_parser(LAPTOP_COMMANDS)
    for action in parser._actions:
        for sub in getattr(action, "choices", None) or {}:
            sp = action.choices[sub]
            for a in getattr(sp, "_actions", []):
                flags.update(s for s in a.option_strings if s.startswith("--"))
    return flags


def test_every_try_names_flags_that_exist():
    """Every string in an error's advice (SpillpackError, UsageError and the helpers that build
    them) names only flags some command takes: no --model, no --data."""
    import re

    # Besides spillpack's own: run.sh's --verify, pip download's flags in the wheel fetcher's advice, srun's.
    known = _known_flags() | {"--help", "--version", "--debug", "--headless", "--verify", "--only-binary", "--python-version",
             "--ntasks-per-node"}
    bad = []
    for path in [*REPO.glob("runtime/**/*.py"), *REPO.glob("spillpack/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "SpillpackError", "UsageError", "StateConflict", "_bad"):
                for const in ast.walk(node):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", const.value):
                            if flag not in known:
                                bad.append(f"{path.relative_to(REPO)}:{const.lineno}: {flag}")
    assert not bad, bad


# -- 21: unknown roles; pack validates the job as the runtime will --------------------------------------------


def test_an_unknown_role_is_refused_in_tune_and_is_a_row_error_in_run(home, tmp_path):
    wizard = [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]
    one_line(tune(jsonl(tmp_path / "t.jsonl", [{"messages": wizard}]), tmp_path / "s"), "unknown role 'wizard'")
    rows = jsonl(tmp_path / "r.jsonl", [{"custom_id": "w", "body": {"messages": wizard[:1]}}, {"custom_id": "ok", "prompt": "hi"}])
    assert run_cli(["run", "tiny", rows, "--max-tokens", "2", "--state", str(tmp_path / "r")]).returncode == 0
    first = json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[0])
    assert "unknown role 'wizard'" in first["error"]["message"]


@pytest.mark.parametrize("case", ["lr", "not-json", "wizard", "no-custom-id"])
def test_pack_refuses_a_job_the_runtime_would_refuse(home, data, tmp_path, case):
    cmd = {"lr": ["tune", "tiny", data, "--lr", "-1"],
           "not-json": ["tune", "tiny", jsonl(tmp_path / "bad.jsonl", ["not json"])],
           "wizard": ["tune", "tiny", jsonl(tmp_path / "w.jsonl", [{"messages": [{"role": "wizard", "content": "x"},
                                                                                {"role": "assistant", "content": "y"}]}])],
           "no-custom-id": ["run", "tiny", jsonl(tmp_path / "r.jsonl", [{"prompt": "hi"}])]}[case]
    r = run_cli(["pack", *cmd, "-o", str(tmp_path / "bundle")])
    one_line(r, {"lr": "--lr must be positive", "not-json": "line 1 is not JSON", "wizard": "unknown role 'wizard'",
                 "no-custom-id": "line 1 has no custom_id"}[case])
    assert not (tmp_path / "bundle").exists()
