"""What a chat template may build: the size a value holds, and the size an operation would give
before it runs, so a template is refused before it allocates, not after.

Sizes are counted in characters and items: a string counts its characters, a list, tuple, set
or dict its items plus what they hold (a list of a thousand references to one long string holds
a thousand copies once printed or joined), a whole number its decimal digits. Counting stops
once it passes the bound, so checking a value costs at most the bound's worth of work.
"""

from __future__ import annotations

import re

from jinja2.exceptions import SecurityError

# The digits of a width or precision in a %-format or a str.format field.
_FORMAT_NUMBER = re.compile(r"\d+")


def size_of(value, bound: int) -> int:
    """Characters and items `value` holds, counted through containers; stops past `bound`."""
    total, stack = 0, [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += len(x)
            stack.extend(x)
        elif isinstance(x, dict):
            total += len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, range):
            total += len(x)
        elif isinstance(x, int) and not isinstance(x, bool):
            total += x.bit_length() // 3 + 1
        else:
            total += 1
        if total > bound:
            return total
    return total


def check_numbers(what: str, values, bound: int) -> None:
    """A whole number given to an operation is a count or a width it may build: at most `bound`."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > bound:
            raise SecurityError(f"{what} is given {v}, past the {bound} characters a template may build")


def check_format(what: str, fmt: str, args, bound: int) -> int:
    """The size a %- or {}-format of `fmt` with `args` can reach, refused past `bound`."""
    widths = [int(n) for n in _FORMAT_NUMBER.findall(fmt)] if any(c.isdigit() for c in fmt) else []
    check_numbers(what, widths, bound)
    flat = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, (list, tuple)) else [args]
    check_numbers(what, [a for a in flat if isinstance(a, int)], bound)
    # a field may be printed through repr(), which writes at most ten characters for one
    return len(fmt) + sum(widths) + 10 * size_of(flat, bound)


def _joined(items, sep, bound: int) -> int:
    n = size_of(items, bound)
    return 10 * n + len(str(sep)) * n  # each item printed (repr at most ten characters for one), a separator between


def predict_filter(name: str, value, rest: tuple, kwargs: dict, bound: int) -> int | None:
    """The size the filter `value|name(*rest)` can reach, for the filters that build more than they
    are given; None for the rest, whose result is checked after."""
    if name == "join":
        return _joined(value, rest[0] if rest else kwargs.get("d", ""), bound)
    if not isinstance(value, str):
        return None
    if name == "center":
        return len(value) + max([a for a in rest if isinstance(a, int)] + [kwargs.get("width", 80)])
    if name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        return len(value) + (width if isinstance(width, int) else len(str(width))) * (value.count("\n") + 1)
    if name == "replace":
        return _replaced(value, *(list(rest) + [None, None])[:2])
    if name == "wordwrap":
        width = rest[0] if rest else kwargs.get("width", 79)
        wrap = kwargs.get("wrapstring") or (rest[2] if len(rest) > 2 else None) or "\n"
        lines = len(value) // max(width if isinstance(width, int) else 1, 1) + value.count("\n") + 1
        return len(value) + lines * len(str(wrap))
    if name == "format":
        return check_format("the format filter", value, kwargs or rest, bound)
    return None


def predict_method(name: str, receiver: str, args: tuple, kwargs: dict, bound: int) -> int | None:
    """The same for a string's own method, `receiver.name(*args)`."""
    if name in ("center", "ljust", "rjust", "zfill"):
        return len(receiver) + max([a for a in args if isinstance(a, int)] + [0])
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(receiver) + max(tab if isinstance(tab, int) else 8, 0) * (receiver.count("\t") + 1)
    if name == "replace":
        return _replaced(receiver, *(list(args) + [None, None])[:2])
    if name == "join" and args:
        return _joined(args[0], receiver, bound)
    if name in ("format", "format_map"):
        return check_format(f"str.{name}", receiver, kwargs or (args[0] if name == "format_map" and args else args), bound)
    return None


def _replaced(s: str, old, new) -> int | None:
    if not isinstance(old, str) or not isinstance(new, str):
        return None
    count = s.count(old) if old else len(s) + 1
    return len(s) + count * max(len(new) - len(old), 0)
