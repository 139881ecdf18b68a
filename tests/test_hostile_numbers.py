"""Hostile numbers: counts that would hang before the job starts or overflow what the
state records, and a stop during start-up, whatever the numbers.

The property-style pass enumerates every numeric option of every job command from the option
table (runtime/config/options.py, runtime/config/commands.py), so an option added later is
covered without a line here: each hostile value is either refused in one line, or accepted
within the bounds the state's records and the engines hold, in-process (parse and resolve,
as the CLI does). A few real subprocesses send SIGTERM during start-up with the largest
accepted counts, and must exit 75 within the grace budget.
"""

import functools
import json
import math
import signal
import subprocess
import sys

import orjson
import pytest

import conftest
from conftest import events_of, run_cli
from tests.support.jobproc import signal_after, start
from runtime.cli import build_parser, invocation
from runtime.config import options as O
from runtime.config.commands import COMMANDS, options_for
from runtime.base.errors import SpillpackError

CHAT = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("yes", "no", "maybe", "never", "always", "soon")]
HOSTILE = ("0", "-1", str(2**31), str(2**63), str(2**64), "1e300", "nan", "inf")
GRACE_S = 30  # the default grace: a stop's exit 75 lands within it


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    return str(path)


# A hostile number may be refused as a usage error (exit 2) as well as by the job (exit 1).
one_line = functools.partial(conftest.one_line, code=(1, 2))


# -- the property-style pass: every numeric option, every hostile value ------------------------------


def numeric_options():
    """(command, option) for every option of every job command that takes a number."""
    return [(c, o) for c in COMMANDS for o in options_for(c) if o.type in (int, float, O._stop_after)]


def resolved(command: str, opt: O.Opt, value: str):
    """The value as the CLI resolves `--option value`: parsed by the real parser, checked by resolve."""
    positional = {"model": "tiny", "data": "d.jsonl", "input": "r.jsonl", "evals": "e.jsonl", "teacher": "tiny",
                  "prompts": "p.jsonl", "folder": "f"}
    args = [command, *[positional[o.name] for o in options_for(command) if o.positional], f"{opt.flag_name}={value}"]
    if opt.name == "shard":
        args += ["--shards", str(O.SHARDS_MAX)]
    ns = vars(build_parser().parse_args(args))
    ns.pop("command")
    ns.pop("emit_config", None)
    ns.pop("force", None)
    ns.pop("plan", None)
    inv = invocation(command, ns)
    return inv, inv.get(opt.name)


def hostile_verdicts():
    """(case, problem or None) for each numeric option and hostile value."""
    out = []
    for command, opt in numeric_options():
        for value in HOSTILE:
            case = f"{command} {opt.flag_name} {value}"
            try:
                inv, got = resolved(command, opt, value)
            except SpillpackError as e:
                line = e.line()
                ok = "\n" not in line and line.startswith("spillpack: ") and ". Try: " in line and "unexpected" not in line
                out.append((case, None if ok else f"refused, but not in one line: {line!r}"))
                continue
            except Exception as e:  # what the CLI would print as `unexpected ...`
                out.append((case, f"unexpected {type(e).__name__}: {e}"))
                continue
            out.append((case, accepted_problem(command, opt, inv, got)))
    return out


def accepted_problem(command: str, opt: O.Opt, inv, got) -> str | None:
    """What is wrong with an accepted value: past what the state's records (orjson: 64-bit) and
    the engines' counters hold, not finite, or a count of steps that would not fit either."""
    try:
        orjson.dumps(inv.to_config())  # every option reaches the state's invocation.json, the identity its records
    except TypeError as e:
        return f"accepted, but the state cannot record it ({e})"
    if isinstance(got, float) and not math.isfinite(got):
        return f"accepted a non-finite {got}"
    if isinstance(got, int) and not isinstance(got, bool):
        bound = O.SEED_MAX if opt.name == "seed" else O.INT_MAX
        if not 0 <= got <= bound:
            return f"accepted {got}, outside 0..{bound}"
    # Counts of processes or shards: each one is a worker, a state folder and a line of `status`.
    workers = {"shards": O.SHARDS_MAX, "nproc": O.NPROC_MAX}.get(opt.name)
    if workers is not None and got is not None and got > workers:
        return f"accepted {got} {opt.name}, more than {workers}"
    if opt.name == "grace_s" and got is not None and got > O.GRACE_MAX_S:
        return f"accepted a grace of {got} s, which overflows the alarm that bounds a quantum"
    if command == "tune" and opt.name == "epochs" and got is not None:
        from runtime.data.train import BatchOrder

        try:  # the step count the epochs make, for the smallest data: must fit what the state records
            steps = BatchOrder([8] * 6, 4, 1, 0).steps_for(None, got)
        except SpillpackError:
            return None
        if steps > O.INT_MAX:
            return f"accepted --epochs {got}, which makes {steps} steps"
    return None


