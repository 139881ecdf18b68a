"""A data-parallel tune over torch.distributed (gloo on CPU): the same result as one process,
preemption of every rank by a signal to one, resume at another world size, two "nodes".

Every rank runs with OMP_NUM_THREADS=1: the machine's cores are shared, and ranks that each
start one thread per core wait on each other."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, events_of, run_cli
from runtime.data.train import rank_rows, rank_share

DATA = str(REPO / "examples/data/train.jsonl")
# 3 micro-batches of 4 rows a step: 2 ranks take 6 rows each (one micro-batch cut in two), 3 ranks one each.
BASE = ["tune", "tiny", DATA, "--steps", "24", "--batch", "4", "--grad-accum", "3", "--lr", "2e-3", "--warmup", "3",
        "--targets", "q_proj,v_proj", "--rank", "4", "--ckpt-every", "4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_of(**extra) -> dict:
    return {**os.environ, "SPILLPACK_HEADLESS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def torchrun(args: list[str], launcher: list[str], timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, *launcher, "-m", "spillpack", *args], capture_output=True, text=True,
                          env=env_of(), cwd=REPO, timeout=timeout)


def losses_of(adapter: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (adapter / "train_log.jsonl").read_text().splitlines()]


def assert_close(adapter: Path, reference: Path) -> None:
    a, b = load_file(str(adapter / "adapter_model.safetensors")), load_file(str(reference / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.abs(a[k] - b[k]).max() <= TOL, k
    la, lb = losses_of(adapter), losses_of(reference)
    assert len(la) == len(lb) == 24
    assert max(abs(x - y) for x, y in zip(la, lb)) <= TOL


def ranks_of(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """`world` ranks started as a launcher does (RANK, WORLD_SIZE, MASTER_*), each its own process."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO, env=env_of(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for r in range(world)]


def signal_at_step(procs: list[subprocess.Popen], step: int, sig=signal.SIGTERM) -> tuple[list[dict], list[int], list[str]]:
    """Rank 0's events, `sig` sent to rank 1 alone once rank 0 reports step `step`; then every
    rank's exit code and stderr."""
    events, sent = [], False
    for line in procs[0].stdout:
        e = json.loads(line)
        events.append(e)
        if not sent and e["event"] == "step" and e["step"] == step:
            procs[1].send_signal(sig)
            sent = True
    codes = [p.wait(timeout=300) for p in procs]
    errs = [p.stderr.read() for p in procs]
    assert sent, errs
    return events, codes, errs


def history(state: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (state / "history").glob("*.json")), key=lambda r: r["time"])


@pytest.fixture(scope="module")
def reference(tiny_home, tmp_path_factory) -> Path:
    """One process, uninterrupted: what every data-parallel run must match within 1e-5."""
    ref = tmp_path_factory.mktemp("dist-ref")
    r = run_cli(BASE + ["--state", str(ref / "state")], env={"SPILLPACK_HOME": str(tiny_home), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return ref / "state" / "adapter"


# -- the split ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,batch,world", [(3, 4, 2), (3, 4, 3), (4, 4, 3), (1, 4, 2), (1, 3, 4), (2, 1, 3), (5, 2, 8)])
def test_rank_shares_cover_each_row_once(n, batch, world):
    step = [[m * batch + i for i in range(batch)] for m in range(n)]
    shares = [rank_share(step, r, world) for r in range(world)]
    rows = sorted(i for share in shares for mb in share for i in mb)
    assert rows == sorted(i for mb in step for i in mb)
    assert all(len(mb) <= batch for share in shares for mb in share)  # never more rows at once than --batch
    sizes = [sum(len(mb) for mb in share) for share in shares]
    assert max(sizes) - min(sizes) <= 1  # balanced to one row


@pytest.mark.parametrize("world", [2, 3, 5])
def test_shares_sum_to_the_step_gradient(home, world):
    """The math a group relies on, on real tensors: the gradients of every rank's share (each
    divided by the whole step's target count) sum to the one-process step's gradient,
    whether the world size divides the micro-batches or not; with LoRA dropout too, each row
    keyed by its place in the step."""
    import torch

    from runtime.data.train import BatchOrder, collate, load_train_data
    from runtime.engines import OptimSpec
    from runtime.engines.registry import get_engine
    from runtime.models.lora import LoraSpec, init_tensors
    from runtime.models.ref import resolve_model
    from runtime.models.tokenizer import Tokenizer

    torch.manual_seed(0)
    model_dir = resolve_model("tiny", None)
    tok = Tokenizer.from_dir(model_dir.path)
    data = load_train_data(DATA, tok, 2048)
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), dropout=0.2)
    tensors = init_tensors(model_dir.config, spec, 0)
    tensors = {k: v + 0.01 for k, v in tensors.items()}  # B is zero at init: give A's gradient something to carry
    session = get_engine("torch-cpu").train_session(model_dir, spec, tensors, OptimSpec())
    step = BatchOrder([len(e.ids) for e in data.examples], 4, 3, 0).micro_batches(5)
    targets = sum(sum(data.examples[i].mask[1:]) for mb in step for i in mb)

    def grads(mbs):
        session.discard()
        loss, _ = session.forward_backward([(*collate([data.examples[i] for i in mb], 0), np.array(places))
                                            for mb, places in mbs], targets)
        return loss, {n: (session.params[n].grad.clone() if session.params[n].grad is not None else 0) for n in session.names}

    whole_loss, whole = grads(rank_rows(step, 0, 1))
    parts = [grads(rank_rows(step, r, world)) for r in range(world)]
    assert abs(sum(l for l, _ in parts) - whole_loss) <= 1e-4 * abs(whole_loss)
    for n in session.names:
        total = sum(g[n] for _, g in parts)
        assert torch.allclose(total, whole[n], atol=1e-6, rtol=1e-4), n


