"""Weights & Biases, offline by default: each process writes a run folder (under the state by
default, or WANDB_DIR) that `wandb sync` uploads later; WANDB_MODE=online logs live.

The run id is decided by the first process and recorded in the state; every later process
opens the same id with resume="must", so the processes of one job are one run. W&B's steps
only go forward, so steps reach it once committed. The seams are lines of the run's notes and
summary keys ("seam/KIND"). WANDB_API_KEY is read by wandb from the environment, never stored.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from runtime.trackers import local_root, writable_dir


def run_dir(state_uri: str, job_name: str) -> Path:
    return Path(os.environ.get("WANDB_DIR") or local_root(state_uri, job_name))


def check(state_uri: str, job_name: str, command: str) -> None:
    writable_dir(str(run_dir(state_uri, job_name)), "wandb", "WANDB_DIR", command)


def open(context: dict) -> "WandB":
    import wandb

    state = context["state"]
    record = state.tracker_run("wandb")
    fresh = record is None
    if fresh:
        mine = {"id": uuid.uuid4().hex[:12], "project": os.environ.get("WANDB_PROJECT") or "spillpack"}
        record = state.claim_tracker_run("wandb", mine)
        fresh = record["id"] == mine["id"]
    mode = os.environ.get("WANDB_MODE") or "offline"
    run = wandb.init(id=record["id"], project=record["project"], name=context["job"], dir=str(run_dir(context["state_uri"], context["job"])),
                     mode=mode, resume="never" if fresh else "must", job_type=context["command"],
                     settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
    return WandB(run, fresh)


class WandB:
    name = "wandb"
    committed_only = True

    def __init__(self, run, fresh: bool):
        self.run, self.fresh = run, fresh
        self.exit_code = 1

    def params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def note(self, kind: str, text: str, step: int | None) -> None:
        self.run.notes = ((self.run.notes or "") + "\n" + text).strip()
        self.run.summary[f"seam/{kind}"] = text
        if kind in ("done", "interrupted"):
            self.exit_code = 0 if kind == "done" else 75

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)
