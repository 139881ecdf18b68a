"""`spillpack build FOLDER`: distill the teacher (when prompts.jsonl exists), tune the student on
train.jsonl plus the distilled data, then score the student before and after in one eval pass;
a table of scores.

The eval stage is one eval job with the tuned adapter named (`--adapter tuned=ADAPTER`): every
row is answered by the student and by the tuned student in one batch over one model load
(runtime/jobs/adapters.py), each scored on its own. Its score is {"base": ..., "tuned": ...}.

Each stage is the ordinary job (runtime/jobs/eval.py, distill.py, tune.py, called through their
`main`) with its own state under the build's state at stages/<stage>, so it resumes exactly as
it would alone. A finished stage leaves a "stage" marker with its score in the build's state;
a rerun skips marked stages and continues the interrupted one at its row or step.
--stop-after STAGE stops cleanly after that stage, STAGE:N after N rows or steps of it.

Sharded (--shards N, each worker a build process with its shard: --shard I or the scheduler's
index, runtime/jobs/shards.py): every worker runs the build. The eval and distill stages are
split, each worker doing its shard of them; a worker whose shard is done waits (polling the
state every WAIT_S; SIGTERM while waiting exits 75 and a rerun waits again) until the last shard
to finish has merged the stage, then takes the stage's score from the merge and goes on. tune is
not split: shard 0 runs it while the others wait for its marker, then every worker does its
shard of the eval. The stage marker is committed once, by whichever worker gets there first.
"""

import importlib
import time

from runtime.config.commands import BUILD_STAGES as STAGES
from runtime.config.commands import COMMANDS, stop_point
from runtime.config.invocation import resolve
from runtime.core.job import Job, Outcome
from runtime.data.jsonl import read_bytes
from runtime.base.errors import EXIT_OK, SpillpackError
from runtime.base.fileio import sha256_bytes
from runtime.jobs import adapters, estimate, shards
from runtime.jobs.rowjob import RESULTS
from runtime.models.ref import resolve_model
from runtime.state.jobstate import JobState, StateConflict
from runtime.state.store import local_file
from runtime.state.uri import open_store

STAGE_MARKER = "stage"
TUNE_DATA = "data/tune.jsonl"
FOLDER_FILES = ("evals.jsonl", "train.jsonl", "prompts.jsonl")  # all a build reads from FOLDER (and all `pack` copies)
SPLIT = ("distill", "eval")  # the stages a sharded build splits; tune runs in shard 0
TUNED = "tuned"  # the tuned adapter's name in the eval stage (its rows' `model`)
WAIT_S = 2.0


class StageEvents:
    """The build's event stream as a stage job sees it: its start and done become `stage`
    events (the build has one start and one done), everything else passes through tagged."""

    def __init__(self, parent, stage: str):
        self.parent, self.stage = parent, stage

    headless = property(lambda self: self.parent.headless)
    command = property(lambda self: self.parent.command, lambda self, v: None)
    engine = property(lambda self: self.parent.engine, lambda self, v: setattr(self.parent, "engine", v))

    def emit(self, event: str, **fields) -> dict:
        if event in ("start", "done"):
            return self.parent.emit("stage", stage=self.stage, status=event, **fields)
        return self.parent.emit(event, stage=self.stage, **fields)

    def say(self, text: str) -> None:
        self.parent.say(f"[{self.stage}] {text}")


def _folder_files(folder: str, bundle=None) -> dict[str, bytes]:
    base = str(folder).rstrip("/")
    path = local_file(base)
    if path is not None and not path.is_dir():
        raise SpillpackError(f"build folder {folder} does not exist or is not a directory", f"ls {folder}")
    files = {}
    for name in FOLDER_FILES:
        data = read_bytes(f"{base}/{name}", name, bundle, missing_ok=True)  # absent is fine; damaged is an error
        if data is not None:
            files[name] = data
        elif name == "evals.jsonl":
            raise SpillpackError(f"build folder {folder} has no evals.jsonl (rows with \"expected\" answers to score the student)",
                                 f"ls {folder}; see examples/data/evals.jsonl")
    if "train.jsonl" not in files and "prompts.jsonl" not in files:
        raise SpillpackError(f"build folder {folder} has neither train.jsonl nor prompts.jsonl: nothing to tune on",
                             f"add train.jsonl (chat rows) or prompts.jsonl (for the teacher) to {folder}")
    return files


