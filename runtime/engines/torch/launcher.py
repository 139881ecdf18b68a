"""torch.distributed's launcher (the elastic agent torchrun runs) for `tune --nproc N`: this
node's ranks, the signals forwarded to them, and their exit codes turned into one.

The agent would turn SIGTERM into an exception that loses the ranks' exit codes, so it is
told to leave SIGTERM, SIGINT and SIGHUP alone: this process forwards them to its ranks
(who agree to stop at the same step, commit once and exit 75) and then reads their codes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import psutil
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from runtime.base.allotment import cpus
from runtime.base.errors import EXIT_PREEMPTED, SpillpackError

RENDEZVOUS_TIMEOUT_S = 900  # nodes of one job may start minutes apart (images, queues)


def run_group(command: list[str], nproc: int, nodes, name: str, debug: bool = False) -> int:
    """Run this node's `nproc` ranks, each `python COMMAND`, under torch's elastic agent; the exit code."""
    if not debug:  # the one line below says what happened; the agent's own log is for --debug
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Ranks that each start one thread per core wait on each other (torchrun's own default is 1).
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpus().count // nproc))
    single = nodes.count == 1
    config = LaunchConfig(
        min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=nproc, run_id=f"spillpack-{name}",
        rdzv_backend="c10d" if single else "static", rdzv_endpoint="127.0.0.1:0" if single else f"{nodes.addr}:{nodes.port}",
        rdzv_configs={"timeout": RENDEZVOUS_TIMEOUT_S, **({} if single else {"rank": nodes.rank})},
        max_restarts=0, monitor_interval=0.1,
    )
    if hasattr(config, "signals_to_handle"):  # newer torch sets the variable above from here
        config.signals_to_handle = "SIGQUIT"
    previous = {sig: signal.signal(sig, _forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        elastic_launch(config, sys.executable)(*command)
        return 0
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        # Ranks leave together after rank 0's commit, but the agent may see one exit first and
        # end the others with SIGTERM: that is still a preempted group.
        if EXIT_PREEMPTED in codes.values() and set(codes.values()) <= {EXIT_PREEMPTED, -signal.SIGTERM}:
            return EXIT_PREEMPTED
        rank, code = next((r, c) for r, c in sorted(codes.items()) if c != EXIT_PREEMPTED)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise SpillpackError(f"rank {rank} of the data-parallel group {how}, so the group stopped",
                             "the same command again: it continues from the last commit")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward(signum, frame) -> None:
    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
