"""A chat template's render with bounded work: jinja2's immutable sandbox (no attribute or
method that reaches outside the data), plus bounds on what the sandbox leaves unbounded.

- range(): all the calls of one render together yield at most `range_budget` items, so
  nested loops cannot multiply their way to hours;
- `*` and `**` on text, lists or numbers: a result beyond the output bound is refused before
  it is built (a whole number past INT_BITS: Python prints no more than 4300 digits of one
  anyway, and squaring past it is where the time goes; a float that overflows);
- the output: rendered as a stream and stopped once it passes `output_max` characters.

Each is a SecurityError, a TemplateError, so it reaches the user as the same one-line refusal
a template's own raise_exception() gets.
"""

from __future__ import annotations

import operator

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment


INT_BITS = 1 << 16  # about 19,700 decimal digits


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, range_budget: int, output_max: int, **kwargs):
        super().__init__(**kwargs)
        self.range_budget, self.output_max = range_budget, output_max
        self._left = range_budget
        self.globals["range"] = self._range

    def _range(self, *args):
        r = range(*args)
        if len(r) > self._left:
            raise SecurityError(f"the template's range() calls ask for more than {self.range_budget} items in one render")
        self._left -= len(r)
        return r

    def call_binop(self, context, operator_: str, left, right):
        whole = isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool) and not isinstance(right, bool)
        too_big = SecurityError(f"the template computes a whole number of more than {INT_BITS} bits")
        if operator_ == "**":
            if whole and right > 0 and max(left.bit_length(), 1) * right > INT_BITS:
                raise too_big
            try:
                return operator.pow(left, right)
            except OverflowError:  # a float past 1.8e308
                raise too_big from None
        if whole and left.bit_length() + right.bit_length() > INT_BITS:
            raise too_big
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > self.output_max:
                raise SecurityError(f"the template repeats a value {n} times, past the {self.output_max} characters a render may write")
        return operator.mul(left, right)

    def render_bounded(self, template, **variables) -> str:
        """`template` rendered with a fresh range budget, stopped past `output_max` characters."""
        self._left = self.range_budget
        out, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > self.output_max:
                raise SecurityError(f"the template writes more than {self.output_max} characters for one conversation")
            out.append(piece)
        return "".join(out)
