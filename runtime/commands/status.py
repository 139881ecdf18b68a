"""`spillpack status URI`: the story of a job, told from its state's history
(runtime/commands/story.py); a build's stages are told after it, each from its own state.

On a terminal, one line per annotation; headless (`--headless`, or stdout not a terminal),
one `status` event per annotation, in the order things happened. The laptop's `spillpack`
adds `--plot` (spillpack/commands/status.py): a bundle carries no plotting library.
"""

from runtime.commands import shard_status
from runtime.commands.story import annotations, resume_promise  # noqa: F401 (resume_promise: part of this command's API)
from runtime.base.errors import SpillpackError
from runtime.state.jobstate import JobState
from runtime.state.uri import open_store


def add_arguments(parser) -> None:
    parser.add_argument("uri", metavar="URI", help="a job's state: a path, file:// or s3:// URI")


def states(uri: str) -> list[tuple[str | None, JobState]]:
    """(stage or None, state) for the job at `uri` and, for a build, each of its stages."""
    store = open_store(uri)
    if store.read("job.json") is None:
        raise SpillpackError(f"{uri} holds no job state (no job.json)", "spillpack status <the job's --state URI>")
    out = [(None, JobState(store, {}))]
    for key in sorted({k.split("/")[1] for k in store.list("stages/") if k.count("/") >= 2}):
        sub = open_store(store.child_uri(f"stages/{key}"))
        if sub.read("job.json") is not None:
            out.append((key, JobState(sub, {})))
    return out


def main(ns: dict, events, told: list | None = None) -> int:
    """`told`: the states, when the caller has read them already (the laptop's --plot)."""
    told = states(ns["uri"]) if told is None else told
    for stage, state in told:
        invocation = state.invocation() or {}
        command, name = invocation.get("command"), (invocation.get("options") or {}).get("name")
        story = shard_status.annotations(state) or annotations(state)  # a row job split with --shards: each shard and the merge
        head = {"kind": "job", "time": next((a["time"] for a in story if a["time"] is not None), None), "uri": state.uri, "job_command": command, "name": name,
                "text": f"{'stage ' + stage + ': ' if stage else ''}{command or 'job'} {name or ''} at {state.uri}"}
        for a in [head, *story]:
            if events.headless:
                # `time` is when it happened; a line about now (a shard not started) keeps the emit time.
                events.emit("status", **({"stage": stage} if stage else {}), **{k: v for k, v in a.items() if k != "time" or v is not None})
            else:
                print(("  " if stage else "") + a["text"])
    return 0