def main(inv, events) -> Outcome:
    a, o = inv.arguments, inv.options
    stop_stage, stop_n = stop_point(o.get("stop_after"))
    folder = str(a["folder"]).rstrip("/")
    files = _folder_files(folder, inv.bundle)
    # Distilling the student into itself teaches it nothing: prompts.jsonl needs a teacher.
    has_teacher = bool(o.get("teacher") or o.get("teacher_adapter"))
    if "prompts.jsonl" in files and not has_teacher and "train.jsonl" not in files:
        raise SpillpackError(f"build folder {folder} has prompts.jsonl but no train.jsonl, and no teacher to answer the prompts",
                             "--teacher MODEL or --teacher-adapter URI")
    stages = [s for s in STAGES if s != "distill" or ("prompts.jsonl" in files and has_teacher)]
    if stop_stage is not None and stop_stage not in stages:
        raise SpillpackError(f"this build has no {stop_stage} stage (distill needs prompts.jsonl and a --teacher)", f"--stop-after {stages[-1]}")
    identity = {"command": "build", **{f"{k}_sha256": sha256_bytes(v) for k, v in sorted(files.items())},
                **{k: o[k] for k in ("student", "teacher", "teacher_adapter", "metric", "field", "max_tokens", "steps", "epochs",
                                     "rank", "lr", "warmup", "targets", "seed")}}
    split = shards.plan(o, "build")
    if split.count > 1:
        identity["shards"] = split.count
    if o.get("val_fraction"):  # only then: a build state written without validation keeps its identity
        identity.update(val_fraction=o["val_fraction"], early_stop=o.get("early_stop"))
    with Job.open(inv, identity, events) as job:
        return _run(job, inv, events, files, stages, stop_stage, stop_n, split)


