"""How `spillpack eval` scores an answer against a row's "expected", and the interval it reports.

    exact_match  the answer equals expected, ignoring case, surrounding whitespace and a final . ! or ?
    contains     expected occurs in the answer, ignoring case
    regex        expected is a Python regular expression found in the answer (re.search)
    json_field   the answer parses as a JSON object whose --field equals expected (JSON equality)
"""

import json
import math
import re

from runtime.base.errors import SpillpackError


def _norm(text: str) -> str:
    return text.strip().rstrip(".!?").strip().casefold()


def score(metric: str, answer: str | None, expected, field: str | None = None) -> bool:
    if answer is None:  # the row failed: it counts, as wrong
        return False
    if metric == "exact_match":
        return _norm(answer) == _norm(str(expected))
    if metric == "contains":
        return str(expected).casefold() in answer.casefold()
    if metric == "regex":
        return re.search(str(expected), answer) is not None
    if metric == "json_field":
        try:
            obj = json.loads(answer.strip())
        except ValueError:
            return False
        return isinstance(obj, dict) and field in obj and obj[field] == expected
    raise ValueError(metric)


def check(metric: str, field: str | None, expected_values) -> None:
    """Refuse a setup that cannot score, before any work."""
    if metric == "json_field" and not field:
        raise SpillpackError("--metric json_field needs --field, the key to compare", "--metric json_field --field answer")
    if metric == "regex":
        for value in expected_values:
            try:
                re.compile(str(value))
            except re.error as e:
                raise SpillpackError(f"expected {value!r} is not a regular expression ({e})", "--metric exact_match, or fix the pattern")


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval: sensible at 0% and 100% and for small n, unlike p +- z*se."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if correct == 0 else max(0.0, centre - half)  # exact at the ends, free of rounding
    hi = 1.0 if correct == n else min(1.0, centre + half)
    return lo, hi