# -- whole jobs --------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_match_one_process(home, tmp_path, reference):
    state = tmp_path / "s"
    r = torchrun(BASE + ["--state", str(state)], ["--standalone", "--nproc-per-node", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events_of(r.stdout)
    # rank 0 speaks for the group: one start, one done, one event per step
    assert [e["event"] for e in ev].count("start") == 1 and [e["event"] for e in ev].count("done") == 1
    assert [e["step"] for e in ev if e["event"] == "step"] == list(range(1, 25))
    assert_close(state / "adapter", reference)
    opens = [h for h in history(state) if h["what"] == "open"]
    assert len(opens) == 1 and opens[0]["world"] == 2 and opens[0]["hosts"] == [socket.gethostname()] * 2
    assert len({h["writer"] for h in history(state)}) == 1  # one writer


@pytest.mark.slow
@pytest.mark.parametrize("resume_world", [1, 3])
def test_sigterm_to_one_rank_stops_all_then_resume_at_another_size(home, tmp_path, reference, resume_world):
    """Two ranks started as a launcher does (RANK, WORLD_SIZE, MASTER_*), SIGTERM to rank 1 only:
    both exit 75 at the same step, rank 0 commits once; the job then ends at another world size."""
    state = tmp_path / "s"
    procs = ranks_of(BASE + ["--state", str(state)])
    events, codes, errs = signal_at_step(procs, 5)
    assert codes == [75, 75], errs
    assert procs[1].stdout.read() == ""  # rank 1 is quiet
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1
    stopped = pre[0]["step"]
    assert 5 <= stopped < 24
    ck = [e for e in events if e["event"] == "checkpoint"]
    assert ck[-1]["step"] == stopped and [e["step"] for e in ck].count(stopped) == 1
    interrupted = [h for h in history(state) if h["what"] == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0]["step"] == stopped

    args = BASE + ["--state", str(state)]
    if resume_world == 1:
        r = run_cli(args, env={"OMP_NUM_THREADS": "1"})
    else:
        r = torchrun(args, ["--standalone", "--nproc-per-node", str(resume_world)])
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events_of(r.stdout)
    assert [e for e in ev if e["event"] == "restore"][0]["step"] == stopped
    assert [e["step"] for e in ev if e["event"] == "step"] == list(range(stopped + 1, 25))
    assert_close(state / "adapter", reference)


@pytest.mark.slow
def test_a_rank_killed_hard_ends_the_group_and_the_rerun_resumes(home, tmp_path, reference):
    """SIGKILL to rank 1: rank 0 loses its group and says so in one line (exit 1), nothing
    committed is lost, and the same command continues from the last commit."""
    state = tmp_path / "s"
    procs = ranks_of(BASE + ["--state", str(state)])
    for line in procs[0].stdout:
        e = json.loads(line)
        if e["event"] == "checkpoint" and e["step"] == 8:
            procs[1].kill()
            break
    procs[0].stdout.read()
    codes = [p.wait(timeout=300) for p in procs]
    err = procs[0].stderr.read()
    assert codes == [1, -signal.SIGKILL], err
    assert err.count("\n") == 1 and err.startswith("spillpack: rank 0 of 2 lost its process group"), err
    r = run_cli(BASE + ["--state", str(state)], env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e for e in events_of(r.stdout) if e["event"] == "restore"][0]["step"] >= 8
    assert_close(state / "adapter", reference)


@pytest.mark.slow
def test_two_nodes_with_a_static_rendezvous(home, tmp_path, reference):
    """Two torchrun launchers on 127.0.0.1, one process each, as two nodes of a cluster would be."""
    state = tmp_path / "s"
    port = free_port()
    launchers = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                                   "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                   "-m", "spillpack", *BASE, "--state", str(state)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(), cwd=REPO)
                 for n in range(2)]
    outs = [p.communicate(timeout=600) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], [e[-3000:] for _, e in outs]
    assert outs[1][0] == ""  # node 1's rank is quiet
    assert events_of(outs[0][0])[-1]["event"] == "done"
    assert_close(state / "adapter", reference)
    assert [h["world"] for h in history(state) if h["what"] == "open"] == [2]


# -- the launcher: --nproc / SPILLPACK_NPROC, and the nodes from a scheduler's environment ------


@pytest.mark.slow
def test_nproc_starts_the_group_sigterm_to_it_exits_75_and_resumes_at_three(home, tmp_path, reference):
    """What run.sh does with --nproc: this process runs torchrun's agent, forwards the
    scheduler's SIGTERM to its ranks and exits 75 when they do; `resume` with SPILLPACK_NPROC=3
    continues it on three."""
    from tests.support.jobproc import run_until

    args = BASE + ["--state", str(tmp_path / "s")]
    rc, events, err = run_until(args + ["--nproc", "2"], lambda e: e["event"] == "step" and e["step"] == 5,
                                env={"OMP_NUM_THREADS": "1"})
    assert rc == 75, err
    assert [e["event"] for e in events].count("preempted") == 1 and [e["event"] for e in events].count("start") == 1
    stopped = [e for e in events if e["event"] == "preempted"][0]["step"]
    assert "Traceback" not in err and "ChildFailedError" not in err
    # `spillpack resume STATE` starts the group too: each rank runs the same resume
    r = run_cli(["resume", str(tmp_path / "s")], env={"OMP_NUM_THREADS": "1", "SPILLPACK_NPROC": "3"})
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events_of(r.stdout)
    assert [e for e in ev if e["event"] == "restore"][0]["step"] == stopped
    assert_close(tmp_path / "s" / "adapter", reference)
    opens = [h for h in history(tmp_path / "s") if h["what"] == "open"]
    assert [h["world"] for h in opens] == [2, 3]


def test_mlx_with_more_than_one_process_is_one_line(home, tmp_path):
    r = run_cli(BASE + ["--state", str(tmp_path / "s"), "--nproc", "2", "--engine", "mlx"])
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("spillpack: ") and "mlx" in r.stderr
    assert not (tmp_path / "s").exists()


def test_a_row_job_under_torchrun_is_one_line(home, tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"custom_id": "a", "prompt": "hi"}\n')
    r = run_cli(["run", "tiny", str(rows), "--state", str(tmp_path / "s"), "--engine", "torch-cpu"],
                env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "only tune is data-parallel" in r.stderr, r.stderr


@pytest.mark.parametrize("env,nodes", [
    ({}, (1, 0, "127.0.0.1")),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}, (1, 0, "127.0.0.1")),  # the batch script is not a step
    ({"SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2", "SPILLPACK_MASTER_ADDR": "n1"}, (3, 2, "n1")),
    ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n"}, (2, 1, "10.0.0.5")),
    ({"SPILLPACK_NNODES": "4", "JOB_COMPLETION_INDEX": "3", "SPILLPACK_MASTER_ADDR": "job-0.job"}, (4, 3, "job-0.job")),
])
def test_nodes_from_a_schedulers_environment(env, nodes):
    from runtime.core.launch import nodes_from_env

    n = nodes_from_env(env)
    assert (n.count, n.rank, n.addr) == nodes and n.port == 29500


def test_an_srun_step_of_several_tasks_per_node_is_one_line():
    from runtime.base.errors import SpillpackError
    from runtime.core.launch import nodes_from_env

    with pytest.raises(SpillpackError, match="one task per node"):
        nodes_from_env({"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0"})


def test_a_node_rank_out_of_range_is_one_line():
    from runtime.base.errors import SpillpackError
    from runtime.core.launch import nodes_from_env

    with pytest.raises(SpillpackError, match="node rank 2 of 2"):
        nodes_from_env({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "2", "SKYPILOT_NODE_IPS": "a\nb"})
