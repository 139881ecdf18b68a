"""`spillpack eval`: generate an answer for each row and score it against the row's "expected"
with --metric (runtime/jobs/metrics.py); accuracy with a 95% Wilson interval.

The output file has one line per row: {custom_id, answer, expected, correct, finish_reason, error};
eval.json under the state holds the summary. A row that failed (too long, bad parameter) counts
as wrong and is counted in failed_rows."""

import orjson

from runtime.jobs import rowjob
from runtime.base.errors import SpillpackError
from runtime.jobs.metrics import check, score, wilson
from runtime.core.job import Outcome
from runtime.jobs.rowjob import Output, RowTask
from runtime.data.rows import content_of


def expected_check(metric: str, field):
    def check_rows(rows, uri):
        missing = next((r for r in rows if not r.has_expected), None)
        if missing is not None:
            raise SpillpackError(f"{uri} line {missing.line} (custom_id {missing.custom_id!r}) has no \"expected\" answer to score against",
                                 f"add \"expected\": \"...\" to every row, or spillpack run for rows without answers")
        check(metric, field, [r.expected for r in rows])
    return check_rows


def _finisher(metric: str, field):
    def finish(rows, lines) -> Output:
        per_row, correct, failed = [], 0, 0
        for row, line in zip(rows, lines):
            answer = content_of(line)
            ok = score(metric, answer, row.expected, field)
            correct += ok
            failed += answer is None
            choice = (line.get("response") or {}).get("body", {}).get("choices", [{}])[0]
            per_row.append({"custom_id": row.custom_id, "answer": answer, "expected": row.expected, "correct": ok,
                            "finish_reason": choice.get("finish_reason"), "error": line.get("error")})
        n = len(rows)
        lo, hi = wilson(correct, n)
        summary = {"metric": metric, "correct": correct, "accuracy": round(correct / n, 6), "ci95": [round(lo, 6), round(hi, 6)],
                   "failed_rows": failed}
        data = b"".join(orjson.dumps(x) + b"\n" for x in per_row)
        extra = {"eval.json": orjson.dumps({**summary, "rows": n}, option=orjson.OPT_INDENT_2),
                 "answers.jsonl": b"".join(orjson.dumps(x) + b"\n" for x in lines)}
        message = f"accuracy {correct / n:.3f} ({correct}/{n}), 95% interval [{lo:.3f}, {hi:.3f}] by {metric}"
        return Output(data, summary, extra, message)
    return finish


def main(inv, events) -> Outcome:
    o = inv.options
    task = RowTask("eval", "model", "evals", _finisher(o["metric"], o.get("field")), expected_check(o["metric"], o.get("field")),
                   identity={"metric": o["metric"], "field": o.get("field")})
    return rowjob.run_rows(inv, events, task)
