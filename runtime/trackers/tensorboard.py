"""TensorBoard through tensorboardX's SummaryWriter: event files in one log dir for the whole job.

Every process of the job writes into the same log dir (recorded in the state). A process that
continues the job opens its writer with `purge_step` at the step after the one it restored,
so TensorBoard drops what an earlier process logged past the last checkpoint (a hard kill's
steps, done again now) and each step is shown once. The seams are text entries ("seams/...")
at the step where they happened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.trackers import local_root, writable_dir

DIR_ENV = "SPILLPACK_TENSORBOARD_DIR"


def log_dir(state_uri: str, job_name: str) -> Path:
    return Path(os.environ.get(DIR_ENV) or local_root(state_uri, job_name) / "tensorboard")


def check(state_uri: str, job_name: str, command: str) -> None:
    writable_dir(str(log_dir(state_uri, job_name)), "tensorboard", DIR_ENV, command)


def open(context: dict) -> "TensorBoard":
    state = context["state"]
    record = state.tracker_run("tensorboard")
    fresh = record is None
    if fresh:
        record = state.claim_tracker_run("tensorboard", {"logdir": str(log_dir(context["state_uri"], context["job"]))})
    # A build's stages each count their steps from 1, and a row job's shards their rows, into one log dir, so no
    # one step purges what a process redoes: they log committed steps only.
    several = context["command"] == "build" or context.get("shard") is not None
    purge = None if fresh or several else context["start_step"] + 1
    return TensorBoard(os.environ.get(DIR_ENV) or record["logdir"], purge, committed_only=several, fresh=fresh)


class TensorBoard:
    name = "tensorboard"

    def __init__(self, logdir: str, purge_step: int | None, committed_only: bool, fresh: bool):
        from tensorboardX import SummaryWriter

        self.committed_only = committed_only
        self.fresh = fresh
        self.writer = SummaryWriter(logdir=logdir, purge_step=purge_step, flush_secs=5)

    def params(self, params: dict) -> None:
        if self.fresh:
            self.writer.add_text("config", "```\n" + json.dumps(params, indent=2, sort_keys=True, default=str) + "\n```", 0)

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # on disk now: a hard kill loses nothing it was given (this runs on the reporter's thread)

    def note(self, kind: str, text: str, step: int | None) -> None:
        self.writer.add_text(f"seams/{kind}", text, step or 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
