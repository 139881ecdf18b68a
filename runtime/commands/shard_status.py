"""The part of `spillpack status` that tells a sharded row job: each shard's progress (rows
committed of its rows, its processes, interruptions and hard kills, told by the same story as
any job: runtime/commands/story.py) and the merge (done, by which shard, in how long; or what
it waits for). Annotations like the story's: a `shard` line per shard followed by that shard's
own story (each line carrying `shard`), then one `merge` line."""

from __future__ import annotations

from runtime.commands.story import annotations as story
from runtime.jobs.shards import RESULTS
from runtime.state.jobstate import JobState


def annotations(root: JobState) -> list[dict] | None:
    """The annotations of a sharded job's state, else None."""
    identity = root.claimed() or {}
    n = identity.get("shards")
    if not n or identity.get("command") not in ("run", "eval", "distill"):  # a sharded build's shards are its stages'
        return None
    shards, out = [], []
    for i in range(n):
        state = root.shards.shard(i)
        own = state.claimed()
        if own is None:
            shards.append({"shard": i, "rows_done": 0, "rows": None, "done": False, "started": False})
            out.append({"kind": "shard", "time": None, **shards[-1], "text": f"shard {i}: not started"})
            continue
        lo, hi = own.get("rows") or (0, 0)
        done_rows = sum(c.step for c in state.rows.all())
        told = story(state, identity.get("command"))
        finished = state.shards.done() is not None
        processes = sum(1 for a in told if a["kind"] == "process")
        interruptions = sum(1 for a in told if a["kind"] == "interrupted")
        hard = sum(1 for a in told if a["kind"] == "hard_kill")
        shards.append({"shard": i, "rows": hi - lo, "first_row": lo, "rows_done": min(done_rows, hi - lo), "done": finished,
                       "started": True, "processes": processes, "interruptions": interruptions, "hard_kills": hard})
        out.append({"kind": "shard", "time": told[0]["time"] if told else None, **shards[-1],
                    "text": f"shard {i}: rows {lo}-{hi - 1}, {min(done_rows, hi - lo)}/{hi - lo} committed"
                            f"{', done' if finished else ''}; {processes} process{'es' if processes != 1 else ''}, "
                            f"{interruptions} interruption{'s' if interruptions != 1 else ''}, {hard} hard kill{'s' if hard != 1 else ''}"})
        out += [{**a, "shard": i, "text": "  " + a["text"]} for a in told]
    record = root.shards.merge_record()
    waiting = [s["shard"] for s in shards if not s["done"]]
    if record is not None:
        merge = {"merged": True, "by_shard": record.get("shard"), "host": record.get("host"), "seconds": record.get("seconds"),
                 "rows": record.get("rows"), "uri": root.store.child_uri(RESULTS), "completed_cut_short": record.get("completed_cut_short")}
        by = f"shard {record['shard']}" if record.get("shard") is not None else "a process without a shard (resume)"
        line = (f"merged: {record.get('rows')} rows by {by} on {record.get('host')} in {record.get('seconds')}s"
                f"{' (completing a merge a kill cut short)' if record.get('completed_cut_short') else ''} "
                f"-> {root.store.child_uri(RESULTS)}")
    elif root.shards.merge_claim() is not None:
        claim = root.shards.merge_claim()
        merge = {"merged": False, "cut_short": True, "claimed_by_shard": claim.get("shard"), "host": claim.get("host")}
        line = (f"merge claimed by shard {claim.get('shard')} on {claim.get('host')} but not recorded: in progress, or cut "
                f"short by a kill; a rerun of any shard, or spillpack resume {root.uri}, to complete it")
    else:
        merge = {"merged": False, "waiting_for": waiting}
        line = (f"not merged yet: waiting for shard{'s' if len(waiting) != 1 else ''} {', '.join(map(str, waiting))}"
                if waiting else f"not merged yet: every shard is done; spillpack resume {root.uri} merges")
    out.append({"kind": "merge", "time": None, **merge, "text": line})
    return out
