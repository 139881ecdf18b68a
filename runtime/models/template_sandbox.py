"""A chat template's render with bounded work: jinja2's immutable sandbox (no attribute or
method that reaches outside the data), plus bounds on what the sandbox leaves unbounded.

A chat template comes with the model (a GGUF carries its own), so it is code from whoever made
the file. One render may:
- build no value, and write no output, larger than the render's size bound (the conversation's
  own size plus SPILLPACK_TEMPLATE_MAX_BYTES, 1 MiB unless set): every operation that can build
  more than it is given (`*`, `+`, `%`, `~`, the filters and string methods that pad, repeat or
  join) has its result's size worked out from its operands before it runs
  (runtime.models.template_bounds), and every other result is measured after;
- run for at most SPILLPACK_TEMPLATE_MAX_SECONDS (5 unless set): the clock is read at every
  attribute, item, call, operator, loop iteration and piece of output;
- yield at most `range_budget` items from all its range() calls together;
- touch no attribute the sandbox holds unsafe (`__class__` and the like): that is a refusal
  naming the attribute, not an empty value the render goes on with;
- call only the globals real chat templates use (range, dict, namespace, raise_exception,
  strftime_now): jinja's lipsum, cycler and joiner are removed.

Each is a SecurityError, a TemplateError, so it reaches the user as the same one-line refusal
a template's own raise_exception() gets.
"""

from __future__ import annotations

import functools
import operator
import threading
import time
import tracemalloc

from jinja2 import Undefined, nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

from runtime.models.template_bounds import check_format, check_numbers, predict_filter, predict_method, size_of

INT_BITS = 1 << 16  # about 19,700 decimal digits
# What a render's live values may hold together, in bytes per character of its size bound: many
# values each within the bound (a block that collects a large piece a thousand times) add up.
MEMORY_FACTOR = 16
UNUSED_GLOBALS = ("lipsum", "cycler", "joiner")
_LOOP, _CONCAT = "spillpack_loop", "spillpack_concat"  # the filters the parse step puts in


