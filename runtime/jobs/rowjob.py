"""The one core of the row jobs (run, eval, distill): every row done once, across any preemption.

Rows are generated with continuous batching; finished rows are committed to the state in
segments (state.commit_segment: a torn segment is ignored) every --commit-rows rows or
--commit-seconds, and on preemption. A generation step is the abandonable quantum: a signal
during one either lets it finish (if it fits the 30 s promise) or throws it away; the rows
finished before it are committed either way. A resumed job reads the committed rows back and
generates only the rest. When every row is done, the task turns the rows' output lines (in
input order) into its output file, which is written under the state and to --out.

What differs between run, eval and distill is a `RowTask`: which arguments name the model
and the input, what a row must carry, what goes into the job's identity, and the output.
"""

import time
from dataclasses import dataclass
from typing import Callable

import orjson

from runtime.config.invocation import Invocation
from runtime.data.jsonl import read_bytes
from runtime.base.errors import SpillpackError, UsageError
from runtime.core.job import Job, Outcome, read_state
from runtime.base.signals import Abandon
from runtime.base.fileio import sha256_bytes
from runtime.engines.generation import Request
from runtime.engines.registry import base_dtype, dtype_fields
from runtime.models.quantize import refuse_gguf
from runtime.jobs import adapters as adapters_of, estimate, shards
from runtime.engines.hardware import choose_engine
from runtime.jobs.sizing import check_streaming_floor, plan_rows
from runtime.models.ref import resolve_model
from runtime.data.rows import Row, encode_rows, error_line, ok_line, parse_rows, system_fingerprint
from runtime.state.uri import check_output, uri_exists, write_uri
from runtime.models.tokenizer import Tokenizer
from runtime.base.threads import start_fields
from runtime.base.allotment import cpus

RESULTS = shards.RESULTS  # the final output, under the state
OUTPUT_MARKER = "output"  # commit kind recorded once the final output is written


@dataclass
class Output:
    data: bytes  # the output file
    summary: dict  # goes into the done event (with out, rows)
    extra: dict  # name -> bytes, written under the state next to results.jsonl
    message: str | None = None  # printed for a person when the job completes


@dataclass
class RowTask:
    command: str
    model_arg: str
    input_arg: str
    finish: Callable[[list[Row], list[dict]], Output]
    check: Callable[[list[Row], str], None] = lambda rows, uri: None
    identity: dict = None
    every_model: bool = False  # with named adapters, every row once for the base and once per adapter (eval)


def check_out_free(o: dict) -> None:
    """An --out that exists is refused (exit 2) before the state is touched, so the refused
    command leaves nothing behind; unless this state's own run wrote it: a finished job
    delivers its output again, and a merge that began may have written it already."""
    out = o["out"]
    if not uri_exists(out):
        return
    state = read_state(o)
    if state.markers(OUTPUT_MARKER) or state.shards.merge_claim() is not None:
        return
    raise UsageError(f"{out} already exists and would be overwritten", f"another --out, or remove {out}")