def test_every_numeric_option_refuses_hostile_values_in_one_line_or_takes_them_within_bounds():
    verdicts = hostile_verdicts()
    problems = [f"{case}: {p}" for case, p in verdicts if p]
    print(f"{len(verdicts)} hostile option values tried over {len(numeric_options())} numeric options, {len(problems)} problems")
    assert len(verdicts) == len(numeric_options()) * len(HOSTILE) > 100
    assert not problems, f"{len(problems)} of {len(verdicts)}:\n" + "\n".join(problems)


def test_the_pass_covers_every_numeric_option_of_the_table():
    """New options are covered by construction; this holds the enumeration to the table itself."""
    names = {(c, o.name) for c, o in numeric_options()}
    for c in COMMANDS:
        for o in options_for(c):
            if o.type in (int, float):
                assert (c, o.name) in names
    assert ("tune", "steps") in names and ("run", "shards") in names and ("tune", "grace_s") in names


# -- start-up work does not grow with an upper-limit count ---------------------------------------------


class CountingOrder:
    """A tune's batch order that counts how many steps' micro-batches were asked for."""

    def __init__(self, order):
        self.order, self.asked = order, 0
        self.per_epoch, self.effective = order.per_epoch, order.effective

    def micro_batches(self, step, size=None):
        self.asked += 1
        if self.asked > 100_000:
            raise AssertionError("the memory plan is looking at every one of the job's steps")
        return self.order.micro_batches(step, size)


def test_the_memory_plan_looks_at_a_bounded_number_of_steps_and_still_covers_every_step():
    from runtime.data.train import BatchOrder, Example
    from runtime.jobs.sizing import job_batches

    class Data:
        examples = [Example(list(range(n)), [0] * (n // 2) + [1] * (n - n // 2)) for n in (5, 9, 40, 7, 12, 3, 60, 8)]

    order = BatchOrder([len(e.ids) for e in Data.examples], 2, 1, seed=0)
    counting = CountingOrder(order)
    huge = job_batches(Data, counting, O.INT_MAX, 2)
    assert counting.asked <= 100_000
    # Every micro-batch the job can run is covered by a shape of the plan (none exceeds it in all three).
    exact = job_batches(Data, order, 200, 2)  # a job short enough to look at in full: many epochs
    for b in exact:
        assert any(h.tokens >= b.tokens and h.targets >= b.targets and h.seq >= b.seq for h in huge), (b, huge)


def test_huge_step_counts_start_and_stop_after_one_step(home, data, tmp_path):
    r = run_cli(["tune", "tiny", data, "--steps", str(O.INT_MAX), "--stop-after", "1", "--state", str(tmp_path / "s")],
                timeout=240)
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in events_of(r.stdout) if e["event"] == "step"] == [1]
    start_ev = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start_ev["steps"] == O.INT_MAX


@pytest.mark.parametrize("args,expect", [
    (["--steps", "99999999999999999999"], "--steps must be at most 9223372036854775807"),
    (["--seed", str(2**64)], "--seed must be at most 18446744073709551615"),
    (["--epochs", "1e300"], "--epochs 1e+300 is"),
    (["--grace-s", "1e300"], "--grace-s must be at most"),
])
def test_counts_past_what_the_state_records_are_one_line_and_leave_no_state(home, data, tmp_path, args, expect):
    r = run_cli(["tune", "tiny", data, "--state", str(tmp_path / "s"), *args], timeout=120)
    one_line(r, expect)
    assert not (tmp_path / "s").exists()


def test_the_largest_seed_runs(home, data, tmp_path):
    r = run_cli(["tune", "tiny", data, "--steps", "1", "--seed", str(O.SEED_MAX), "--dropout", "0.1", "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "s" / "job.json").read_text())["seed"] == O.SEED_MAX


def test_a_shard_count_past_the_bound_is_one_line_and_one_at_the_bound_finishes_its_shard(home, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"hi {i}"}) + "\n" for i in range(3)))
    base = ["run", "tiny", str(rows), "--max-tokens", "2"]
    one_line(run_cli([*base, "--shards", "99999999999", "--shard", "0", "--state", str(tmp_path / "a")], timeout=120),
             "--shards must be at most 100000")
    r = run_cli([*base, "--shards", str(O.SHARDS_MAX), "--shard", "0", "--state", str(tmp_path / "b")], timeout=240)
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["shards"] == O.SHARDS_MAX and done["merged"] is False
    assert "shards 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... still running" in r.stderr


# -- a stop during start-up exits 75 at once, whatever the numbers -------------------------------------


def stopped(args, after_s: float, tmp_path) -> tuple[int, list[dict], str]:
    """(exit code, events, stderr) of a job sent SIGTERM `after_s` after its start (a job refused at
    once may end by itself first on a quiet machine)."""
    p = start(args, env={"PYTHONFAULTHANDLER": "1"})  # a hung job's threads are dumped on SIGABRT
    signal_after(p, after_s)  # Popen.send_signal does nothing to a process that has already exited
    try:
        # communicate, not wait: its pipes are read meanwhile. A job that had filled its stdout
        # pipe (a fast start makes 64 KB of step events within seconds) blocked in write(), and a
        # stop does not end a blocked write: it ran on, stopped in events.emit, until killed.
        out, err = p.communicate(timeout=GRACE_S + 60)  # the grace, and room for a loaded machine's start-up
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)  # where it hangs, as faulthandler prints it, for the failure message
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        raise AssertionError(f"{' '.join(args)}: still running {GRACE_S + 60} s after SIGTERM; its stacks:\n{err[-6000:]}")
    rc = p.returncode
    return rc, events_of(out), err