def _run(job: Job, inv, events, files, stages, stop_stage, stop_n, split=shards.Plan(1, 0)) -> Outcome:
    a, o = inv.arguments, inv.options
    folder = str(a["folder"]).rstrip("/")
    store = job.state.store
    scores = {m.meta["stage"]: m.meta["score"] for m in job.state.markers(STAGE_MARKER) if m.meta["stage"] in stages}
    if scores:
        job.restored(len(scores), job.state.uri)
    events.emit("start", step=len(scores), job=o["name"], model=o["student"], placement=f"{job.engine_name}: {job.engine_reason}",
                state=job.state.uri, estimated_seconds=_estimate(files, stages, scores, o), stages=stages,
                message=f"build {folder}: {' -> '.join(stages)} for {o['student']}"
                        + (" (prompts.jsonl unused: no --teacher)" if "prompts.jsonl" in files and "distill" not in stages else "")
                        + (f" ({len(scores)} done before)" if scores else "") + f"; state at {job.state.uri}")
    common = {"engine": o["engine"], "dtype": o.get("dtype", "auto"), "batch": o["batch"], "max_tokens": o["max_tokens"], "seed": o["seed"]}
    # With a held-out split the tune keeps its best adapter by held-out loss: that one is scored.
    tuned = store.child_uri("stages/tune/adapter/best" if o.get("val_fraction") else "stages/tune/adapter")
    plans = {
        # Without --teacher the teacher is the student with --teacher-adapter.
        "distill": ("distill", {"teacher": o.get("teacher") or o["student"], "prompts": f"{folder}/prompts.jsonl",
                                "adapter": o.get("teacher_adapter"), **common}),
        "tune": ("tune", {"model": o["student"], "data": store.child_uri(TUNE_DATA), "weights": o.get("weights"),
                          "engine": o["engine"], "dtype": o.get("dtype", "auto"), "seed": o["seed"], "steps": o.get("steps"), "epochs": o["epochs"],
                          "rank": o["rank"], "lr": o["lr"], "warmup": o["warmup"], "targets": o["targets"],
                          "val_fraction": o.get("val_fraction"), "early_stop": o.get("early_stop")}),
        # The student and the tuned student in one pass: every row answered by both in one batch.
        "eval": ("eval", {"model": o["student"], "evals": f"{folder}/evals.jsonl", "weights": o.get("weights"),
                          "adapter": _named(TUNED, tuned), "metric": o["metric"], "field": o.get("field"), **common}),
    }
    for stage in stages:
        if stage in scores:
            continue
        if job.preemption.stop_requested:
            return job.preempted(len(scores), abandoned_quantum=False)
        sharded = split.count > 1
        if sharded and stage not in SPLIT and split.index != 0:
            # Shard 0 runs tune; the others wait for its marker.
            stopped = _wait(job, events, lambda: _marked(job.state, stage), f"{stage} (shard 0 runs it)", len(scores))
            if stopped is not None:
                return stopped
            scores[stage] = _marked(job.state, stage)
            continue
        if stage == "tune" and store.read(TUNE_DATA) is None:
            store.write(TUNE_DATA, _tune_data(files, store))
        command, given = plans[stage]
        given = {**given, "state": store.child_uri(f"stages/{stage}"), "name": f"{o['name']}-{stage}",
                 "stop_after": stop_n if stage == stop_stage else None, "grace_s": o.get("grace_s"),
                 "max_stalled_starts": o.get("max_stalled_starts"),
                 "report_to": "none"}  # the build's own --report-to logs its stages, in one run
        if sharded and stage in SPLIT:
            given.update(shards=split.count, shard=split.index)
        sub = resolve(command, given, headless=events.headless, debug=inv.debug, bundle=inv.bundle)
        run_stage = importlib.import_module(COMMANDS[command].module).main
        # The stage's job installs its own handler over the build's while it runs.
        outcome = run_stage(sub, StageEvents(events, stage))
        if sharded and stage in SPLIT and outcome.code == EXIT_OK and outcome.complete and not outcome.summary.get("merged"):
            # This shard is done, others are not: wait for the merge, then read the stage's summary from it.
            stage_state = JobState(open_store(given["state"]), {})
            stopped = _wait(job, events, lambda: stage_state.shards.merge_record() is not None, f"the other shards of {stage}",
                            len(scores))
            if stopped is not None:
                return stopped
            outcome = run_stage(sub, StageEvents(events, stage))
        if outcome.preempted:  # the stage emitted `preempted` and committed; the build only records it
            return job.preempted(len(scores), abandoned_quantum=False, emit=False)
        if outcome.code != EXIT_OK:
            return outcome
        if not outcome.complete:  # stopped early by STAGE:N
            return job.done(len(scores), False, stages=scores, stopped_in=stage)
        score = _score(stage, outcome.summary)
        _mark(job.state, stage, score, sharded)
        scores[stage] = score
        events.emit("stage", stage=stage, status="scored", score=score)
        if stage == stop_stage:
            return job.done(len(scores), False, stages=scores)
    events.say(table(scores))
    return job.done(len(scores), True, stages=scores)


def _named(name: str, uri: str) -> str:
    """`NAME=URI` as --adapter reads it; a state path that would read as more than one adapter is refused."""
    if adapters.parse(f"{name}={uri}") != [(name, uri)]:
        raise SpillpackError(f"the build's state {uri.rsplit('/stages/', 1)[0]} has a comma followed by NAME= in its path, which "
                             "--adapter would read as two adapters", "--state DIR with no ',NAME=' in its path")
    return f"{name}={uri}"


def _marked(state: JobState, stage: str) -> dict | None:
    return next((m.meta["score"] for m in state.markers(STAGE_MARKER) if m.meta["stage"] == stage), None)


def _mark(state: JobState, stage: str, score: dict, sharded: bool) -> None:
    """The stage's marker, once. In a sharded build several workers finish a stage: the first
    commits it, and one that loses the race for the commit finds the marker there."""
    while not sharded or _marked(state, stage) is None:
        try:
            state.commit_marker(STAGE_MARKER, {"stage": stage, "score": score})
            return
        except StateConflict:
            if not sharded:
                raise
            state.resync()


