"""Rows of a row job (run, eval, distill): reading OpenAI batch JSONL, and writing its output shape.

Input, one JSON object a line:
    {"custom_id": "a", "body": {"messages": [...], "max_tokens": 64, "temperature": 0, "top_p": 1, "seed": 1}}
    {"custom_id": "b", "prompt": "text"}          a plain prompt is one user message
    eval rows add "expected": the answer the metric compares against (runtime/jobs/metrics.py)
A row's "url" (as OpenAI's batch lines carry it) must be /v1/chat/completions, the one endpoint
run serves; a row without one is a chat completion. docs/commands.md lists the body parameters.

A line that is not a JSON object, or lacks a string custom_id, or repeats one, stops the job
before any work with one line naming it: without a custom_id a result cannot be matched to its
row. Everything else wrong with a row (no messages, an unsupported parameter, too long) is that
row's error line in the output, and the other rows go on.
"""

import hashlib
import math
import os
from dataclasses import dataclass, field

from runtime.data.grammars import FormatError, grammar_for
from runtime.data.messages import normalize
from runtime.data.jsonl import MAX_NESTING, iter_jsonl, nesting_past
from runtime.base.errors import SpillpackError

# Body parameters we honour; "model" chooses among the job's named adapters and its base
# (runtime/jobs/adapters.py) and is not read without them, "n" and "stream" only in the one
# value a batch line can mean.
SUPPORTED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "model", "n",
             "stream", "user", "chat_template_kwargs", "stop", "logprobs", "top_logprobs", "presence_penalty",
             "frequency_penalty", "response_format"}
ENDPOINT = "/v1/chat/completions"
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 500  # a stop string is text the answer ends at, not a document
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class _Bad(Exception):
    """What is wrong with a row, and the body parameter it is about (BatchError's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class Row:
    index: int  # position in the input: the output keeps this order
    line: int  # line number in the file, for messages
    custom_id: str
    messages: list | None = None
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    expected: object = None
    has_expected: bool = False
    error: str | None = None  # set: the row is answered with an error line, not generated
    error_param: str | None = None  # the body parameter the error is about
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str | None = None  # llguidance grammar from response_format (runtime/data/grammars.py)
    prompt_ids: list[int] = field(default_factory=list)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, e.g. {"enable_thinking": true}
    model: str | None = None  # body.model as the row names it
    adapter: int = -1  # the named adapter that answers it (runtime/jobs/adapters.py), -1: the base or the one plain adapter
    served: str | None = None  # the model it is answered as: the output's `model`


def parse_rows(raw: bytes, uri: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> list[Row]:
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for n, obj in iter_jsonl(raw, uri, nonfinite=True):
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise SpillpackError(f"{uri} line {n} has no custom_id (a non-empty string is needed to match its result)",
                                 f"sed -n {n}p {uri}")
        if cid in seen:
            raise SpillpackError(f"{uri}: custom_id {cid!r} appears twice (lines {seen[cid]} and {n}); results could not be told apart",
                                 f"grep -n '\"{cid}\"' {uri}")
        seen[cid] = n
        row = Row(len(rows), n, cid, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  expected=obj.get("expected"), has_expected=obj.get("expected") is not None)  # null is no answer
        try:
            if nesting_past(obj):
                row.expected, row.has_expected = None, False
                raise _Bad(f"the row nests objects and lists more than {MAX_NESTING} deep", "body")
            _fill(row, obj)
        except _Bad as bad:
            row.error, row.error_param = bad.message, bad.param
        rows.append(row)
    return rows


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise _Bad(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], not {v!r}"[:200], name)
    return float(v)


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise _Bad("stop must be a string or a list of up to 4 strings", "stop")
    if len(stops) > MAX_STOPS:
        raise _Bad(f"stop has {len(stops)} strings; at most {MAX_STOPS}", "stop")
    for x in stops:
        if not x:
            raise _Bad("stop strings must not be empty", "stop")
        if len(x) > MAX_STOP_CHARS:
            raise _Bad(f"a stop string of {len(x)} characters; at most {MAX_STOP_CHARS}", "stop")
    return tuple(dict.fromkeys(stops))


def _fill(row: Row, obj: dict) -> None:
    """Reads the row's request into `row`; raises _Bad saying what is wrong with it."""
    url = obj.get("url", ENDPOINT)
    if url != ENDPOINT:
        raise _Bad(f"url {url!r}"[:120] + f" is not served: run answers {ENDPOINT} only", "url")
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Bad(f"method {method!r}"[:120] + " is not served: batch requests are POST", "method")
    body = obj.get("body", {})
    if not isinstance(body, dict):
        raise _Bad("\"body\" must be a JSON object", "body")
    if "prompt" in obj and "prompt" not in body:
        body = {**body, "prompt": obj["prompt"]}
    unsupported = sorted(set(body) - SUPPORTED)
    if unsupported:
        raise _Bad(f"unsupported parameter {unsupported[0]!r} (supported: {', '.join(sorted(SUPPORTED))})", unsupported[0])
    if body.get("n", 1) != 1:
        raise _Bad("n must be 1 (one completion per row)", "n")
    if body.get("stream", False):
        raise _Bad("stream is not available in a batch", "stream")
    if "messages" in body:
        msgs, problem = normalize(body["messages"])
        if problem:
            raise _Bad(problem, "messages")
        row.messages = msgs
    elif isinstance(body.get("prompt"), str) and body["prompt"]:
        row.messages = [{"role": "user", "content": body["prompt"]}]
    else:
        raise _Bad("missing \"messages\" (or a non-empty \"prompt\")", "messages")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    mt = body.get(name, row.max_tokens)
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _Bad(f"{name} must be a positive integer, not {mt!r}"[:200], name)
    row.max_tokens = mt
    row.model = body.get("model") if isinstance(body.get("model"), str) else None
    row.temperature = _number(body, "temperature", row.temperature, 0, 2)
    row.top_p = _number(body, "top_p", row.top_p, 0, 1, lo_open=True)
    s = body.get("seed", row.seed)
    if not isinstance(s, int) or isinstance(s, bool):
        raise _Bad(f"seed must be an integer, not {s!r}"[:200], "seed")
    row.seed = s
    kw = body.get("chat_template_kwargs", {})
    if not isinstance(kw, dict):
        raise _Bad(f"chat_template_kwargs must be a JSON object, not {kw!r}"[:200], "chat_template_kwargs")
    row.template_kwargs = kw
    row.stop = _stops(body.get("stop"))
    lp = body.get("logprobs", False)
    if lp is not None and not isinstance(lp, bool):
        raise _Bad(f"logprobs must be true or false, not {lp!r}"[:200], "logprobs")
    row.logprobs = bool(lp)
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _Bad(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, not {top!r}"[:200], "top_logprobs")
        if not row.logprobs:
            raise _Bad("top_logprobs needs \"logprobs\": true", "top_logprobs")
        row.top_logprobs = top
    row.presence_penalty = _number(body, "presence_penalty", 0.0, -2, 2)
    row.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2, 2)
    if body.get("response_format") is not None:
        try:
            row.grammar = grammar_for(body["response_format"])
        except FormatError as e:
            raise _Bad(str(e), "response_format")


