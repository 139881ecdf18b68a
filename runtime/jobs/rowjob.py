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

import hashlib
import time
from dataclasses import dataclass
from typing import Callable

import orjson

from runtime.models.lora import load_adapter
from runtime.config.invocation import Invocation, default_name
from runtime.data.train import read_bytes, sha256
from runtime.engines import get_engine
from runtime.errors import SpillpackError, UsageError
from runtime.core.job import Job
from runtime.models.ref import local_path, resolve_model
from runtime.data.rows import Row, encode_rows, error_line, ok_line, parse_rows
from runtime.core.signals import Abandon
from runtime.state.store import open_store
from runtime.models.tokenizer import Tokenizer

RESULTS = "results.jsonl"  # the final output, under the state
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


def finish_invocation(inv: Invocation, input_arg: str) -> None:
    default_name(inv, input_arg)


def _validate(command: str, o: dict) -> None:
    checks = [
        (o["batch"] > 0, f"--batch must be positive, not {o['batch']}", "--batch 8"),
        (o["max_tokens"] > 0, f"--max-tokens must be positive, not {o['max_tokens']}", "--max-tokens 256"),
        (0 <= o["temperature"] <= 2, f"--temperature must be in [0, 2], not {o['temperature']}", "--temperature 0"),
        (0 < o["top_p"] <= 1, f"--top-p must be in (0, 1], not {o['top_p']}", "--top-p 1"),
        (o["commit_rows"] > 0, f"--commit-rows must be positive, not {o['commit_rows']}", "--commit-rows 32"),
        (o["commit_seconds"] > 0, f"--commit-seconds must be positive, not {o['commit_seconds']}", "--commit-seconds 30"),
        (o.get("stop_after") is None or isinstance(o["stop_after"], int),
         f"--stop-after takes a row count for {command}, not {o.get('stop_after')!r}", "--stop-after 10"),
    ]
    for ok, what, try_ in checks:
        if not ok:
            raise SpillpackError(what, f"spillpack {command} ... {try_}")


def adapter_for(uri: str | None):
    """(tensors, spec) and a fingerprint of the adapter's files, or (None, None)."""
    if not uri:
        return None, None
    path = local_path(uri, "adapters")
    tensors, spec = load_adapter(path)
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update((path / name).read_bytes())
    return (tensors, spec), h.hexdigest()


def write_uri(uri: str, data: bytes) -> None:
    """A whole file at a path, file:// or s3:// URI, written atomically."""
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    open_store(parent or ".").write(name, data)


def uri_exists(uri: str) -> bool:
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    return open_store(parent or ".").size(name) is not None


def run_rows(inv: Invocation, events, task: RowTask) -> int:
    a, o = inv.arguments, inv.options
    _validate(task.command, o)
    model_ref, input_uri = a[task.model_arg], a[task.input_arg]
    model_dir = resolve_model(model_ref, o.get("weights"))
    tokenizer = Tokenizer.from_dir(model_dir.path)
    raw = read_bytes(input_uri, "input", inv.bundle)
    rows = parse_rows(raw, input_uri, o["max_tokens"], o["temperature"], o["top_p"], o["seed"])
    task.check(rows, input_uri)
    adapter, adapter_fp = adapter_for(o.get("adapter"))
    encode_rows(rows, tokenizer, int(model_dir.config.get("max_position_embeddings") or 2048))
    bad = [r for r in rows if r.error]
    if len(bad) == len(rows):
        raise SpillpackError(f"every row of {input_uri} failed; line {bad[0].line}: {bad[0].error}", f"sed -n {bad[0].line}p {input_uri}")

    identity = {
        "command": task.command,
        "model": model_dir.fingerprint(),
        "adapter": adapter_fp,
        "input_sha256": sha256(raw),
        **{k: o[k] for k in ("max_tokens", "temperature", "top_p", "seed")},
        **(task.identity or {}),
    }
    job_key = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()
    job = Job.open(task.command, o["name"], o, identity, events, invocation=inv.to_config())
    try:
        return _run(job, inv, events, task, rows, tokenizer, model_dir, adapter, job_key)
    except BaseException:
        job.close()
        raise


