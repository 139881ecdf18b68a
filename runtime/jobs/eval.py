"""`spillpack eval`: generate an answer for each row and score it against the row's "expected"
with --metric (runtime/jobs/metrics.py); accuracy with a 95% Wilson interval.

The output file has one line per row: {custom_id, answer, expected, correct, finish_reason, error};
eval.json under the state holds the summary. A row that failed (too long, bad parameter) counts
as wrong and is counted in failed_rows.

With named adapters (`--adapter NAME=SRC`, repeatable) every row is answered once by the base and
once by each adapter in one batch (rows `custom_id@model`, the base's `@base`), each scored on
its own: a table of score and 95% interval per model, and `scores` in the summary (accuracy and
ci95 stay the base's). Each output line then names its `model`."""

import orjson

from runtime.jobs import adapters, rowjob
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


def _finisher(metric: str, field, many: bool):
    def finish(rows, lines) -> Output:
        per_row, tally = [], {}  # model -> [correct, failed, rows]
        for row, line in zip(rows, lines):
            answer = content_of(line)
            ok = score(metric, answer, row.expected, field)
            t = tally.setdefault(row.served, [0, 0, 0])
            t[0] += ok
            t[1] += answer is None
            t[2] += 1
            choice = (line.get("response") or {}).get("body", {}).get("choices", [{}])[0]
            named = {"custom_id": row.custom_id.rsplit("@", 1)[0], "model": row.served} if many else {"custom_id": row.custom_id}
            per_row.append({**named, "answer": answer, "expected": row.expected, "correct": ok,
                            "finish_reason": choice.get("finish_reason"), "error": line.get("error")})
        scores = [_score(model, *t) for model, t in tally.items()]  # the base first, then the adapters in order
        base = scores[0]
        summary = {"metric": metric, "correct": base["correct"], "accuracy": base["accuracy"], "ci95": base["ci95"],
                   "failed_rows": sum(s["failed_rows"] for s in scores)}
        if many:
            summary["scores"] = scores
        data = b"".join(orjson.dumps(x) + b"\n" for x in per_row)
        extra = {"eval.json": orjson.dumps({**summary, "rows": len(rows)}, option=orjson.OPT_INDENT_2),
                 "answers.jsonl": b"".join(orjson.dumps(x) + b"\n" for x in lines)}
        if not many:
            lo, hi = wilson(base["correct"], base["rows"])
            message = (f"accuracy {base['correct'] / base['rows']:.3f} ({base['correct']}/{base['rows']}), "
                       f"95% interval [{lo:.3f}, {hi:.3f}] by {metric}")
        else:
            message = table(scores, metric)
        return Output(data, summary, extra, message)
    return finish


def _score(model: str, correct: int, failed: int, n: int) -> dict:
    lo, hi = wilson(correct, n)
    return {"model": model, "correct": correct, "rows": n, "accuracy": round(correct / n, 6), "ci95": [round(lo, 6), round(hi, 6)],
            "failed_rows": failed}


def table(scores: list[dict], metric: str) -> str:
    """The scores of the base (first) and each adapter, one line each."""
    width = max(len(s["model"]) for s in scores) + 7
    lines = [f"{'model':<{width}} {metric:>11}  95% interval     correct"]
    for i, s in enumerate(scores):
        label = s["model"] + (" (base)" if i == 0 else "")
        lo, hi = s["ci95"]
        lines.append(f"{label:<{width}} {s['correct'] / s['rows']:>11.3f}  [{lo:.3f}, {hi:.3f}]   {s['correct']}/{s['rows']}")
    return "\n".join(lines)


def main(inv, events) -> Outcome:
    o = inv.options
    many = any(name is not None for name, _ in adapters.parse(o.get("adapter")))
    task = RowTask("eval", "model", "evals", _finisher(o["metric"], o.get("field"), many), expected_check(o["metric"], o.get("field")),
                   identity={"metric": o["metric"], "field": o.get("field")}, every_model=True)
    return rowjob.run_rows(inv, events, task)
