"""A data-parallel tune over torch.distributed: the process group, the gradient all-reduce,
and the flags every rank agrees on.

Started by torchrun (or by `run.sh --nproc N`, which runs torchrun's launcher: see
runtime/core/launch.py), every rank runs the same job: it computes its share of each optimizer
step's micro-batches (runtime.data.train.rank_share), the LoRA gradients and the step's loss
sums are all-reduced before AdamW, so every rank applies the same update to the same
tensors. Rank 0 alone writes state and emits events. Before each step, and after each
quantum, the ranks agree on one flag by an all-reduce (any rank's SIGTERM or abandoned step
stops them all at the same step), which is why a collective never waits on a rank that
has left: they all leave at the same point.

gloo on CPU, NCCL on CUDA (each rank on the GPU of its LOCAL_RANK).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket

import torch
import torch.distributed as dist

from runtime.base.errors import SpillpackError
from runtime.base.signals import PROMISE_S, process_handler

# Long enough for rank 0 to write a merged model while the others wait at the last barrier.
TIMEOUT = datetime.timedelta(minutes=30)
SHARD_TIMEOUT_MIN_S = 30.0  # the shard group's timeout: the job's grace, never less than this


def collective(fn):
    """A collective whose peer is gone (crashed, killed, out of memory) is one line, not gloo's or
    NCCL's page: the rank that failed said why, and the launcher ends the group. For a method of
    an object with `rank` and `world` (a ProcessGroup; a sharded session, whose steps gather)."""
    @functools.wraps(fn)
    def wrapped(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except (RuntimeError, dist.DistError) as e:
            raise SpillpackError(f"rank {self.rank} of {self.world} lost its process group ({str(e).splitlines()[0][:160]}); "
                                 f"another rank stopped first, its error says why",
                                 "the same command again once that is fixed: it continues from the last commit") from e
    return wrapped


class ProcessGroup:
    """This process's place in the group, and the few collectives a data-parallel tune needs."""

    def __init__(self, engine_name: str):
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if engine_name == "torch-cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise SpillpackError(f"rank {self.rank} has local rank {self.local_rank} but this node has "
                                     f"{torch.cuda.device_count()} CUDA devices", "--nproc (or SPILLPACK_NPROC) at most the GPUs per node")
            torch.cuda.set_device(self.local_rank)  # the engine's "cuda" device is this rank's own GPU
            self.backend, self.device = "nccl", torch.device("cuda", self.local_rank)
        else:
            self.backend, self.device = "gloo", torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=TIMEOUT)
        # The group a sharded base's gathers run on (runtime/engines/torch/shard.py), made here where
        # every rank makes it at the same point: they wait only on the other ranks' share of the same
        # step, so a rank that is gone ends them within the job's grace, not TIMEOUT.
        grace = getattr(process_handler(), "promise_s", PROMISE_S)
        self.shard_group = dist.new_group(timeout=datetime.timedelta(seconds=max(SHARD_TIMEOUT_MIN_S, grace)))
        self.hosts = self._gather_hosts()

    @property
    def writer(self) -> bool:
        return self.rank == 0

    @collective
    def _gather_hosts(self) -> list[str]:
        hosts: list = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts

    @collective
    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any: the stop flag, an abandoned step."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    @collective
    def sum_gradients(self, session, loss_sum: float, tokens: int) -> tuple[float, int]:
        """Sum every rank's LoRA gradients (one flat buffer, one all-reduce) into the session's
        parameters, and the step's loss sum and token count; a rank with no share adds zeros."""
        params = [session.params[n] for n in session.names]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        at = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[at:at + n].view_as(p).clone()
            at += n
        # float64: a loss sum over many tokens keeps its digits
        stats = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)
        return float(stats[0].item()), int(stats[1].item())

    @collective
    def from_writer(self, payload):
        """Rank 0's `payload` on every rank (the restored checkpoint: only rank 0 reads state)."""
        box = [payload if self.writer else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @collective
    def finish(self) -> None:
        """Every rank waits for rank 0's last commit or outputs, then leaves the group."""
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