def run_rows(inv: Invocation, events, task: RowTask) -> Outcome:
    a, o = inv.arguments, inv.options
    model_ref, input_uri = a[task.model_arg], a[task.input_arg]
    model_dir = resolve_model(model_ref, o.get("weights"))
    tokenizer = Tokenizer.from_dir(model_dir.path)
    raw = read_bytes(input_uri, "input", inv.bundle)
    rows = parse_rows(raw, input_uri, o["max_tokens"], o["temperature"], o["top_p"], o["seed"])
    task.check(rows, input_uri)
    if o.get("out"):
        check_output(o["out"], directory=False)
        check_out_free(o)
    base_names = {model_ref, model_dir.path.name, "base"}
    adapters = adapters_of.load(o.get("adapter"), model_dir, base_names, inv.bundle)
    rows = adapters_of.route(rows, adapters, model_ref, base_names, task.every_model)
    encode_rows(rows, tokenizer, int(model_dir.config.get("max_position_embeddings") or 2048))
    bad = [r for r in rows if r.error]
    if len(bad) == len(rows):
        raise SpillpackError(f"every row of {input_uri} failed; line {bad[0].line}: {bad[0].error}", f"sed -n {bad[0].line}p {input_uri}")

    if o.get("quantize") and model_dir.is_gguf:  # before anything is written to the state
        refuse_gguf(o["quantize"], a[task.model_arg])
    identity = {
        "command": task.command,
        "model": model_dir.fingerprint(),
        **adapters_of.identity(adapters),
        "input_sha256": sha256_bytes(raw),
        **{k: o[k] for k in ("max_tokens", "temperature", "top_p", "seed")},
        **(task.identity or {}),
        **({"quantize": o["quantize"]} if o.get("quantize") else {}),  # only then: request ids of a float job unchanged
    }
    # Request ids hash the job without its shard count: a sharded run's file equals an unsharded one's.
    job_key = sha256_bytes(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS))
    split = shards.plan(o, task.command)
    if split.count > 1:
        identity["shards"] = split.count
    shard = shards.shard_identity(identity, split, len(rows)) if split.count > 1 and split.index is not None else None
    # Sized before the state is opened: a memory too small even to stream the weights leaves nothing behind.
    check_streaming_floor(task.command, choose_engine(o.get("engine"))[0], model_dir, rows, o["batch"], o.get("max_mem_gb"))
    with Job.open(inv, identity, events, shard=shard) as job:
        if split.count > 1:
            return _run_shard(job, inv, events, task, rows, split, (tokenizer, model_dir, adapters, job_key))
        return _run(job, inv, events, task, rows, (tokenizer, model_dir, adapters, job_key))


def layer_types(model_dir) -> dict | None:
    """A quantized GGUF's types of its layers (the head aside): the engine's dtype may keep them
    in their blocks (runtime.engines.torch.decode_dtype.choice). None for any other model."""
    if not model_dir.is_gguf:
        return None
    from runtime.models.gguf.model import quantized_types

    return quantized_types(model_dir.path, dense_head=True) or None


def one_dtype(job: Job, inv, rows: int) -> None:
    """One output, one dtype: a --dtype (or SPILLPACK_DTYPE) other than the one the state's rows
    were made in is refused before anything runs, unless --force; `auto` keeps the state's own."""
    made = sorted({m["dtype"] for m in job.made_with if m.get("dtype")})
    asked, why = base_dtype(inv.options.get("dtype"), None)
    if inv.force or not made or asked is None or asked in made:
        return
    raise SpillpackError(f"{job.state.uri} holds {rows} rows made in {' and '.join(made)}; {why.split(': ', 1)[1]} would put "
                         f"{asked} answers beside them in one output",
                         f"a new --state for the {asked} answers, or --force to mix them, or --dtype auto to keep {made[-1]}")


