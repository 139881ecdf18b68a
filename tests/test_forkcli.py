"""The tests' fork server (tests/support/forkcli.py) gives what a fresh `python -m spillpack`
gives: the same exit code, stdout and stderr, each call's own environment and working
directory, and a fresh interpreter where a call sets a variable a library reads as it loads."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, events_of
from tests.support import forkcli


def fresh(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "spillpack", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def untimed(stdout: str) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "time"} for e in events_of(stdout)]


@pytest.fixture
def env(home):
    return {**os.environ, "SPILLPACK_HEADLESS": "1"}


def test_a_forked_call_is_a_fresh_one(env, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}\n')
    cases = [
        ["models"],  # exit 0, no torch
        ["run", "tiny", str(rows), "--state", "s", "--out", "o.jsonl"],  # a job, relative paths under cwd
        ["run", "no-such-model", str(rows), "--state", "s2"],  # exit 1, one line
        ["tune", "tiny", str(rows), "--stpe", "3"],  # a typo: exit 2
    ]
    for n, args in enumerate(cases):
        a, b = tmp_path / f"forked{n}", tmp_path / f"fresh{n}"
        a.mkdir(), b.mkdir()
        forked, plain = forkcli.run(args, env, a, 300, REPO), fresh(args, env, b)
        assert forked is not None
        assert (forked.returncode, forked.stderr) == (plain.returncode, plain.stderr), args
        if args[0] == "run" and plain.returncode == 0:
            assert (a / "o.jsonl").read_bytes() == (b / "o.jsonl").read_bytes()  # SOURCE_DATE_EPOCH fixes `created`
        else:
            assert untimed(forked.stdout) == untimed(plain.stdout), args
    assert [forkcli.run(["models"], env, tmp_path, 300, REPO).returncode for _ in range(2)] == [0, 0]


def test_each_call_has_its_own_environment_and_a_load_time_variable_runs_fresh(env, tmp_path):
    empty = tmp_path / "empty-home"
    listed = forkcli.run(["models"], env, tmp_path, 300, REPO).stdout
    other = forkcli.run(["models"], {**env, "SPILLPACK_HOME": str(empty)}, tmp_path, 300, REPO).stdout
    assert "tiny" in listed and other != listed  # the second call saw its own SPILLPACK_HOME
    key = forkcli.load_time_env({**env, "OMP_NUM_THREADS": "7"})
    assert key["OMP_NUM_THREADS"] == "7"
    assert forkcli.load_time_env(env) != key  # another server (or a fresh interpreter) for it


def test_a_call_past_its_timeout_is_killed(env, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join('{"custom_id": "r%d", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}}\n' % i
                            for i in range(400)))
    with pytest.raises(subprocess.TimeoutExpired):
        forkcli.run(["run", "tiny", str(rows), "--state", "s", "--batch", "1"], env, tmp_path, 0.5, REPO)
