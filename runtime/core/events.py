"""The event stream of docs/events.md, and what a person sees instead of it.

Headless, stdout carries one JSON object a line and nothing else. On a terminal the
same events become a start line, a live progress line and a summary on stderr.
SPILLPACK_STATUS=FILE keeps a small JSON status file current for any watcher.
"""

import os
import sys
import time
from pathlib import Path

import orjson

from runtime.base.fileio import atomic_write

COMMON_KEYS = ("event", "time", "command", "step", "loss", "tokens_per_s", "peak_mem_gb", "eta_s", "engine")


def headless_wanted(flag: bool, stream=None) -> bool:
    forced = os.environ.get("SPILLPACK_HEADLESS")
    if forced in ("0", "1"):
        return forced == "1"
    stream = stream or sys.stdout
    return flag or not stream.isatty()


class Events:
    def __init__(self, command: str, headless: bool, out=None, err=None, status_path: str | None = None, quiet: bool = False):
        self.command = command
        self.headless = headless
        self.quiet = quiet  # a data-parallel rank other than 0: rank 0 speaks for the group
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.engine: str | None = None
        self.status_path = status_path if status_path is not None else os.environ.get("SPILLPACK_STATUS")
        self._status: dict = {"command": command, "phase": "starting"}
        self._live = False  # a progress line is on the terminal and must be ended before other text
        self.sinks: list = []  # the trackers' reporter (runtime/trackers/reporter.py): fed every event

    def attach(self, sink) -> None:
        """Feed every event from now on to `sink` (its feed(record) must not block), and emit the
        warnings it has (its warnings() -> list of lines) as `warning` events."""
        self.sinks.append(sink)

    def detach(self, sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)

    def emit(self, event: str, **fields) -> dict:
        record = {k: None for k in COMMON_KEYS}
        record.update(event=event, time=round(time.time(), 3), command=self.command, engine=self.engine)
        record.update(fields)
        if self.quiet:
            return record
        if self.headless:
            self.out.write(orjson.dumps(record).decode() + "\n")
            self.out.flush()
        else:
            self._human(record)
        self._update_status(record)
        for sink in self.sinks:
            sink.feed(record)
            for message in sink.warnings():
                self.emit("warning", message=message)
        return record

    def say(self, text: str) -> None:
        """Human text: stderr always, so headless stdout stays pure JSON lines."""
        self._end_live()
        self.err.write(text + "\n")
        self.err.flush()

    # -- human rendering --------------------------------------------------

    def _end_live(self):
        if self._live:
            self.err.write("\n")
            self._live = False

    def _progress(self, text: str):
        if self.err.isatty():
            self.err.write("\r\033[K" + text)
            self._live = True
        else:
            self.err.write(text + "\n")
        self.err.flush()

    def _human(self, r: dict):
        ev = r["event"]
        if ev == "start":
            self.say(r.get("message") or f"{self.command}: starting")
        elif ev == "restore":
            made = ", ".join(f"{m['dtype']} on {m['engine']}" for m in r.get("made_with") or [] if m.get("dtype"))
            self.say(f"restored {r['step']} {'rows' if self.command != 'tune' else 'steps'} from {r['uri']}" + (f" (made in {made})" if made else ""))
        elif ev == "step":
            parts = [f"step {r['step']}/{r.get('steps')}"]
            if r["loss"] is not None:
                parts.append(f"loss {r['loss']:.4f}")
            if r["tokens_per_s"] is not None:
                parts.append(f"{r['tokens_per_s']:.0f} tok/s")
            if r["eta_s"] is not None:
                parts.append(f"eta {_duration(r['eta_s'])}")
            self._progress("  ".join(parts))
        elif ev == "row":
            self._progress(f"row {r['step']}/{r.get('total')}" + (f"  eta {_duration(r['eta_s'])}" if r["eta_s"] is not None else ""))
        elif ev == "checkpoint":
            if not self._live or not self.err.isatty():
                self.say(f"checkpoint at {r['step']} committed to {r['uri']} in {r['seconds']:.2f}s")
        elif ev == "preempted":
            if r["step"] is None:
                self.say(f"preempted by {r['signal']} while starting: nothing to save; run the same command again")
            else:
                self.say(f"preempted by {r['signal']}: checkpoint committed at {r['step']}; run the same command again to continue")
        elif ev == "stage":
            if r.get("status") == "start":
                self.say(f"[{r['stage']}] {r.get('message') or 'starting'}")
            elif r.get("status") == "scored":
                self.say(f"[{r['stage']}] done: {r.get('score')}")
        elif ev == "merged":
            self.say(f"merged the output of {r.get('shards')} shards ({r['step']} rows) into {r.get('out') or r.get('uri')} "
                     f"in {r['seconds']:.2f}s")
        elif ev == "done":
            self.say(_summary(r))
        elif ev == "warning":
            self.say(f"warning: {r.get('message')}")
        elif ev == "error":
            self._end_live()
        else:
            self.say(f"{ev}: {r}")

    # -- status file ----------------------------------------------------------

    def _update_status(self, r: dict):
        if not self.status_path:
            return
        s = self._status
        ev = r["event"]
        s["phase"] = {"start": "running", "restore": "running", "step": "running", "row": "running",
                      "checkpoint": "running", "merged": "running", "preempted": "preempted", "done": "done", "error": "error"}.get(ev, s["phase"])
        s["command"] = r["command"]  # a `resume` learns its job's command after the file was started
        s["engine"] = r["engine"]
        s["updated"] = r["time"]
        for key in ("step", "eta_s", "loss"):
            if r.get(key) is not None:
                s[key] = r[key]
        if r.get("total") is not None:
            s["total"] = r["total"]
        if ev == "start" and r.get("shards") is not None:  # a shard's process: which part of the job it does
            s["shard"], s["shards"] = r.get("shard"), r["shards"]
        if ev in ("row", "restore") and self.command in ("run", "eval", "distill"):
            s["rows_done"] = r["step"]
        if r.get("steps") is not None and ev in ("step", "start"):
            s["total"] = r["steps"]
        if ev == "checkpoint":
            s["last_checkpoint"] = {"uri": r.get("uri"), "step": r.get("step"), "time": r["time"]}
        if ev == "error":
            s["message"] = r.get("message")
        try:
            atomic_write(Path(self.status_path), orjson.dumps(s))
        except OSError:
            pass  # a watcher's convenience must never fail the job


_NOT_SUMMARY = set(COMMON_KEYS) | {"complete", "stopped_early", "seconds"}


def _summary(r: dict) -> str:
    how = "done" if r.get("complete") else "stopped early (run the same command to continue)"
    parts = []
    for key, value in r.items():
        if key in _NOT_SUMMARY or value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, (list, dict)):
            continue  # tables are printed by the job itself
        parts.append(f"{key.replace('_', ' ')} {value}")
    return f"{r['command']} {how} in {_duration(r.get('seconds') or 0)}: " + ", ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