def _generate(job: Job, inv, events, task, rows, model, label: str = "") -> tuple["RowsWork", Outcome | None]:
    """Generate every row of `rows` not committed yet: the work, and the Outcome if it stopped."""
    a, o = inv.arguments, inv.options
    tokenizer, model_dir, adapters, job_key = model
    state = job.state
    total = len(rows)
    work = RowsWork(job, task, rows, a[task.model_arg], job_key, o, adapters)
    if work.lines:
        one_dtype(job, inv, len(work.lines))
        job.restored(len(work.lines), state.uri)
    gen_tokens = sum(r.max_tokens for r in work.todo)
    est = estimate.generation_seconds(model_dir.config, sum(len(r.prompt_ids) for r in work.todo), gen_tokens, o["batch"])
    extra = {"shard": job.state.identity.get("shard"), "shards": job.state.identity.get("shards")} if job.root else {}
    generating = work.todo and (o.get("stop_after") is None or work.done < o["stop_after"])
    # The engine first, as a tune's: its dtype and what the process holds with torch imported
    # size the memory plan. Importing torch is never abandoned midway, a stop waits for it.
    engine = (job.open_engine(dtype=o.get("dtype"), width=model_dir.config.get("hidden_size"), shape=model_dir.config,
                              quantize=o.get("quantize"), max_mem_gb=o.get("max_mem_gb"), layer_types=layer_types(model_dir))
              if generating else None)
    adapter, per_row = adapters_of.for_engine(adapters, work.todo) if generating else (None, False)
    plan = plan_rows(job.engine_name, engine, model_dir, work.todo, o["batch"], adapter) if generating else None
    kept = getattr(engine, "quantized_why", lambda _: (False, None))(model_dir)[1] if generating else None
    if plan is not None and plan.weights == "streamed":
        kept = plan.weights_why  # the blocks are the map's: the quantized choice does not apply
    events.emit("start", step=len(work.lines), job=o["name"], model=a[task.model_arg],
                placement=f"{job.engine_name}: {job.engine_reason}", state=state.uri, estimated_seconds=est, total=total, **extra,
                estimated_peak_gb=plan and round(plan.peak_gb, 3), memory_plan=plan and plan.to_dict(),
                **start_fields(job.engine_name, cpus().count), **dtype_fields(engine), **({"weights_why": kept} if kept else {}),
                message=f"{task.command} {a[task.model_arg]} on {a[task.input_arg]}{label}: {len(work.todo)} of {total} rows to generate "
                        f"({len(work.lines)} done or failed, up to {gen_tokens} new tokens) in batches of {o['batch']} "
                        f"on {job.engine_name}{'; ' + plan.describe() if plan else ''}; state at {state.uri}")
    if generating:
        try:
            with job.preemption.setup():  # loading the model: a stop abandons it, nothing to save yet
                work.start(engine, model_dir, tokenizer, adapter, per_row)
        except Abandon:
            work.commit()  # rows restored or failed at parse time
            return work, job.preempted(work.done, abandoned_quantum=True)
        stopped = job.run(work, o.get("stop_after"))
        if stopped is not None:
            return work, stopped
    work.commit()
    return work, None


def _run(job: Job, inv, events, task, rows, model) -> Outcome:
    o = inv.options
    state, store = job.state, job.state.store
    total = len(rows)

    finished = state.markers(OUTPUT_MARKER)
    if finished and store.read(RESULTS) is not None:
        # Done before: deliver the output again (to a new --out) and report it.
        one_dtype(job, inv, total)
        job.restored(total, store.child_uri(RESULTS))
        out = o.get("out")
        if out and not uri_exists(out):
            write_uri(out, store.read(RESULTS))
        return job.done(total, True, out=out or store.child_uri(RESULTS), rows=total, **finished[-1].meta.get("summary", {}))

    work, stopped = _generate(job, inv, events, task, rows, model)
    if stopped is not None:
        return stopped
    lines = work.lines
    if len(lines) < total:
        return job.done(len(lines), False, out=None, rows=len(lines), failed_rows=sum(1 for x in lines.values() if x.get("error")))
    output = task.finish(rows, [lines[r.custom_id] for r in rows])
    store.write(RESULTS, output.data)
    for name, data in output.extra.items():
        store.write(name, data)
    state.commit_marker(OUTPUT_MARKER, {"summary": output.summary})
    out = o.get("out")
    if out:
        write_uri(out, output.data)
    if output.message:
        events.say(output.message)
    return job.done(total, True, out=out or store.child_uri(RESULTS), rows=total, **output.summary)


