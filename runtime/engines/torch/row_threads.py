"""A tune's micro-batch split by rows across the CPU threads the job runs on.

On a CPU a tune's ops are mostly too small to split well across OpenMP threads: each op ends at
a barrier, and a small model's ops (tiny is 128 wide) leave a second thread idle most of each
call, while a wide model's elementwise ops and attention split no better. Split by rows
instead, each thread runs the whole forward and backward of its share of the micro-batch with
one OpenMP thread per op, and torch's kernels release the GIL while they compute. Measured on a
2-core AMD EPYC (Zen 4), float32, batch 4 of ~173 tokens, in one process, tokens/s:

    tiny                 one thread 11.3k, two threads per op 6.9k, two row threads 17.4k
    SmolLM2-135M         one thread 167, two threads per op 272, two row threads 322
    Qwen2.5-0.5B shape   two threads per op 87, two row threads 99 (the same peak memory)

What stays the same: each part's gradients are returned (torch.autograd.grad, never accumulated
by two threads at once) and summed in row order, so a step's result is a function of the
thread count alone (a resume keeps it: runtime.base.threads.keep) and bit-identical from run to
run; the activations kept are the micro-batch's, cut in parts; each part's loss chunk is the
session's divided among the parts, so the chunks alive at once hold what one did
(runtime.models.memory's plan holds). A micro-batch of one row runs on the calling thread with
all the job's threads per op.

A stop (runtime.base.signals) abandons a step in the calling thread; a part still running on a
worker finishes unseen (its result is dropped, and it touches no parameter or gradient): the
workers are daemon threads, so the exit that follows does not wait for them.
"""

from __future__ import annotations

import queue
import threading
import weakref

import numpy as np
import torch


class _Task:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg
        self.result = self.error = None
        self.done = threading.Event()


def _serve(tasks: queue.SimpleQueue) -> None:
    torch.set_num_threads(1)  # this thread's OpenMP team: one thread per op, from its first op on
    while True:
        task = tasks.get()
        if task is None:  # its RowThreads is gone (a session's end)
            return
        try:
            task.result = task.fn(task.arg)
        except BaseException as e:  # handed to the calling thread, which raises it
            task.error = e
        finally:
            task.done.set()


def _stop(queues: list) -> None:
    for q in queues:
        q.put(None)


class RowThreads:
    """`count` threads for a micro-batch's rows: the calling thread and count - 1 workers, started
    at the first split. Not concurrent.futures' pool: its threads are joined at the interpreter's
    exit, so a stop's exit 75 would wait for a worker's part, past a short grace."""

    def __init__(self, count: int):
        self.count = max(1, int(count))
        self._queues: list[queue.SimpleQueue] = []
        # The workers end with this object (a build's stages each make a session of their own).
        # Not at the interpreter's exit: a thread that ends while the process finalizes aborts it
        # (std::terminate in a thread-local destructor); daemon threads are left to the exit.
        weakref.finalize(self, _stop, self._queues).atexit = False

    def parts(self, rows: int) -> list[slice]:
        """The micro-batch's rows in min(count, rows) contiguous parts, the larger ones first."""
        return [slice(int(p[0]), int(p[-1]) + 1) for p in np.array_split(np.arange(rows), min(self.count, rows))]

    def map(self, fn, args: list) -> list:
        """[fn(a) for a in args], the first on the calling thread and each other on a worker, every op
        on one thread meanwhile; the results in order, or the first part's error raised."""
        if len(args) == 1:
            return [fn(args[0])]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the calling thread's ops, and MKL's own count, which is process-wide
        try:
            while len(self._queues) < len(args) - 1:
                q = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(q,), daemon=True, name=f"spillpack-rows-{len(self._queues) + 1}").start()
                self._queues.append(q)
            tasks = [_Task(fn, a) for a in args[1:]]
            for q, t in zip(self._queues, tasks):
                q.put(t)
            first = fn(args[0])
            for t in tasks:
                t.done.wait()  # a signal's handler still runs here (a stop may abandon the step)
        finally:
            torch.set_num_threads(threads)
        for t in tasks:
            if t.error is not None:
                raise t.error
        return [first, *(t.result for t in tasks)]