def _run(job: Job, inv, events, task, rows, tokenizer, model_dir, adapter, job_key) -> int:
    a, o = inv.arguments, inv.options
    state, store = job.state, job.state.store
    total = len(rows)

    finished = [m for m in state.markers(OUTPUT_MARKER)]
    if finished and store.read(RESULTS) is not None:
        # Done before: deliver the output again (to a new --out) and report it.
        meta = finished[-1].meta
        job.restored(total, store.child_uri(RESULTS))
        out = o.get("out")
        if out and not uri_exists(out):
            write_uri(out, store.read(RESULTS))
        return job.done(total, True, out=out or store.child_uri(RESULTS), rows=total, **meta.get("summary", {}))
    if o.get("out") and uri_exists(o["out"]):
        raise UsageError(f"{o['out']} already exists and would be overwritten", f"another --out, or remove {o['out']}")

    lines: dict[str, dict] = {}
    for seg in state.segments():
        for raw_line in state.read_file(seg, "rows").splitlines():
            rec = orjson.loads(raw_line)
            lines.setdefault(rec["custom_id"], rec)
    known = {r.custom_id for r in rows}
    lines = {k: v for k, v in lines.items() if k in known}
    if lines:
        job.restored(len(lines), state.uri)

    uncommitted: list[dict] = []
    for r in rows:
        if r.error and r.custom_id not in lines:
            line = error_line(r, r.error, job_key)
            lines[r.custom_id] = line
            uncommitted.append(line)
    todo = [r for r in rows if not r.error and r.custom_id not in lines]
    committed_count = len(lines) - len(uncommitted)
    last_commit = time.monotonic()

    def commit() -> None:
        nonlocal last_commit, committed_count
        last_commit = time.monotonic()
        if not uncommitted:
            return
        blob = b"".join(orjson.dumps(x) + b"\n" for x in uncommitted)
        c, seconds = state.commit_segment(blob, len(uncommitted))
        committed_count += len(uncommitted)
        uncommitted.clear()
        job.checkpointed(len(lines), store.child_uri(c.files["rows"]["key"]), seconds)

    gen_tokens = sum(r.max_tokens for r in todo)
    events.emit("start", step=len(lines), job=o["name"], model=a[task.model_arg],
                placement=f"{job.engine_name}: {job.engine_reason}", state=state.uri, estimated_seconds=None, total=total,
                message=f"{task.command} {a[task.model_arg]} on {a[task.input_arg]}: {len(todo)} of {total} rows to generate "
                        f"({len(lines)} done or failed, up to {gen_tokens} new tokens) in batches of {o['batch']} "
                        f"on {job.engine_name}; state at {state.uri}")

    stop_after = o.get("stop_after")
    if todo and (stop_after is None or len(lines) < stop_after):
        engine = get_engine(job.engine_name)
        gen = engine.generator(model_dir, tokenizer, adapter,
                               slots=min(o["batch"], len(todo)), max_len=max(len(r.prompt_ids) + r.max_tokens for r in todo))
        from runtime.generation import Request

        by_id = {r.custom_id: r for r in todo}
        for r in todo:
            gen.add(Request(r.custom_id, r.prompt_ids, r.max_tokens, r.temperature, r.top_p, r.seed))
        step_times: list[float] = []
        new_tokens, generated, t_gen = 0, 0, time.perf_counter()
        while gen.active:
            if job.preemption.stop_requested:
                commit()
                return job.preempted(len(lines), abandoned_quantum=False)
            if stop_after is not None and len(lines) >= stop_after:
                break
            t0 = time.perf_counter()
            try:
                with job.preemption.abandonable():
                    results = gen.step()
            except Abandon:
                commit()
                return job.preempted(len(lines), abandoned_quantum=True)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            job.preemption.expected_step_s = max(step_times[-20:])
            for res in results:
                row = by_id[res.key]
                line = ok_line(row, res, a[task.model_arg], job_key)
                lines[row.custom_id] = line
                uncommitted.append(line)
                new_tokens += res.completion_tokens
                generated += 1
                elapsed = time.perf_counter() - t_gen
                events.emit("row", step=len(lines), total=total, custom_id=row.custom_id,
                            tokens_per_s=round(new_tokens / elapsed, 1) if elapsed > 0 else None,
                            peak_mem_gb=round(engine.peak_mem_gb(), 3),
                            eta_s=round(elapsed / generated * (total - len(lines)), 1))
            job.progress(len(lines))
            if len(uncommitted) >= o["commit_rows"] or time.monotonic() - last_commit >= o["commit_seconds"]:
                commit()
    commit()

    if len(lines) < total:
        return job.done(len(lines), False, out=None, rows=len(lines), failed_rows=sum(1 for x in lines.values() if x.get("error")))

    ordered = [lines[r.custom_id] for r in rows]
    output = task.finish(rows, ordered)
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