def _run_shard(job: Job, inv, events, task, rows, split: "shards.Plan", model) -> Outcome:
    """One shard's rows, then the merge if this process finds every shard done (runtime/jobs/shards.py)."""
    o = inv.options
    root = job.root or job.state
    merger = shards.Merger(root, split, task, rows, o.get("out"), events)
    results_uri = root.store.child_uri(RESULTS)
    n = split.count

    def finished(record: dict, step: int, **fields) -> Outcome:
        merger.deliver()
        return job.done(step, True, out=o.get("out") or results_uri, rows=len(rows), shards=n, merged=True,
                        **fields, **record.get("summary", {}))

    record = root.shards.merge_record()
    if split.index is None:  # no shard to do: only complete the merge
        merged = merger.attempt(complete=True)
        if merged.missing:
            raise SpillpackError(f"{o['name']} is split into {n} shards and shard{'s' if len(merged.missing) > 1 else ''} "
                                 f"{shards.listed(merged.missing)} of them {'are' if len(merged.missing) > 1 else 'is'} "
                                 f"not finished, so there is nothing to merge yet",
                                 f"run the missing shards (--shard I, or the scheduler's array), e.g. "
                                 f"spillpack resume {root.uri} --shard {merged.missing[0]}")
        if merged.record is None:
            return job.done(0, False, out=None, rows=len(rows), shards=n, merged=False)
        return finished(merged.record, len(rows), shard=None)
    if record is not None:  # merged before: deliver again (to a new --out) and report it
        job.restored(len(rows), results_uri)
        return finished(record, len(rows), shard=split.index)

    lo, hi = split.range(len(rows))
    mine = rows[lo:hi]
    rerun = job.state.shards.done() is not None  # nothing of its own to do: it may complete a merge cut short
    work, stopped = _generate(job, inv, events, task, mine, model, f" (shard {split.index} of {n}: rows {lo}-{hi - 1})")
    if stopped is not None:
        return stopped
    lines = work.lines
    common = {"shard": split.index, "shards": n}
    if len(lines) < len(mine):
        return job.done(len(lines), False, out=None, rows=len(lines), merged=False, **common,
                        failed_rows=sum(1 for x in lines.values() if x.get("error")))
    if job.state.shards.done() is None:
        job.state.shards.mark_done(len(mine))
    merged = merger.attempt(complete=rerun)
    if merged.record is None:
        # Others are still working (or one is merging right now): this shard's part is done.
        m = merged.missing
        waiting = (f"shard{'s' if len(m) > 1 else ''} {shards.listed(m)} still running" if m else "another shard is merging")
        events.say(f"shard {split.index} of {n} done ({len(mine)} rows); {waiting}: the last shard to finish merges")
        return job.done(len(mine), True, out=None, rows=len(mine), merged=False, **common)
    # Merged: out and rows describe the job's output file, as an unsharded run's done does.
    return job.done(len(mine), True, out=o.get("out") or results_uri, rows=len(rows), shard_rows=len(mine), merged=True,
                    merged_here=merged.by_me, **common, **merged.record.get("summary", {}))


