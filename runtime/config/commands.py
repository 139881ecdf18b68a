"""The registry of job commands: options, derived defaults, cross-option rules, and the module
that runs each. Resolving a config needs this table only, never the job's own module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

from runtime.config import options as O
from runtime.base.errors import SpillpackError

BUILD_STAGES = ("distill", "tune", "eval")
DEFAULT_RANK = 16
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"


@dataclass(frozen=True)
class JobCommand:
    name: str
    help: str
    options: tuple[O.Opt, ...]
    module: str  # runtime.jobs.<name>: its main(inv, events) -> Outcome
    main_input: str  # the argument a default job name is derived from
    derive: Callable[[dict], None] = lambda values: None  # fills derived defaults in place
    check: Callable[[dict], None] = lambda values: None  # rules across options
    example: str = ""  # the last line of its --help: docs/commands.md's example, run as written on tiny

    def option(self, name: str) -> O.Opt:
        return next(o for o in self.options if o.name == name)


def _derive_tune(v: dict) -> None:
    if not v.get("init_adapter"):  # an --init-adapter brings its own rank, alpha and targets (runtime/jobs/init_adapter.py)
        if v.get("rank") is None:
            v["rank"] = DEFAULT_RANK
        if v.get("alpha") is None:
            v["alpha"] = 2.0 * v["rank"]
        if v.get("targets") is None:
            v["targets"] = DEFAULT_TARGETS
    if (v.get("val") or v.get("val_fraction")) and v.get("eval_every") is None:
        v["eval_every"] = v["ckpt_every"]
    if v.get("steps") is None and v.get("epochs") is None:
        v["epochs"] = 1.0


def _check_targets(command: str):
    def check(v: dict) -> None:
        if v.get("targets") is None and v.get("init_adapter"):
            return  # the adapter's
        if not [t for t in str(v["targets"]).split(",") if t.strip()]:
            raise SpillpackError(f"--targets {v['targets']!r} names no layer", f"spillpack {command} ... --targets q_proj,v_proj")
    return check


def _check_counted_stop(command: str, unit: str):
    def check(v: dict) -> None:
        if v.get("stop_after") is not None and not isinstance(v["stop_after"], int):
            raise SpillpackError(f"--stop-after takes a {unit} count for {command}, not {v['stop_after']!r}",
                                 f"spillpack {command} ... --stop-after 10")
    return check


def _check_tune(v: dict) -> None:
    _check_targets("tune")(v)
    _check_counted_stop("tune", "step")(v)
    if v.get("val") and v.get("val_fraction"):
        raise SpillpackError("--val and --val-fraction both name held-out rows; give one",
                             "spillpack tune MODEL DATA --val VAL.jsonl (or --val-fraction 0.1)")
    for name in ("eval_every", "early_stop"):
        if v.get(name) is not None and not (v.get("val") or v.get("val_fraction")):
            raise SpillpackError(f"--{name.replace('_', '-')} needs held-out rows", f"spillpack tune MODEL DATA --val-fraction 0.1 --{name.replace('_', '-')} {v[name]}")


def _check_build(v: dict) -> None:
    _check_targets("build")(v)
    if v.get("early_stop") is not None and not v.get("val_fraction"):
        raise SpillpackError("--early-stop needs held-out rows", f"spillpack build FOLDER --val-fraction 0.1 --early-stop {v['early_stop']}")
    stop_point(v.get("stop_after"))
    _check_shard("build", v)


def _check_shard(command: str, v: dict) -> None:
    if v.get("shard") is not None and v["shard"] >= v["shards"]:
        raise SpillpackError(f"--shard {v['shard']} is out of range: this job has {v['shards']} shard"
                             f"{'s' if v['shards'] != 1 else ''}, numbered 0 to {v['shards'] - 1}",
                             f"spillpack {command} ... --shards {v['shards']} --shard {v['shards'] - 1}")


def stop_point(value) -> tuple[str | None, int | None]:
    """A build's --stop-after: STAGE or STAGE:N."""
    if value is None:
        return None, None
    stage, _, n = str(value).partition(":")
    if stage not in BUILD_STAGES or (n and not n.isdigit()):
        raise SpillpackError(f"--stop-after for build takes STAGE or STAGE:N with STAGE one of {', '.join(BUILD_STAGES)}, not {value!r}",
                             "spillpack build FOLDER --stop-after tune:10")
    return stage, int(n) if n else None


def _check_rows(command: str):
    counted = _check_counted_stop(command, "row")

    def check(v: dict) -> None:
        counted(v)
        _check_shard(command, v)
    return check


def _rows(name: str, help_: str, options, main_input: str, example: str) -> JobCommand:
    return JobCommand(name, help_, options, f"runtime.jobs.{name}", main_input, check=_check_rows(name), example=example)


COMMANDS = {
    "tune": JobCommand("tune", "LoRA fine-tune a model on chat data; survives preemption", O.TUNE, "runtime.jobs.tune", "data",
                       _derive_tune, _check_tune,
                       example="spillpack tune tiny examples/data/train.jsonl --name mine --state mine --steps 20"),
    "run": _rows("run", "batch inference over OpenAI batch JSONL; every row done once", O.RUN, "input",
                 "spillpack run tiny examples/data/prompts.jsonl --name answers --adapter mine/adapter --out answers.jsonl"),
    "eval": _rows("eval", "score a model on rows with expected answers", O.EVAL, "evals",
                  "spillpack eval tiny examples/data/evals.jsonl --name scored --adapter mine/adapter"),
    "distill": _rows("distill", "a teacher answers prompts; the output is training data for tune", O.DISTILL, "prompts",
                     "spillpack distill tiny examples/data/prompts.jsonl --name distilled --adapter mine/adapter --out distilled.jsonl"),
    "build": JobCommand("build", "a folder: eval, distill, tune, eval, with a table of scores", O.BUILD, "runtime.jobs.build",
                        "folder", check=_check_build, example="spillpack build examples/data --student tiny --steps 20 --name built"),
}


def options_for(command: str) -> tuple[O.Opt, ...]:
    return COMMANDS[command].options + O.SHARED


def default_name(command: str, main_input) -> str:
    """`tune-train` for train.jsonl, `build-data` for a folder; made safe whatever the file is called."""
    last = str(main_input).rstrip("/").rsplit("/", 1)[-1]
    return O.safe_name(f"{command}-{PurePosixPath(last).stem or 'job'}")
