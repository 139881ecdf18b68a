"""A job's story, told from its state's history: one annotation per thing that happened, in
the order it happened. `spillpack status` prints their text, or (headless) each as a JSON line.

Each process that ran the job names its machine (host, engine, device, and what SkyPilot,
Slurm, Kubernetes or the cloud's metadata say: scheduler, job id, zone, instance type, world
size). Then what it restored, its checkpoints (step, seconds, URI), and how it ended: done,
stopped by --stop-after, interrupted by a signal (told before the checkpoint that signal
triggered, with the seconds from the signal to the commit against the grace period), failed
(exit 1, with its error line), or nothing at all. A process that left no end record although a later one took over was hard
killed (SIGKILL, out of memory, a lost machine): the work it did after its last commit, up
to where its progress record says it got, was repeated.

A job that ran in several processes ends with the promise docs/state.md makes for it: bit-
identical when nothing changed between them; else what changed, which steps or rows each
engine ran, and the tolerance promised instead.
"""

from __future__ import annotations

import datetime

from runtime.core import requeue
from runtime.state.jobstate import JobState

ROW_COMMANDS = ("run", "eval", "distill")


def when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _secs(x) -> str:
    return "?" if x is None else f"{x:.3f}".rstrip("0").rstrip(".") + " s"


def machine(r: dict) -> str:
    parts = [f"engine {r.get('engine')}"]
    if r.get("device"):
        parts.append(str(r["device"]))
    where = []
    if r.get("scheduler"):
        job = f" job {r['job_id']}" if r.get("job_id") else ""
        pod = f" pod {r['pod']}" if r.get("pod") else ""
        part = f" (partition {r['partition']})" if r.get("partition") else ""
        where.append(f"{r['scheduler']}{job}{pod}{part}")
    if (r.get("world") or 1) > 1:  # a data-parallel group: its rank 0 wrote for all its ranks
        hosts = r.get("hosts") or []
        counted = [h if hosts.count(h) == 1 else f"{h} x{hosts.count(h)}" for h in dict.fromkeys(hosts)]
        where.append(f"rank 0 of {r['world']}" + (f" on {', '.join(counted)}" if counted else ""))
    if r.get("shard") is not None:
        where.append(f"shard {r['shard']} of {r.get('shards')}")
    return "; ".join([", ".join(parts), *where])


