"""Rows of a row job (run, eval, distill): reading OpenAI batch JSONL, and writing its output shape.

Input, one JSON object a line:
    {"custom_id": "a", "body": {"messages": [...], "max_tokens": 64, "temperature": 0, "top_p": 1, "seed": 1}}
    {"custom_id": "b", "prompt": "text"}          a plain prompt is one user message
    eval rows add "expected": the answer the metric compares against (runtime/jobs/metrics.py)

A line that is not a JSON object, or lacks a string custom_id, or repeats one, stops the job
before any work with one line naming it: without a custom_id a result cannot be matched to its
row. Everything else wrong with a row (no messages, an unsupported parameter, too long) is that
row's error line in the output, and the other rows go on.
"""

import hashlib
from dataclasses import dataclass, field

from runtime.data.messages import normalize
from runtime.data.jsonl import iter_jsonl
from runtime.base.errors import SpillpackError

# Body parameters we honour; "model" is the job's model whatever the row says, "n" and
# "stream" only in the one value a batch line can mean.
SUPPORTED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "model", "n",
             "stream", "user", "chat_template_kwargs"}


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
    prompt_ids: list[int] = field(default_factory=list)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, e.g. {"enable_thinking": true}


def parse_rows(raw: bytes, uri: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> list[Row]:
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for n, obj in iter_jsonl(raw, uri):
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise SpillpackError(f"{uri} line {n} has no custom_id (a non-empty string is needed to match its result)",
                                 f"sed -n {n}p {uri}")
        if cid in seen:
            raise SpillpackError(f"{uri}: custom_id {cid!r} appears twice (lines {seen[cid]} and {n}); results could not be told apart",
                                 f"grep -n '\"{cid}\"' {uri}")
        seen[cid] = n
        row = Row(len(rows), n, cid, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  expected=obj.get("expected"), has_expected="expected" in obj)
        row.error = _fill(row, obj)
        rows.append(row)
    return rows


def _fill(row: Row, obj: dict) -> str | None:
    """Reads the row's request into `row`; returns what is wrong with it, if anything."""
    body = obj.get("body", {})
    if not isinstance(body, dict):
        return "\"body\" must be a JSON object"
    if "prompt" in obj and "prompt" not in body:
        body = {**body, "prompt": obj["prompt"]}
    unsupported = sorted(set(body) - SUPPORTED)
    if unsupported:
        return f"unsupported parameter {unsupported[0]!r} (supported: {', '.join(sorted(SUPPORTED))})"
    if body.get("n", 1) != 1:
        return "n must be 1 (one completion per row)"
    if body.get("stream", False):
        return "stream is not available in a batch"
    if "messages" in body:
        msgs, problem = normalize(body["messages"])
        if problem:
            return problem
        row.messages = msgs
    elif isinstance(body.get("prompt"), str) and body["prompt"]:
        row.messages = [{"role": "user", "content": body["prompt"]}]
    else:
        return "missing \"messages\" (or a non-empty \"prompt\")"
    mt = body.get("max_completion_tokens", body.get("max_tokens", row.max_tokens))
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        return f"max_tokens must be a positive integer, not {mt!r}"
    row.max_tokens = mt
    t = body.get("temperature", row.temperature)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 2:
        return f"temperature must be a number in [0, 2], not {t!r}"
    row.temperature = float(t)
    p = body.get("top_p", row.top_p)
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
        return f"top_p must be a number in (0, 1], not {p!r}"
    row.top_p = float(p)
    s = body.get("seed", row.seed)
    if not isinstance(s, int) or isinstance(s, bool):
        return f"seed must be an integer, not {s!r}"
    row.seed = s
    kw = body.get("chat_template_kwargs", {})
    if not isinstance(kw, dict):
        return f"chat_template_kwargs must be a JSON object, not {kw!r}"
    row.template_kwargs = kw
    return None


def encode_rows(rows: list[Row], tokenizer, context: int) -> None:
    """Prompt ids for each good row; a row that cannot be rendered or does not fit gets its error."""
    for row in rows:
        if row.error:
            continue
        try:
            row.prompt_ids = tokenizer.encode_prompt(row.messages, **row.template_kwargs)
        except SpillpackError as e:
            row.error = e.what
            continue
        if len(row.prompt_ids) + row.max_tokens > context:
            row.error = (f"too long: {len(row.prompt_ids)} prompt tokens + max_tokens {row.max_tokens} exceed the model's "
                         f"context of {context}")


# -- output lines (the OpenAI batch output shape) -------------------------------------------


def request_id(job_key: str, custom_id: str) -> str:
    # Deterministic, so a resumed job's file is byte-identical to an uninterrupted one's.
    return hashlib.sha256(f"{job_key}\0{custom_id}".encode()).hexdigest()[:24]


def ok_line(row: Row, result, model: str, job_key: str) -> dict:
    rid = request_id(job_key, row.custom_id)
    return {
        "id": f"batch_req_{rid}",
        "custom_id": row.custom_id,
        "response": {
            "status_code": 200,
            "request_id": rid,
            "body": {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "finish_reason": result.finish_reason}],
                "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "total_tokens": result.prompt_tokens + result.completion_tokens},
            },
        },
        "error": None,
    }


def error_line(row: Row, message: str, job_key: str) -> dict:
    return {"id": f"batch_req_{request_id(job_key, row.custom_id)}", "custom_id": row.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": f"line {row.line}: {message}"}}


def content_of(line: dict) -> str | None:
    """The answer in an output line, or None for an error line."""
    if line.get("error") or not line.get("response"):
        return None
    return line["response"]["body"]["choices"][0]["message"]["content"]
