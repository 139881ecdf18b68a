"""A live line for long work measured in bytes (staging weights from S3, packing a large data
folder): done, total, rate and time left, rewritten in place on stderr.

Only on a terminal and never headless: with JSON lines on stdout, or stderr going to a file or
a pipe, nothing is written, so logs stay clean. Stdlib only (the packer uses it too).
"""

from __future__ import annotations

import os
import sys
import time

MIN_TOTAL = 64 << 20  # below this the work is over before a line would help
EVERY_S = 0.2


_headless = False  # set once by the CLI from --headless / SPILLPACK_HEADLESS / stdout


def set_headless(headless: bool) -> None:
    global _headless
    _headless = headless


def wanted(stream=None) -> bool:
    """A live line is for a person: stderr and stdout both a terminal, and not headless."""
    stream = stream or sys.stderr
    if _headless or os.environ.get("SPILLPACK_HEADLESS") == "1":
        return False
    try:
        return stream.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ByteProgress:
    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.on = total >= MIN_TOTAL and wanted(self.stream)
        self.t0 = time.monotonic()
        self._shown_at = 0.0
        self._shown = False

    def line(self, done: int, now: float) -> str:
        elapsed = max(now - self.t0, 1e-9)
        rate = done / elapsed
        left = f", {_time((self.total - done) / rate)} left" if rate > 0 and done < self.total else ""
        return f"{self.label}: {_size(done)} of {_size(self.total)}, {_size(rate)}/s{left}"

    def update(self, done: int) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if now - self._shown_at < EVERY_S:
            return
        self._shown_at = now
        self.stream.write("\r\033[K" + self.line(done, now))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False