def annotations(state: JobState, command: str | None = None) -> list[dict]:
    """The story as annotations: {"kind", "time", "text", ...fields}, in arrival order.
    `command`: the job's, for a state that keeps no invocation of its own (a shard's)."""
    invocation = state.invocation() or {}
    command = command or invocation.get("command")
    unit = "row" if command in ROW_COMMANDS else "stage" if command == "build" else "step"
    history = state.history()
    progress = state.progress()
    writers: list[str] = []
    for r in history:
        if r.get("writer") not in writers:
            writers.append(r.get("writer"))
    out: list[dict] = []
    ran: list[dict] = []  # each process's engine record: which resume promise applied
    for n, w in enumerate(writers):
        recs = [r for r in history if r.get("writer") == w]
        # A signal's interruption is told before the checkpoint it triggered.
        recs.sort(key=lambda r: r.get("signalled") or r["time"] if r["what"] == "interrupted" else r["time"])
        first = next((r for r in recs if r["what"] == "open"), recs[0])
        proc = n + 1
        out.append({"kind": "process", "time": first["time"], "process": proc, "host": first.get("host"), "pid": first.get("pid"),
                    **{k: first.get(k) for k in ("engine", "device", "scheduler", "job_id", "pod", "partition", "world", "hosts",
                                                 "shard", "shards") if first.get(k) is not None},
                    "text": f"process {proc} on {first.get('host')} (pid {first.get('pid')}), started {when(first['time'])}: {machine(first)}"})
        done = 0  # steps or rows committed so far, as this process saw it
        began = 0  # where this process took over: what it restored
        ended = False
        engines: list[dict] = []
        for r in recs:
            what, t = r["what"], r["time"]
            if what == "engine":
                engines.append({k: r.get(k) for k in ("engine", "device", "software", "dtype", "threads") if k != "threads" or k in r})
                out.append({"kind": "engine", "time": t, "process": proc, **engines[-1],
                            "text": f"  on {r.get('device')}, {r.get('software')}, {r.get('dtype')} base"})
            elif what == "plan":
                fields = {k: r.get(k) for k in ("micro_batch", "grad_accum", "grad_checkpoint", "estimated_peak_gb", "available_gb",
                                                "available_from")}
                out.append({"kind": "plan", "time": t, "process": proc, **fields,
                            "text": f"  sized for {r.get('available_gb')} GB ({r.get('available_from')}): micro-batch "
                                    f"{r.get('micro_batch')} x {r.get('grad_accum')}, checkpointing "
                                    f"{'on' if r.get('grad_checkpoint') else 'off'}, about {r.get('estimated_peak_gb')} GB at the peak"})
            elif what == "place":
                fields = {k: r[k] for k in ("cloud", "zone", "instance_type") if r.get(k)}
                text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in fields.items())
                out.append({"kind": "place", "time": t, "process": proc, **fields, "text": f"  cloud metadata: {text}"})
            elif what == "resume":
                done = began = r.get("step") or 0
                out.append({"kind": "resume", "time": t, "process": proc, unit: done, "uri": r.get("uri"),
                            "text": f"  resumed at {unit} {done} from {r.get('uri')}"})
            elif what == "checkpoint":
                done = r["step"] if "step" in r else done + (r.get("rows") or 0)
                out.append({"kind": "checkpoint", "time": t, "process": proc, unit: done, "seconds": r.get("seconds"), "uri": r.get("uri"),
                            "text": f"  checkpoint at {unit} {done} in {_secs(r.get('seconds'))}: {r.get('uri')}"})
            elif what == "interrupted":
                ended = True
                step = r.get("step")
                at = f"at {unit} {step}" if step is not None else "while starting"
                text = f"  interrupted by {r.get('signal')} {at}"
                if r.get("abandoned_quantum"):
                    text += f" (the {unit if unit != 'row' else 'generation step'} in flight was abandoned)"
                if r.get("seconds") is not None and r.get("grace_s"):
                    ok = "within" if r["seconds"] <= r["grace_s"] else "PAST"
                    text += f"; committed {_secs(r['seconds'])} after the signal, {ok} the {_secs(r['grace_s'])} grace"
                out.append({"kind": "interrupted", "time": r.get("signalled") or t, "process": proc, "signal": r.get("signal"),
                            unit: step, "abandoned_quantum": r.get("abandoned_quantum"), "seconds": r.get("seconds"),
                            "grace_s": r.get("grace_s"), "text": text})
            elif what == "failed":  # exited 1 with its error line: not a hard kill
                ended = True
                step = r.get("step") if r.get("step") is not None else done
                out.append({"kind": "failed", "time": t, "process": proc, unit: step, "error": r.get("error"),
                            "text": f"  failed at {unit} {step}: {r.get('error')}"})
            elif what == "eval":  # a tune's held-out loss (--val / --val-fraction)
                out.append({"kind": "eval", "time": t, "process": proc, "step": r.get("step"), "val_loss": r.get("val_loss"),
                            "tokens": r.get("tokens"), "seconds": r.get("seconds"), "best_step": r.get("best_step"),
                            "text": f"  held-out loss at step {r.get('step')}: {r.get('val_loss'):.6f} over {r.get('tokens')} tokens "
                                    f"in {_secs(r.get('seconds'))} (best so far: step {r.get('best_step')})"})
            elif what == "requeue-guard":  # exit 1 before any work: the starts before it made no progress
                ended = True
                out.append({"kind": "requeue_guard", "time": t, "process": proc, "stalled": r.get("stalled"), "reason": r.get("reason"),
                            "text": f"  stopped by the requeue guard (exit 1): {r.get('reason')}"})
            elif what in ("done", "stopped"):
                ended = True
                how = "finished" if what == "done" else "stopped by --stop-after"
                out.append({"kind": what, "time": t, "process": proc, unit: r.get("step"), "text": f"  {how} at {unit} {r.get('step')}"})
        # What counted of this process's work: from what it restored to its last commit (a
        # hard kill's steps past that commit were done again by the next process).
        ran += [{**e, "first": began + 1, "last": done} for e in engines]
        if not ended:
            reached = (progress.get(w) or {}).get("done")
            reached = done if reached is None else max(reached, done)
            last = (progress.get(w) or {}).get("time") or recs[-1]["time"]
            if proc < len(writers):
                repeated = reached - done
                out.append({"kind": "hard_kill", "time": last, "process": proc, "committed": done, "reached": reached, "repeated": repeated,
                            "text": f"  HARD KILL (no interruption record: SIGKILL, out of memory or a lost machine): last commit at "
                                    f"{unit} {done}, reached {unit} {reached}: {repeated} {unit}{'s' if repeated != 1 else ''} repeated "
                                    f"by the next process"})
            else:
                out.append({"kind": "running", "time": last, "process": proc, "committed": done, "reached": reached,
                            "text": f"  no end record yet: running, or killed after {unit} {reached}"})
    # An eval done again after a resume (past the last checkpoint) is told once, where it last happened.
    last_eval = {a["step"]: i for i, a in enumerate(out) if a["kind"] == "eval"}
    out = [a for i, a in enumerate(out) if a["kind"] != "eval" or last_eval[a["step"]] == i]
    if writers:
        c = requeue.counts(requeue.starts(history, progress))
        out.append({"kind": "starts", "time": out[-1]["time"] if out else None, **c,
                    "text": f"starts {c['starts']}: {c['preemptions']} preempted, {c['hard_kills']} hard killed; "
                            f"{c['stalled_in_a_row']} in a row before the newest made no progress (the requeue guard stops a job "
                            f"at --max-stalled-starts, default {requeue.DEFAULT_MAX_STALLED})"})
    promise = resume_promise(ran, unit) if len(writers) > 1 else None
    if promise:
        text = f"resume: {promise['promise']}: {promise['why']}"
        if promise.get("tolerance"):
            text += f"; promised: {promise['tolerance']}"
        out.append({"kind": "resume_promise", "time": out[-1]["time"] if out else None, **promise, "text": text})
    return out


