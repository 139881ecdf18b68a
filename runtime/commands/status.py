"""`spillpack status URI`: the story of a job, told from its state's history.

Each process that ran it (host, engine), what it restored, its checkpoints with their
seconds, and how it ended: done, stopped by --stop-after, interrupted by a signal, or
nothing at all. A process that left no end record although a later one took over was hard
killed (SIGKILL, out of memory, a lost machine): the work it did after its last commit was
repeated, and its progress hint (state.note_progress) says about how much.
"""

import datetime

from runtime.commands import shard_status
from runtime.errors import SpillpackError
from runtime.state.jobstate import JobState
from runtime.state.store import open_store

END = ("done", "stopped", "interrupted", "failed")


def add_arguments(parser) -> None:
    parser.add_argument("uri", metavar="URI", help="a job's state: a path, file:// or s3:// URI")


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _counted(hosts: list) -> list[str]:
    """['a', 'a', 'b'] -> ['a x2', 'b']: the ranks on each host."""
    seen = {h: hosts.count(h) for h in hosts}
    return [h if k == 1 else f"{h} x{k}" for h, k in seen.items()]


def story(state: JobState, command: str | None = None) -> dict:
    invocation = state.invocation() or {}
    command = command or invocation.get("command")
    unit = "step" if command == "tune" else "row" if command in ("run", "eval", "distill") else "step"
    history = state.history()
    progress = state.progress()
    writers: list[str] = []
    for r in history:
        if r.get("writer") not in writers:
            writers.append(r.get("writer"))
    lines, processes = [], []
    for n, w in enumerate(writers):
        recs = [r for r in history if r.get("writer") == w]
        first = recs[0]
        proc = {"writer": w, "host": first.get("host"), "pid": first.get("pid"), "engine": first.get("engine"),
                "started": first["time"], "resumed_from": None, "checkpoints": [], "end": None, "hard_killed": False,
                "world": first.get("world", 1), "hosts": first.get("hosts") or [first.get("host")]}
        # A data-parallel group is one process here: its rank 0 wrote for all its ranks.
        group = f", rank 0 of {proc['world']} on {', '.join(_counted(proc['hosts']))}" if proc["world"] > 1 else ""
        lines.append(f"process {n + 1}: {first.get('host')} pid {first.get('pid')}, engine {first.get('engine')}{group}, "
                     f"started {_when(first['time'])}")
        done = 0  # steps or rows committed so far, as this process saw it
        for r in recs:
            what = r["what"]
            if what == "plan":
                proc["plan"] = {k: r.get(k) for k in ("micro_batch", "grad_accum", "grad_checkpoint", "estimated_peak_gb",
                                                      "available_gb", "available_from")}
                lines.append(f"  sized for {r.get('available_gb')} GB ({r.get('available_from')}): micro-batch "
                             f"{r.get('micro_batch')} x {r.get('grad_accum')}, checkpointing {'on' if r.get('grad_checkpoint') else 'off'}, "
                             f"about {r.get('estimated_peak_gb')} GB at the peak")
            elif what == "engine":
                proc.update(device=r.get("device"), software=r.get("software"), dtype=r.get("dtype"))
                lines.append(f"  on {r.get('device')}, {r.get('software')}, {r.get('dtype')} base")
            elif what == "resume":
                done = r.get("step") or 0
                proc["resumed_from"] = {"uri": r.get("uri"), unit: done}
                lines.append(f"  resumed from {r.get('uri')} at {unit} {done}")
            elif what == "checkpoint":
                done = r["step"] if "step" in r else done + (r.get("rows") or 0)
                proc["checkpoints"].append({unit: done, "seconds": r.get("seconds"), "uri": r.get("uri")})
                lines.append(f"  checkpoint at {unit} {done} in {r.get('seconds')}s")
            elif what == "interrupted":
                proc["end"] = {"what": "interrupted", "signal": r.get("signal"), unit: r.get("step")}
                lines.append(f"  interrupted by {r.get('signal')} at {unit} {r.get('step')}"
                             + (" (the step in flight was abandoned)" if r.get("abandoned_quantum") else ""))
            elif what == "failed":  # exited 1 with its error line: not a hard kill
                proc["end"] = {"what": "failed", unit: r.get("step"), "error": r.get("error")}
                lines.append(f"  failed at {unit} {r.get('step') if r.get('step') is not None else done}: {r.get('error')}")
            elif what in ("done", "stopped"):
                proc["end"] = {"what": what, unit: r.get("step")}
                lines.append(f"  {'finished' if what == 'done' else 'stopped by --stop-after'} at {unit} {r.get('step')}")
        if proc["end"] is None:
            later = n + 1 < len(writers)
            reached = (progress.get(w) or {}).get("done")
            if later:
                proc["hard_killed"] = True
                proc["repeated"] = max(0, (reached or done) - done)
                lines.append(f"  HARD KILL: no interruption record (SIGKILL, out of memory or a lost machine); "
                             f"last commit at {unit} {done}, reached about {unit} {reached if reached is not None else done}: "
                             f"{proc['repeated']} {unit}s repeated by the next process")
            else:
                lines.append(f"  no end record yet: running, or killed after {unit} {reached if reached is not None else done}")
        processes.append(proc)
    resume = resume_promise(processes)
    if resume:
        lines.append(f"resume: {resume['promise']}: {resume['why']}")
    return {"uri": state.uri, "command": command, "name": (invocation.get("options") or {}).get("name"),
            "processes": processes, "resume": resume, "story": lines}


