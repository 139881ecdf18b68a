"""The part of `spillpack status` that tells a sharded row job: each shard's progress (rows
committed of its rows, its processes, interruptions and hard kills, told by the same story as
any job) and the merge (done, by which shard, in how long; or what it waits for)."""

from __future__ import annotations

from typing import Callable

from runtime.jobs.shards import RESULTS
from runtime.state.jobstate import JobState


def tell(root: JobState, story: Callable[..., dict]) -> dict | None:
    """{"shards": [...], "merge": {...}, "story": [lines]} for a sharded job's state, else None."""
    identity = root.claimed() or {}
    n = identity.get("shards")
    if not n or identity.get("command") not in ("run", "eval", "distill"):  # a sharded build's shards are its stages'
        return None
    shards, lines = [], []
    for i in range(n):
        state = root.shard(i)
        own = state.claimed()
        if own is None:
            shards.append({"shard": i, "rows_done": 0, "rows": None, "done": False, "started": False, "processes": []})
            lines.append(f"shard {i}: not started")
            continue
        lo, hi = own.get("rows") or (0, 0)
        done_rows = sum(c.step for c in state.segments())
        told = story(state, identity.get("command"))
        finished = state.shard_done() is not None
        interruptions = sum(1 for p in told["processes"] if (p.get("end") or {}).get("what") == "interrupted")
        hard = sum(1 for p in told["processes"] if p.get("hard_killed"))
        shards.append({"shard": i, "rows": hi - lo, "first_row": lo, "rows_done": min(done_rows, hi - lo), "done": finished,
                       "started": True, "processes": told["processes"], "interruptions": interruptions, "hard_kills": hard})
        lines.append(f"shard {i}: rows {lo}-{hi - 1}, {min(done_rows, hi - lo)}/{hi - lo} committed"
                     f"{', done' if finished else ''}; {len(told['processes'])} process{'es' if len(told['processes']) != 1 else ''}, "
                     f"{interruptions} interruption{'s' if interruptions != 1 else ''}, {hard} hard kill{'s' if hard != 1 else ''}")
        lines += ["  " + line for line in told["story"]]
    record = root.merge_record()
    waiting = [s["shard"] for s in shards if not s["done"]]
    if record is not None:
        merge = {"merged": True, "by_shard": record.get("shard"), "host": record.get("host"), "seconds": record.get("seconds"),
                 "rows": record.get("rows"), "uri": root.store.child_uri(RESULTS), "completed_cut_short": record.get("completed_cut_short")}
        by = f"shard {record['shard']}" if record.get("shard") is not None else "a process without a shard (resume)"
        lines.append(f"merged: {record.get('rows')} rows by {by} on {record.get('host')} in {record.get('seconds')}s"
                     f"{' (completing a merge a kill cut short)' if record.get('completed_cut_short') else ''} "
                     f"-> {root.store.child_uri(RESULTS)}")
    elif root.merge_claim() is not None:
        claim = root.merge_claim()
        merge = {"merged": False, "cut_short": True, "claimed_by_shard": claim.get("shard"), "host": claim.get("host")}
        lines.append(f"merge claimed by shard {claim.get('shard')} on {claim.get('host')} but not recorded: in progress, or cut "
                     f"short by a kill; a rerun of any shard, or "
                     f"spillpack resume {root.uri}, to complete it")
    else:
        merge = {"merged": False, "waiting_for": waiting}
        lines.append(f"not merged yet: waiting for shard{'s' if len(waiting) != 1 else ''} {', '.join(map(str, waiting))}"
                     if waiting else f"not merged yet: every shard is done; spillpack resume {root.uri} merges")
    return {"shards": shards, "merge": merge, "story": lines}
