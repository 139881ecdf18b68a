"""A tune's checkpoint as files in its state: the tensors (LoRA, AdamW moments and, with a
validation set, the best adapter as best.<name>) and meta.json (step, identity, the validation
tracker); the losses live in the state's log. Read by the tune that continues it and by
`--init-adapter`, which may continue another state of the same job."""

from __future__ import annotations

import orjson
from safetensors.numpy import load as st_load

from runtime.base.errors import SpillpackError

CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_META = "meta.json"


def agrees(state, commit) -> bool:
    """A checkpoint's record says the step its files hold, and its log has a loss for each step
    before it: otherwise the record was edited (or written by something else) and is passed over.
    Files whose bytes do not match the record are still the one line that says so (read_file)."""
    meta = orjson.loads(state.read_file(commit, CHECKPOINT_META))
    return (isinstance(commit.step, int) and isinstance(meta, dict) and meta.get("step", commit.step) == commit.step
            and len(restored_losses(state, commit)) == commit.step)


def restored_losses(state, latest) -> list[float]:
    """The losses of steps 1..latest.step, from the state's log (or, in a state written before
    the log, from the checkpoint's meta.json)."""
    if not latest.log:
        return orjson.loads(state.read_file(latest, CHECKPOINT_META)).get("losses", [])
    records = [orjson.loads(line) for line in state.read_log(latest).splitlines() if line.strip()]
    return [r["loss"] for r in records if r["step"] <= latest.step]


def read(state, latest) -> dict:
    """Checkpoint `latest` of `state` as the tune restores it: step, losses, tensors, the
    validation tracker (or None) and the commit's URI."""
    return {"step": latest.step, "losses": restored_losses(state, latest), "uri": state.commit_uri(latest),
            "tensors": st_load(state.read_file(latest, CHECKPOINT_TENSORS)),
            "val": orjson.loads(state.read_file(latest, CHECKPOINT_META)).get("val")}


def upgrade_identity(old: dict, uri: str) -> dict:
    """States written before the effective batch became the identity named --batch and
    --grad-accum. With --grad-accum 1 their batch order is this version's, so they continue;
    with more it grouped examples by --batch, which this version does not reproduce."""
    if "effective_batch" in old or "batch" not in old:
        return old
    if old.get("grad_accum", 1) != 1:
        raise SpillpackError(f"state {uri} was written by an older spillpack with --grad-accum {old['grad_accum']}, "
                             f"whose batch order this version does not reproduce",
                             f"another --state to run the job again (or delete {uri} to start over)")
    new = {k: v for k, v in old.items() if k not in ("batch", "grad_accum")}
    new["effective_batch"] = old["batch"]
    return new
