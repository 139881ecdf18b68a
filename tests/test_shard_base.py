"""`tune --shard-base`: the frozen base split across the ranks with FSDP2 (gloo on CPU). The
same adapter and losses as the data-parallel tune, preemption by a signal to one rank (resumed
sharded bit for bit, and unsharded on one process), a rank killed hard, and what it refuses.

Every rank runs with OMP_NUM_THREADS=1 (test_distributed.py's helpers)."""

import json
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import events_of, one_line, run_cli
from tests.support.jobproc import start
from test_distributed import BASE, DATA, assert_close, history, losses_of, ranks_of, signal_at_step

SHARDED = ["--shard-base", "on"]
# The whole jobs share one data-parallel run to compare with: one worker of `make test` runs them all.
WHOLE_JOB = pytest.mark.xdist_group("shard-base")


@pytest.fixture(scope="module")
def data_parallel(tiny_home, tmp_path_factory):
    """The data-parallel tune on 2 ranks, the whole base on each: what a sharded one must match."""
    state = tmp_path_factory.mktemp("dp") / "state"
    r = run_cli(BASE + ["--state", str(state), "--nproc", "2", "--shard-base", "off"],
                env={"SPILLPACK_HOME": str(tiny_home), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    start = [e for e in events_of(r.stdout) if e["event"] == "start"][0]
    assert start["shard_base"] is False and start["shard_reason"].startswith("--shard-base off")
    return state / "adapter"


# -- the parts ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,world", [(8, 2), (7, 2), (3, 4), (1, 2), (128, 3)])
def test_rows_are_fsdp2s_cut(n, world):
    """Each rank's rows are the chunk torch.chunk (FSDP2's Shard(0)) gives it, empty where it gives none."""
    import torch

    from runtime.engines.torch.shard import rows_of

    chunks = torch.arange(n).chunk(world)
    for r in range(world):
        lo, hi = rows_of(n, r, world)
        assert list(range(lo, hi)) == (chunks[r].tolist() if r < len(chunks) else [])


def test_a_ranks_rows_read_alone_are_the_rows_of_the_whole_tensor(home):
    from runtime.engines.torch.shard import rows_of
    from runtime.models.ref import resolve_model
    from runtime.models.weights import read_tensors, weight_files

    files = weight_files(resolve_model("tiny", None).path)
    whole = {n: a for n, _, a in read_tensors(files)}
    for r in range(3):
        part = {n: a for n, _, a in read_tensors(files, rows=lambda n, shape: rows_of(shape[0], r, 3))}
        assert part.keys() == whole.keys()
        for n, a in whole.items():
            lo, hi = rows_of(a.shape[0], r, 3)
            assert np.array_equal(part[n], a[lo:hi]), n


SMOLLM2 = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def test_the_planner_counts_a_ranks_share_of_the_base_and_what_it_gathers():
    """SmolLM2-135M's shape on 2 ranks: half of every tensor, the root's embedding whole and two
    layers whole; a memory that the whole base does not fit in fits the split one."""
    from runtime.models.memory import Batch, NoFit, base_params, fit, weights_per_rank

    params = base_params(SMOLLM2)
    root = 49152 * 576 + 576
    assert weights_per_rank(SMOLLM2, params, 1) == params
    assert weights_per_rank(SMOLLM2, params, 2) == pytest.approx(params / 2 + root + 2 * (params - root) / 30)
    plan = lambda gb, shards: fit(SMOLLM2, ("q_proj", "v_proj"), 8, 4, lambda m: [Batch(m, 64, 32)], 1, 1, "on", gb, "test",
                                  0.1, params, 2048, False, shards)
    whole, split = plan(100, 1).estimate.peak_gb, plan(100, 2).estimate.peak_gb
    assert split < 0.85 * whole
    with pytest.raises(NoFit):
        plan((whole + split) / 2, 1)
    assert plan((whole + split) / 2, 2).shards == 1  # fit plans; plan_shards records the split


def test_auto_splits_the_base_only_where_the_whole_does_not_fit(home, monkeypatch):
    """--shard-base auto on 2 ranks: the whole base where its plan fits, split (the reason naming
    the whole base's need) where it does not; on one process never split."""
    from runtime.config.invocation import resolve
    from runtime.jobs import sizing, tune
    from runtime.models.memory import NoFit

    planned = []

    def plan_tune(*args, shards=1):
        planned.append(shards)
        if shards == 1 and not fits_whole:
            raise NoFit("tune needs about 9.0 GB at micro-batch 1 with checkpointing; this machine has 5.0 GB", "a smaller model")
        return real(*args, shards)

    real = sizing.plan_tune
    monkeypatch.setattr(sizing, "plan_tune", lambda *a: plan_tune(*a[:-1], shards=a[-1]))
    inv = lambda: resolve("tune", {"model": "tiny", "data": DATA, "steps": 2, "engine": "torch-cpu"}, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    fits_whole = True
    p = tune.prepare(inv())[8]
    assert (p.shards, planned) == (1, [1]) and p.shard_why == "--shard-base auto: the whole base fits one rank's memory"
    fits_whole, planned[:] = False, []
    p = tune.prepare(inv())[8]
    assert (p.shards, planned) == (2, [1, 2])
    assert p.shard_why == ("--shard-base auto: the whole base does not fit one rank (tune needs about 9.0 GB at micro-batch 1 "
                           "with checkpointing; this machine has 5.0 GB), so it is split across 2 ranks")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(NoFit):
        tune.prepare(inv())


def test_a_base_with_loss_scaling_is_never_split(monkeypatch):
    """A float16 base (CUDA without bfloat16) scales its loss and may retry a step on one rank:
    `on` is one line, `auto` keeps the whole base."""
    from types import SimpleNamespace

    from runtime.base.errors import SpillpackError
    from runtime.jobs import sizing

    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = SimpleNamespace(precision=SimpleNamespace(loss_scaling=True, name="float16"))
    with pytest.raises(SpillpackError, match="does not run a float16 base with loss scaling"):
        sizing.plan_shards("torch-cuda", engine, None, None, None, None, 1, {"shard_base": "on"})
    monkeypatch.setattr(sizing, "plan_tune", lambda *a: SimpleNamespace(weights="resident"))
    plan = sizing.plan_shards("torch-cuda", engine, None, None, None, None, 1, {"shard_base": "auto"})
    assert plan.shards == 1


def test_an_abandoned_quantum_that_holds_collectives_is_not_agreed_on():
    """A sharded step abandoned on one rank (a second signal, a step longer than the grace): the
    others may wait in one of its gathers, so this rank discards it, commits and leaves without
    another collective, and does not wait at the group's last barrier."""
    from runtime.base.signals import Abandon, Preemption
    from runtime.core.events import Events
    from runtime.core.job import Job

    class Group:
        agreed: list = []

        def any(self, flag):
            self.agreed.append(flag)
            return flag

        def finish(self):
            raise AssertionError("waited at the barrier after leaving in the middle of a quantum")

    class Work:
        lockstep, done, discarded, commits = True, 3, 0, 0

        def remaining(self):
            return True

        def quantum(self):
            raise Abandon()

        def discard(self):
            self.discarded += 1

        def commit(self):
            self.commits += 1

    class Notices:
        def stop(self):
            pass

        def committed(self):
            pass

    group, work = Group(), Work()
    job = Job("tune", "t", Events("tune", True, quiet=True), "torch-cpu", "", None, Preemption(), Notices(), group)
    assert job.run(work).code == 75
    assert group.agreed == [False]  # the stop flag before the quantum, nothing after it
    assert (work.discarded, work.commits, job.group_lost) == (1, 1, True)
    job.close()


def test_on_with_one_rank_is_a_usage_line(home, tmp_path):
    r = run_cli(BASE + ["--state", str(tmp_path / "s"), *SHARDED])
    one_line(r, "--shard-base on", "one process", code=2)
    assert "--nproc 2" in r.stderr and not (tmp_path / "s").exists()


def test_on_with_an_engine_without_process_groups_is_one_line(home, tmp_path):
    r = run_cli(BASE + ["--state", str(tmp_path / "s"), *SHARDED, "--engine", "mlx"])
    one_line(r, "--shard-base on", "mlx engine has none", code=1)
    assert "--engine torch-cpu" in r.stderr and not (tmp_path / "s").exists()


# -- whole jobs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tiny_home, tmp_path_factory):
    """The same tune with the base split across its 2 ranks, uninterrupted: (state, events)."""
    state = tmp_path_factory.mktemp("sharded") / "state"
    r = run_cli(BASE + ["--state", str(state), "--nproc", "2", *SHARDED],
                env={"SPILLPACK_HOME": str(tiny_home), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return state, events_of(r.stdout)


@pytest.mark.slow
@WHOLE_JOB
def test_sharded_matches_the_data_parallel_tune(sharded, data_parallel):
    """24 steps on 2 ranks with the base split: the adapter and every step's loss within 1e-5 of
    the data-parallel tune's, in the same PEFT layout; the start event says it is split and why."""
    state, ev = sharded
    start = [e for e in ev if e["event"] == "start"][0]
    assert start["shard_base"] is True and start["shard_reason"] == "--shard-base on: the base split across 2 ranks"
    assert "the base split across 2 ranks" in start["message"]
    assert [e["step"] for e in ev if e["event"] == "step"] == list(range(1, 25))
    assert_close(state / "adapter", data_parallel)
    assert json.loads((state / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"


@pytest.mark.slow
@WHOLE_JOB
def test_sigterm_to_one_rank_under_nproc_exits_75_and_resumes_bit_identical(home, tmp_path, sharded):
    """`--nproc 2 --shard-base on`, SIGTERM to rank 1's process alone (not to the launcher): the
    launcher exits 75 after one commit; the same command resumes sharded at the same world size
    and ends with the uninterrupted sharded run's adapter and losses, bit for bit."""
    import psutil

    args = BASE + ["--state", str(tmp_path / "s"), "--nproc", "2", *SHARDED]
    p = start(args, env={"OMP_NUM_THREADS": "1"})
    events, sent = [], False
    for line in p.stdout:
        events.append(json.loads(line))
        if not sent and events[-1]["event"] == "step" and events[-1]["step"] == 5:
            rank1 = [c for c in psutil.Process(p.pid).children(recursive=True) if c.environ().get("RANK") == "1"]
            assert len(rank1) == 1
            rank1[0].send_signal(signal.SIGTERM)
            sent = True
    assert p.wait(timeout=300) == 75, p.stderr.read()
    stopped = [e for e in events if e["event"] == "preempted"][0]["step"]
    assert [e["step"] for e in events if e["event"] == "checkpoint"].count(stopped) == 1

    r = run_cli(args, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e for e in events_of(r.stdout) if e["event"] == "restore"][0]["step"] == stopped
    whole = sharded[0] / "adapter"
    a, b = load_file(str(tmp_path / "s" / "adapter" / "adapter_model.safetensors")), load_file(str(whole / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert losses_of(tmp_path / "s" / "adapter") == losses_of(whole)


@pytest.mark.slow
@WHOLE_JOB
def test_sigterm_to_one_sharded_rank_stops_all_and_resumes_unsharded_on_one(home, tmp_path, data_parallel):
    """SIGTERM to rank 1 only: both ranks exit 75 at the same step, rank 0 commits once; the job
    then ends as one process with the whole base, and matches the data-parallel tune."""
    state = tmp_path / "s"
    events, codes, errs = signal_at_step(ranks_of(BASE + ["--state", str(state), *SHARDED]), 5)
    assert codes == [75, 75], errs
    stopped = [e for e in events if e["event"] == "preempted"][0]["step"]
    assert 5 <= stopped < 24
    assert [e["step"] for e in events if e["event"] == "checkpoint"].count(stopped) == 1
    assert [h["step"] for h in history(state) if h["what"] == "interrupted"] == [stopped]

    r = run_cli(BASE + ["--state", str(state)], env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events_of(r.stdout)
    assert [e for e in ev if e["event"] == "restore"][0]["step"] == stopped
    assert [e for e in ev if e["event"] == "start"][0]["shard_base"] is False
    assert [e["step"] for e in ev if e["event"] == "step"] == list(range(stopped + 1, 25))
    assert_close(state / "adapter", data_parallel)


@pytest.mark.slow
@WHOLE_JOB
def test_a_sharded_rank_killed_hard_ends_the_group_and_the_rerun_resumes(home, tmp_path, data_parallel):
    """SIGKILL to rank 1 in the middle of a step: rank 0, waiting in a gather, loses its group and
    says so in one line (exit 1) well within the grace; the same sharded command continues from
    the last commit and matches the data-parallel tune."""
    state = tmp_path / "s"
    args = BASE + ["--state", str(state), *SHARDED]
    procs = ranks_of(args)
    for line in procs[0].stdout:
        e = json.loads(line)
        if e["event"] == "step" and e["step"] == 9:  # the commit of step 8 is behind it, step 10 in flight
            procs[1].kill()
            break
    procs[0].stdout.read()
    codes = [p.wait(timeout=60) for p in procs]  # a hang in a collective would outlast this
    err = procs[0].stderr.read()
    assert codes == [1, -signal.SIGKILL], err
    assert err.count("\n") == 1 and err.startswith("spillpack: rank 0 of 2 lost its process group"), err

    r = run_cli(args + ["--nproc", "2"], env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events_of(r.stdout)
    assert [e for e in ev if e["event"] == "restore"][0]["step"] >= 8
    assert_close(state / "adapter", data_parallel)