def resume_promise(processes: list[dict]) -> dict | None:
    """Which of docs/state.md's promises a job that ran in several processes gets: bit-identical
    when every process had the same engine, device model, software and base dtype; within the
    stated tolerance otherwise (other kernels round differently)."""
    ran = [p for p in processes if p.get("device")]
    if len(processes) < 2 or not ran:
        return None
    key = lambda p: (p.get("engine"), p.get("device"), p.get("software"), p.get("dtype"))  # noqa: E731
    first = ran[0]
    other = next((p for p in ran[1:] if key(p) != key(first)), None)
    if other is None:
        return {"promise": "bit-identical", "why": f"every process ran {first.get('engine')} on {first.get('device')} "
                                                   f"with {first.get('software')} ({first.get('dtype')} base)"}
    differs = [name for name, a, b in zip(("engine", "device", "software", "base dtype"), key(first), key(other)) if a != b]
    return {"promise": "within tolerance",
            "why": f"the {' and '.join(differs)} changed between processes ({first.get('engine')} on {first.get('device')}, "
                   f"{first.get('software')}; then {other.get('engine')} on {other.get('device')}, {other.get('software')})"}


def _told(store) -> dict:
    state = JobState(store, {})
    told = story(state)
    sharded = shard_status.tell(state, story)  # a row job split with --shards: each shard and the merge
    if sharded:
        # The job's own history holds only merges: the shards' stories tell its processes.
        told = {**told, "shards": sharded["shards"], "merge": sharded["merge"], "story": sharded["story"]}
    return told


def main(ns: dict, events) -> int:
    store = open_store(ns["uri"])
    if store.read("job.json") is None:
        raise SpillpackError(f"{ns['uri']} holds no job state (no job.json)", "spillpack status <the job's --state URI>")
    told = [_told(store)]
    for key in sorted({k.split("/")[1] for k in store.list("stages/") if k.count("/") >= 2}):
        sub = open_store(store.child_uri(f"stages/{key}"))
        if sub.read("job.json") is not None:
            told.append({**_told(sub), "stage": key})
    if events.headless:
        events.emit("status", **told[0], stages=told[1:])
        return 0
    for t in told:
        head = f"stage {t['stage']}: " if t.get("stage") else ""
        print(f"{head}{t['command'] or 'job'} {t['name'] or ''} at {t['uri']}")
        for line in t["story"]:
            print(("  " if head else "") + line)
    return 0