def _wait(job: Job, events, ready, what: str, step: int) -> Outcome | None:
    """Poll until `ready()`; a stop request meanwhile is a preemption (nothing to commit: a rerun waits again)."""
    said = False
    while not ready():
        if job.preemption.stop_requested:
            return job.preempted(step, abandoned_quantum=False)
        if not said:
            events.say(f"waiting for {what}")
            said = True
        time.sleep(WAIT_S)
    return None
def _estimate(files: dict, stages: list[str], scores: dict, o: dict) -> float:
    """The stages still to run, guessed from the student's shape and the folder's sizes (about
    4 bytes a token; every row generating its --max-tokens): a first guess, as for every job."""
    config = resolve_model(o["student"], o.get("weights")).config
    rows = {name: sum(1 for line in data.splitlines() if line.strip()) for name, data in files.items()}
    seconds = 0.0
    for stage in stages:
        if stage in scores:
            continue
        source, models = ("prompts.jsonl", 1) if stage == "distill" else ("evals.jsonl", 2)  # eval: the student and the tuned one
        if stage == "tune":
            epochs = o["epochs"] if o.get("steps") is None else o["steps"] * COMMANDS["tune"].option("batch").default / max(1, rows.get("train.jsonl", 1))
            seconds += _train_seconds(config, int(len(files.get("train.jsonl", b"")) / 4 * epochs))
        else:
            seconds += estimate.generation_seconds(config, models * len(files[source]) // 4, models * rows[source] * o["max_tokens"],
                                                   o["batch"])
    return round(seconds, 1)


def _train_seconds(config: dict, tokens: int) -> float:
    """`tokens` trained tokens at the row jobs' conservative CPU rate: the build has not measured
    its engine yet when it starts; its tune stage's own start event has the measured guess."""
    return estimate.training_seconds(config, tokens, estimate.cpu_flops())


def _tune_data(files: dict, store) -> bytes:
    """train.jsonl followed by the distilled examples: the data tune reads, fixed once written."""
    parts = []
    if "train.jsonl" in files:
        parts.append(files["train.jsonl"].rstrip(b"\n") + b"\n")
    distilled = store.read(f"stages/distill/{RESULTS}")
    if distilled:
        parts.append(distilled)
    data = b"".join(parts)
    if not data.strip():
        raise SpillpackError("nothing to tune on: train.jsonl is absent and the teacher's answers were all empty",
                             "add train.jsonl, or a teacher that answers the prompts (--teacher, --teacher-adapter)")
    return data


def _score(stage: str, summary: dict) -> dict:
    """A stage's score, from the summary its job reported."""
    if stage == "distill":
        return {"examples": summary["examples"]}
    if stage == "eval":  # the base's score first, then the tuned adapter's (eval.py's `scores`)
        base, tuned = ({k: s[k] for k in ("accuracy", "ci95", "rows")} for s in summary["scores"])
        return {"base": base, "tuned": tuned}
    score = {"steps": summary["steps"], "first_loss": round(summary["first_loss"], 6), "final_loss": round(summary["final_loss"], 6)}
    if summary.get("best_step") is not None:  # a held-out split: the adapter the eval stage scores
        score.update(best_step=summary["best_step"], best_val_loss=round(summary["best_val_loss"], 6),
                     stopped_early=bool(summary.get("stopped_early")))
    return score


def table(scores: dict) -> str:
    def accuracy(s):
        return f"accuracy {s['accuracy']:.3f}  95% [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]  ({s['rows']} rows)"

    def fmt(stage, s):
        if stage == "eval":
            return [("eval base", accuracy(s["base"])), ("eval tuned", accuracy(s["tuned"]))]
        if "examples" in s:
            return [(stage, f"{s['examples']} training examples")]
        return [(stage, f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} in {s['steps']} steps")]

    lines = [f"{'stage':<11} score"] + [f"{k:<11} {text}" for stage, s in scores.items() for k, text in fmt(stage, s)]
    if "eval" in scores:
        lines.append(f"{'before':<11} {scores['eval']['base']['accuracy']:.3f} -> after {scores['eval']['tuned']['accuracy']:.3f}")
    return "\n".join(lines)