class _ThroughBounds(NodeTransformer):
    """Every loop's iterable and every `~` rewritten as filters of ours, so they tick the clock and
    measure what they build like everything else a template does."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, [], [], None, None, lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, range_budget: int, max_bytes: int, max_seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.range_budget, self.max_bytes, self.max_seconds = range_budget, max_bytes, max_seconds
        self._left, self._bound, self._deadline, self._memory_base = range_budget, max_bytes, float("inf"), 0
        self.concat = self._joined_output  # what a {% set %} block, a macro or a {% filter %} collects
        for name in UNUSED_GLOBALS:
            self.globals.pop(name, None)
        self.globals["range"] = self._range
        self.filters[_LOOP] = self._loop
        self.filters[_CONCAT] = self._concat

    def finish_setup(self) -> None:
        """Every filter measured: called once the caller has added its own."""
        for name, f in list(self.filters.items()):
            if name not in (_LOOP, _CONCAT) and not getattr(f, "spillpack_bounded", False):
                self.filters[name] = self._bounded_filter(name, f)

    # -- the parse step: loops and ~ go through the bounds too ----------------------------------

    def _parse(self, source, name, filename):
        return _ThroughBounds().visit(super()._parse(source, name, filename))

    # -- the checks -----------------------------------------------------------------------------

    def _tick(self) -> None:
        if time.monotonic() > self._deadline:
            raise SecurityError(f"the template ran past {self.max_seconds:g} seconds (SPILLPACK_TEMPLATE_MAX_SECONDS)")
        if tracemalloc.get_traced_memory()[0] - self._memory_base > MEMORY_FACTOR * self._bound:
            raise SecurityError(f"the template holds more than {MEMORY_FACTOR * self._bound} bytes of values at once, "
                                f"{MEMORY_FACTOR}x the {self._bound} characters a render may build (SPILLPACK_TEMPLATE_MAX_BYTES)")

    def _too_big(self, what: str, size: int) -> SecurityError:
        return SecurityError(f"{what} would build {size} characters, past the {self._bound} a render may "
                             f"(SPILLPACK_TEMPLATE_MAX_BYTES)")

    def _fits(self, what: str, size: int | None) -> None:
        if size is not None and size > self._bound:
            raise self._too_big(what, size)

    def _measured(self, what: str, value):
        if isinstance(value, (str, list, tuple, dict, set, frozenset)):
            self._fits(what, size_of(value, self._bound))
        return value

    # -- what the sandbox routes through the environment ------------------------------------------

    def getattr(self, obj, attribute):
        self._tick()
        self._not_internal(obj, attribute)
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        if not (isinstance(obj, dict) and argument in obj):  # a key of the data's own is data
            self._not_internal(obj, argument)
        return super().getitem(obj, argument)

    def _not_internal(self, obj, name) -> None:
        """A dunder name is Python's, not the data's, whether or not the object has it."""
        if isinstance(name, str) and name.startswith("__"):
            raise self._internal(obj, name)

    def unsafe_undefined(self, obj, attribute):
        raise self._internal(obj, attribute)  # jinja would return an empty value and render on

    @staticmethod
    def _internal(obj, name) -> SecurityError:
        return SecurityError(f"the template reached for {name!r} of a {type(obj).__name__}, which a chat template may not touch")


    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        __self._tick()
        if isinstance(__obj, Undefined):  # a name the template does not have: jinja's own error
            return super().call(__context, __obj, *args, **kwargs)
        name = getattr(__obj, "__name__", "a function")
        if __obj != __self._range:  # range() is lazy: its numbers are not sizes, its budget bounds it
            check_numbers(f"{name}()", [*args, *kwargs.values()], __self._bound)
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(receiver, str):
            __self._fits(f"str.{name}()", predict_method(name, receiver, args, kwargs, __self._bound))
        return __self._measured(f"{name}()", super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator_: str, left, right):
        self._tick()
        whole = isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool) and not isinstance(right, bool)
        too_big = SecurityError(f"the template computes a whole number of more than {INT_BITS} bits")
        if operator_ == "**":
            if whole and right > 0 and max(left.bit_length(), 1) * right > INT_BITS:
                raise too_big
            try:
                return operator.pow(left, right)
            except OverflowError:  # a float past 1.8e308
                raise too_big from None
        if operator_ == "%":
            if isinstance(left, str):
                self._fits("a %-format", check_format("a %-format", left, right, self._bound))
            return self._measured("a %-format", operator.mod(left, right))
        if operator_ == "+":
            if not whole and hasattr(left, "__len__") and hasattr(right, "__len__"):
                self._fits("+", size_of(left, self._bound) + size_of(right, self._bound))
            return operator.add(left, right)
        if whole and left.bit_length() + right.bit_length() > INT_BITS:
            raise too_big
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                self._fits(f"repeating a value {n} times", size_of(seq, self._bound) * max(n, 0))
        return operator.mul(left, right)

    # -- the filters and globals --------------------------------------------------------------

    def _bounded_filter(self, name: str, f):
        skip = 0 if _PassArg.from_obj(f) is None else 1  # a context or environment comes first

        @functools.wraps(f)
        def bounded(*args, **kwargs):
            self._tick()
            value, rest = args[skip] if len(args) > skip else None, args[skip + 1:]
            check_numbers(f"the {name} filter", [*rest, *kwargs.values()], self._bound)
            if name == "attr" and rest:
                self._not_internal(value, rest[0])
            self._fits(f"the {name} filter", predict_filter(name, value, rest, kwargs, self._bound))
            return self._measured(f"the {name} filter", f(*args, **kwargs))

        bounded.spillpack_bounded = True
        return bounded

    def _loop(self, iterable):
        for item in iterable:
            self._tick()
            yield item

    def _concat(self, parts):
        self._tick()
        self._fits("~", sum(size_of(p, self._bound) * (1 if isinstance(p, str) else 10) for p in parts))
        return "".join(map(str, parts))

    def _joined_output(self, pieces) -> str:
        pieces = list(pieces)
        self._fits("a block", sum(len(p) for p in pieces))
        return "".join(pieces)

    def _range(self, *args):
        r = range(*args)
        if len(r) > self._left:
            raise SecurityError(f"the template's range() calls ask for more than {self.range_budget} items in one render")
        self._left -= len(r)
        return r

    def render_bounded(self, template, **variables) -> str:
        """`template` rendered within the bounds: the size bound is the conversation's own size
        plus max_bytes, so a long conversation renders and a template's own growth does not."""
        self._left = self.range_budget
        self._bound = self.max_bytes + 2 * size_of(variables, 1 << 40)
        out, size = [], 0
        with _traced():
            self._memory_base = tracemalloc.get_traced_memory()[0]
            self._deadline = time.monotonic() + self.max_seconds
            try:
                for piece in template.generate(**variables):
                    self._tick()
                    size += len(piece)
                    if size > self._bound:
                        raise SecurityError(f"the template writes more than {self._bound} characters for one conversation "
                                            f"(SPILLPACK_TEMPLATE_MAX_BYTES)")
                    out.append(piece)
            finally:
                self._deadline = float("inf")
        return "".join(out)


_tracing = threading.Lock()
_tracers = 0


class _traced:
    """Python's allocations traced while at least one render runs (tracemalloc counts them for the
    memory bound; it is off again once no render needs it)."""

    def __enter__(self):
        global _tracers
        with _tracing:
            if _tracers == 0 and not tracemalloc.is_tracing():
                tracemalloc.start(1)
                _tracers = 1
            elif _tracers:
                _tracers += 1

    def __exit__(self, *exc):
        global _tracers
        with _tracing:
            if _tracers:
                _tracers -= 1
                if _tracers == 0:
                    tracemalloc.stop()
