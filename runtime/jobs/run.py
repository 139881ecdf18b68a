"""`spillpack run`: batch inference over OpenAI batch JSONL; the output is OpenAI batch output JSONL,
one line per input row in input order (runtime/data/rows.py has both shapes)."""

import orjson

from runtime.jobs import rowjob
from runtime.core.job import Outcome
from runtime.jobs.rowjob import Output, RowTask


def _finish(rows, lines) -> Output:
    failed = sum(1 for line in lines if line.get("error"))
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    return Output(data, {"failed_rows": failed}, {}, f"{len(lines)} rows, {failed} failed")


def main(inv, events) -> Outcome:
    return rowjob.run_rows(inv, events, RowTask("run", "model", "input", _finish))