def encode_rows(rows: list[Row], tokenizer, context: int) -> None:
    """Prompt ids for each good row; a row that cannot be rendered or does not fit gets its error."""
    for row in rows:
        if row.error:
            continue
        try:
            row.prompt_ids = tokenizer.encode_prompt(row.messages, **row.template_kwargs)
        except SpillpackError as e:
            row.error, row.error_param = e.what, "messages"
            continue
        if not row.prompt_ids:  # nothing to generate from (a template that renders nothing for it)
            row.error, row.error_param = "the chat template renders this conversation as no tokens", "messages"
            continue
        if len(row.prompt_ids) + row.max_tokens > context:
            row.error_param = "messages"
            row.error = (f"too long: {len(row.prompt_ids)} prompt tokens + max_tokens {row.max_tokens} exceed the model's "
                         f"context of {context}")


# -- output lines (the OpenAI batch output shape) -------------------------------------------


def request_id(job_key: str, custom_id: str) -> str:
    # Deterministic, so a resumed job's file is byte-identical to an uninterrupted one's.
    return hashlib.sha256(f"{job_key}\0{custom_id}".encode()).hexdigest()[:24]


def created_now() -> int:
    """`created`: when the row was answered (Unix seconds), as OpenAI means it; SOURCE_DATE_EPOCH
    fixes it (the reproducible-builds convention), so two runs of one job write the same bytes."""
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    if fixed is not None and fixed.strip().isdigit():
        return int(fixed)
    import time

    return int(time.time())


def system_fingerprint(model_fingerprint, adapter_fingerprint) -> str:
    """What produced the answers (the model's files and the adapter), as OpenAI's `fp_...`."""
    digest = hashlib.sha256(repr((model_fingerprint, adapter_fingerprint)).encode()).hexdigest()
    return f"fp_{digest[:12]}"


def ok_line(row: Row, result, model: str, job_key: str, fingerprint: str | None = None) -> dict:
    """A success line: the Batch API's request output whose body is a ChatCompletion."""
    rid = request_id(job_key, row.custom_id)
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
              "logprobs": {"content": result.logprobs, "refusal": None} if result.logprobs is not None else None,
              "finish_reason": result.finish_reason}
    return {
        "id": f"batch_req_{rid}",
        "custom_id": row.custom_id,
        "response": {
            "status_code": 200,
            "request_id": rid,
            "body": {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": created_now(),
                "model": model,
                "system_fingerprint": fingerprint,
                "choices": [choice],
                "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "total_tokens": result.prompt_tokens + result.completion_tokens},
            },
        },
        "error": None,
    }


def error_line(row: Row, message: str, job_key: str) -> dict:
    """A failed row as the Batch API writes one: no response, an error (BatchError's fields)."""
    return {"id": f"batch_req_{request_id(job_key, row.custom_id)}", "custom_id": row.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": f"line {row.line}: {message}", "param": row.error_param,
                      "line": row.line}}


def content_of(line: dict) -> str | None:
    """The answer in an output line, or None for an error line."""
    if line.get("error") or not line.get("response"):
        return None
    return line["response"]["body"]["choices"][0]["message"]["content"]
