"""`spillpack distill`: the teacher answers every prompt; the output is chat training data
(`{"messages": [...prompt..., {"role": "assistant", "content": answer}]}`) that `tune` reads as is.

Rows that failed, and answers that came back empty, are left out of the training data (a tune
example needs assistant content) and counted in the summary."""

import orjson

from runtime.jobs import rowjob
from runtime.core.job import Outcome
from runtime.jobs.rowjob import Output, RowTask
from runtime.data.rows import content_of


def _finish(rows, lines) -> Output:
    out, failed, empty = [], 0, 0
    for row, line in zip(rows, lines):
        answer = content_of(line)
        if answer is None:
            failed += 1
        elif not answer.strip():
            empty += 1
        else:
            out.append(orjson.dumps({"messages": [*row.messages, {"role": "assistant", "content": answer}]}) + b"\n")
    summary = {"failed_rows": failed, "empty_answers": empty, "examples": len(out)}
    return Output(b"".join(out), summary, {"answers.jsonl": b"".join(orjson.dumps(x) + b"\n" for x in lines)},
                  f"{len(out)} training examples from {len(lines)} prompts ({failed} failed, {empty} empty answers left out)")


def main(inv, events) -> Outcome:
    return rowjob.run_rows(inv, events, RowTask("distill", "teacher", "prompts", _finish))