def test_a_stop_while_a_huge_job_starts_exits_75_within_the_grace(home, data, tmp_path):
    """The stop lands while the job is being sized (the 2^63-1 steps once made that endless): 75."""
    rc, events, err = stopped(["tune", "tiny", data, "--steps", str(O.INT_MAX), "--batch", "1",
                               "--state", str(tmp_path / "s")], 5, tmp_path)
    assert rc == 75, err
    assert events[-1]["event"] == "preempted" and "Traceback" not in err


# The largest accepted value of each count that start-up work could grow with, stopped 1 s after start.
LARGEST = [
    ("tune", ["--steps", str(O.INT_MAX)]), ("tune", ["--epochs", "1e15"]), ("tune", ["--batch", str(2**31)]),
    ("tune", ["--grad-accum", str(2**31)]), ("tune", ["--max-seq", str(O.INT_MAX)]), ("tune", ["--ckpt-every", str(O.INT_MAX)]),
    ("tune", ["--warmup", str(O.INT_MAX)]), ("tune", ["--max-mem-gb", "1e300"]), ("tune", ["--grace-s", str(O.GRACE_MAX_S)]),
    ("run", ["--max-tokens", str(O.INT_MAX)]), ("run", ["--batch", str(O.INT_MAX)]), ("run", ["--commit-rows", str(O.INT_MAX)]),
    ("run", ["--commit-seconds", "1e300"]), ("run", ["--shards", str(O.SHARDS_MAX), "--shard", str(O.SHARDS_MAX - 1)]),
]


@pytest.mark.parametrize("command,args", LARGEST, ids=[f"{c} {' '.join(a)}" for c, a in LARGEST])
def test_a_stop_one_second_after_start_exits_75_with_the_largest_counts(home, data, tmp_path, command, args):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    job = ["tune", "tiny", data] if command == "tune" else ["run", "tiny", str(rows)]
    rc, events, err = stopped([*job, *args, "--state", str(tmp_path / "s")], 1, tmp_path)
    assert "Traceback" not in err and "unexpected" not in err, err
    if rc != 75:  # it finished before the stop landed: then as any run does, done or one line
        assert rc == 0 or (rc in (1, 2) and len(err.strip().splitlines()) == 1 and err.startswith("spillpack: ")), (rc, err)
        return
    assert events and events[-1]["event"] == "preempted"