FLOAT32 = ("float32", None)
# docs/state.md's promises for a job that changed engine, device, software or base dtype.
TOLERANCE = {
    "float32": "each step's loss within 1e-4 of an uninterrupted run's, each adapter tensor within 1e-4 of its norm",
    "half": "each step's LoRA gradients with cosine >= 0.999 of a float32 base's, losses within 5% of a float32 run's",
    "rows": "each row as an uninterrupted run writes it, within rounding (a greedy token may differ at a near-tie)",
}


def _ran_where(p: dict, unit: str) -> str:
    where = f"{p.get('engine')} ({p.get('device')}, {p.get('software')}, {p.get('dtype')} base)"
    first, last = p.get("first"), p.get("last")
    if first is None or last is None or last < first:
        return where
    span = f"{unit} {first}" if first == last else f"{unit}s {first}-{last}"
    return f"{span} on {where}"


def resume_promise(processes: list[dict], unit: str = "step") -> dict | None:
    """Which of docs/state.md's promises a job that ran in several processes gets: bit-identical
    when every process had the same engine, device model, software and base dtype; within the
    stated tolerance otherwise (other kernels round differently), except a row job's rows,
    which torch-cpu and mlx generate identically. Each process is its `engine` record, with
    `first` and `last`: the steps or rows of its work that counted, where known."""
    ran = [p for p in processes if p.get("device")]
    if len(processes) < 2 or not ran:
        return None
    # torch-cpu's thread count splits its sums (runtime.base.threads): part of what must match
    key = lambda p: (p.get("engine"), p.get("device"), p.get("software"), p.get("dtype"), p.get("threads"))  # noqa: E731
    first = ran[0]
    other = next((p for p in ran[1:] if key(p) != key(first)), None)
    if other is None:
        return {"promise": "bit-identical", "why": f"every process ran {first.get('engine')} on {first.get('device')} "
                                                   f"with {first.get('software')} ({first.get('dtype')} base)"}
    differs = [name for name, a, b in zip(("engine", "device", "software", "base dtype", "CPU thread count"), key(first), key(other))
               if a != b]
    if "engine" in differs:  # threads are torch-cpu's: beside another engine they say nothing more
        differs = [d for d in differs if d != "CPU thread count"]
    why = f"the {' and '.join(differs)} changed between processes: " + "; ".join(_ran_where(p, unit) for p in ran)
    fields = {"ran": [{k: p.get(k) for k in ("engine", "device", "software", "dtype", "first", "last")} for p in ran]}
    if unit == "row" and {p.get("engine") for p in ran} <= {"torch-cpu", "mlx"} and all(p.get("dtype") in FLOAT32 for p in ran):
        return {"promise": "identical rows", "why": why, "tolerance": "torch-cpu and mlx generate every row byte-identically", **fields}
    kind = "rows" if unit == "row" else "float32" if all(p.get("dtype") in FLOAT32 for p in ran) else "half"
    return {"promise": "within tolerance", "why": why, "tolerance": TOLERANCE[kind] + " (docs/state.md)", **fields}


def losses(state: JobState) -> list[float]:
    """A tune's losses by step: the finished adapter's log, else the newest checkpoint's."""
    import orjson

    from runtime.jobs.tune_checkpoint import CHECKPOINT_META

    log = state.store.read("adapter/train_log.jsonl")
    if log:
        return [orjson.loads(line)["loss"] for line in log.splitlines() if line.strip()]
    latest = state.checkpoints.latest()
    if latest is None or CHECKPOINT_META not in latest.files:
        return []
    return list(orjson.loads(state.read_file(latest, CHECKPOINT_META)).get("losses") or [])
