"""`tune --nproc N` (or SPILLPACK_NPROC=N), and several nodes: start the data-parallel group with
torch.distributed's own launcher (the elastic agent torchrun runs), one per node.

Each worker runs this very command line again; it sees WORLD_SIZE (set by the agent) and
runs as one rank (runtime/core/job.py, runtime/engines/torch/distributed.py). The nodes
come from the scheduler's environment, read through one small mapping per scheduler; the
agent itself runs in runtime/engines/torch/launcher.py (torch is imported only there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from runtime.base import ranks
from runtime.base.errors import SpillpackError
from runtime.engines.registry import group_launcher

DEFAULT_PORT = 29500
NPROC_MAX = 1024  # data-parallel processes on one machine: one per GPU, or per CPU at the most


@dataclass(frozen=True)
class Nodes:
    count: int = 1
    rank: int = 0
    addr: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    source: str = "this machine"


def _int(env, name: str, default=None) -> int:
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SpillpackError(f"{name}={value!r} is not a whole number", f"export {name}=N")


def _explicit(env) -> Nodes | None:
    """SPILLPACK_NNODES, SPILLPACK_NODE_RANK (or a Kubernetes Indexed Job's JOB_COMPLETION_INDEX),
    SPILLPACK_MASTER_ADDR, SPILLPACK_MASTER_PORT: what the Kubernetes template sets, and what
    any other launcher can."""
    if "SPILLPACK_NNODES" not in env:
        return None
    rank = env.get("SPILLPACK_NODE_RANK", env.get("JOB_COMPLETION_INDEX", "0"))
    return Nodes(_int(env, "SPILLPACK_NNODES"), _int({"rank": rank}, "rank"), env.get("SPILLPACK_MASTER_ADDR", "127.0.0.1"),
                 _int(env, "SPILLPACK_MASTER_PORT", DEFAULT_PORT), "SPILLPACK_NNODES")


def _skypilot(env) -> Nodes | None:
    if "SKYPILOT_NUM_NODES" not in env:
        return None
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    return Nodes(_int(env, "SKYPILOT_NUM_NODES"), _int(env, "SKYPILOT_NODE_RANK", 0), ips[0] if ips else "127.0.0.1",
                 _int(env, "SPILLPACK_MASTER_PORT", DEFAULT_PORT), "SkyPilot")


def _slurm(env) -> Nodes | None:
    """Inside an `srun` step with one task per node (the batch script itself is not a step:
    run there, run.sh is one node whatever the allocation)."""
    if "SLURM_STEP_NUM_NODES" not in env or "SLURM_NODEID" not in env:
        return None
    count = _int(env, "SLURM_STEP_NUM_NODES")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", count)
    if tasks != count:  # each task would start its own group on the one state
        raise SpillpackError(f"this srun step runs {tasks} tasks on {count} node(s); spillpack wants one task per node, "
                             f"whose launcher starts the node's ranks", "srun --ntasks-per-node=1 ... with SPILLPACK_NPROC=<GPUs per node>")
    addr = env.get("SPILLPACK_MASTER_ADDR") or (_first_host(env.get("SLURM_STEP_NODELIST", "")) if count > 1 else "127.0.0.1")
    return Nodes(count, _int(env, "SLURM_NODEID"), addr, _int(env, "SPILLPACK_MASTER_PORT", DEFAULT_PORT), "Slurm")


def _first_host(nodelist: str) -> str:
    if not shutil.which("scontrol"):
        raise SpillpackError(f"cannot expand the Slurm node list {nodelist!r} without scontrol",
                             "export SPILLPACK_MASTER_ADDR=$(scontrol show hostnames | head -n1) in the batch script")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise SpillpackError(f"scontrol could not expand the node list {nodelist!r}", "export SPILLPACK_MASTER_ADDR=<first node>")
    return hosts[0]


def nodes_from_env(env=None) -> Nodes:
    env = os.environ if env is None else env
    for source in (_explicit, _skypilot, _slurm):
        nodes = source(env)
        if nodes is not None:
            if nodes.count < 1 or not 0 <= nodes.rank < nodes.count:
                raise SpillpackError(f"node rank {nodes.rank} of {nodes.count} nodes (from {nodes.source}) is out of range",
                                     "one task per node, with node ranks 0..N-1")
            return nodes
    return Nodes()


def processes_per_node(option: int | None, env=None) -> int:
    env = os.environ if env is None else env
    if option is not None:
        return option
    n = _int(env, "SPILLPACK_NPROC", 1)
    if not 1 <= n <= NPROC_MAX:
        raise SpillpackError(f"SPILLPACK_NPROC must be from 1 to {NPROC_MAX}, not {n}", "export SPILLPACK_NPROC=2")
    return n


def wanted(command: str, options: dict) -> tuple[int, Nodes] | None:
    """(processes per node, nodes) when this command should start a group; None to run here.
    A rank of a group already started (WORLD_SIZE set) never starts another."""
    if command != "tune" or ranks.world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    nproc, nodes = processes_per_node(options.get("nproc")), nodes_from_env()
    return (nproc, nodes) if nproc * nodes.count > 1 else None


def worker_command() -> list[str]:
    """How this process was started, so each worker runs the same program: a bundle's
    spillpack.pyz, `python -m spillpack` / `-m runtime`, or the `spillpack` script."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None) and not sys.argv[0].endswith(".pyz"):
        return ["-m", spec.name.removesuffix(".__main__")]
    return [sys.argv[0]]


def launch(argv: list[str], nproc: int, nodes: Nodes, engine: str, name: str, debug: bool = False) -> int:
    """Run this node's ranks of the group; the exit code (the engine's launcher, through runtime/engines/registry.py)."""
    run_group = group_launcher(engine)
    if run_group is None:
        raise SpillpackError(f"the {engine} engine runs one process, not {nproc * nodes.count}",
                             "run it without --nproc (and SPILLPACK_NPROC unset), or with --engine torch-cuda|torch-cpu")
    try:
        return run_group([*worker_command(), *argv], nproc, nodes, name, debug)
    except ImportError:
        raise SpillpackError("--nproc needs torch with torch.distributed on this machine", "spillpack doctor")