class RowsWork:
    """The row loop's quanta: one generation step of the continuous batch each. Finished rows are
    committed in segments every --commit-rows rows or --commit-seconds, and on preemption."""

    def __init__(self, job: Job, task: RowTask, rows: list[Row], model_ref: str, job_key: str, o: dict, adapters=()):
        self.job, self.task, self.rows, self.model_ref, self.job_key, self.o = job, task, rows, model_ref, job_key, o
        self.lines: dict[str, dict] = {}  # custom_id -> output line, committed or not
        state = job.state
        for seg in state.rows.all():
            for raw_line in state.read_file(seg, "rows").splitlines():
                rec = orjson.loads(raw_line)
                self.lines.setdefault(rec["custom_id"], rec)
        known = {r.custom_id for r in rows}
        self.lines = {k: v for k, v in self.lines.items() if k in known}
        self.uncommitted: list[dict] = []
        for r in rows:
            if r.error and r.custom_id not in self.lines:
                self._record(r.custom_id, error_line(r, r.error, job_key))
        self.todo = [r for r in rows if not r.error and r.custom_id not in self.lines]
        self.last_commit = time.monotonic()
        self.gen = None
        self._results = []
        model_fp = state.identity.get("model")
        self.fingerprint = system_fingerprint(model_fp, state.identity.get("adapter"))
        # Named adapters: each row's own, over the base and its adapter (the base's rows: no adapter).
        self.named = [a for a in adapters if a.name is not None]
        self.fingerprints = [system_fingerprint(model_fp, a.fingerprint) for a in self.named]
        self.base_fingerprint = system_fingerprint(model_fp, None)

    @property
    def done(self) -> int:
        return len(self.lines)

    def _record(self, custom_id: str, line: dict) -> None:
        self.lines[custom_id] = line
        self.uncommitted.append(line)

    def _served(self, row: Row) -> tuple[str, str]:
        """The model a row's line names, and its system_fingerprint."""
        if not self.named:
            return self.model_ref, self.fingerprint
        if row.adapter < 0:
            return self.model_ref, self.base_fingerprint
        return row.served, self.fingerprints[row.adapter]

    def start(self, engine, model_dir, tokenizer, adapter, per_row: bool = False) -> None:
        self.engine = engine
        self.gen = engine.generator(model_dir, tokenizer, adapter, slots=min(self.o["batch"], len(self.todo)),
                                    max_len=max(len(r.prompt_ids) + r.max_tokens for r in self.todo))
        self.by_id = {r.custom_id: r for r in self.todo}
        # Many adapters: the rows join the batch grouped by adapter (stably), so most prefills find
        # the prefix cache's keys of their own adapter and most steps run one adapter's update on
        # every row; rows of two adapters share steps where one group ends and the next begins.
        # A row's answer does not depend on its batch mates, and the output keeps the input's order.
        for r in sorted(self.todo, key=lambda r: r.adapter) if per_row else self.todo:
            self.gen.add(Request(r.custom_id, r.prompt_ids, r.max_tokens, r.temperature, r.top_p, r.seed, stop=r.stop,
                                 logprobs=r.logprobs, top_logprobs=r.top_logprobs, presence_penalty=r.presence_penalty,
                                 frequency_penalty=r.frequency_penalty, grammar=r.grammar,
                                 adapter=r.adapter if per_row else None))
        self.new_tokens, self.generated, self.t_gen = 0, 0, time.perf_counter()

    def remaining(self) -> bool:
        return self.gen is not None and self.gen.active

    def quantum(self) -> None:
        self._results = self.gen.step()

    def discard(self) -> None:
        self._results = []  # the generator restarts unfinished rows from their prompts on the next run

    def settle(self) -> None:
        total = len(self.rows)
        limit = self.o.get("stop_after")
        for res in self._results:
            if limit is not None and len(self.lines) >= limit:
                break  # --stop-after N is N rows exactly: rows finished past it are generated again on the next run
            row = self.by_id[res.key]
            served, fingerprint = self._served(row)
            self._record(row.custom_id, ok_line(row, res, served, self.job_key, fingerprint))
            self.new_tokens += res.completion_tokens
            self.generated += 1
            elapsed = time.perf_counter() - self.t_gen
            self.job.events.emit("row", step=len(self.lines), total=total, custom_id=row.custom_id,
                                 tokens_per_s=round(self.new_tokens / elapsed, 1) if elapsed > 0 else None,
                                 peak_mem_gb=round(self.engine.peak_mem_gb(), 3),
                                 eta_s=round(elapsed / self.generated * (total - len(self.lines)), 1))
        self._results = []

    def commit_due(self) -> bool:
        return len(self.uncommitted) >= self.o["commit_rows"] or time.monotonic() - self.last_commit >= self.o["commit_seconds"]

    def commit(self) -> None:
        self.last_commit = time.monotonic()
        if not self.uncommitted:
            return
        blob = b"".join(orjson.dumps(x) + b"\n" for x in self.uncommitted)
        c, seconds = self.job.state.rows.commit(blob, len(self.uncommitted))
        self.uncommitted.clear()
        self.job.checkpointed(len(self.lines), self.job.state.file_uri(c, "rows"), seconds)
