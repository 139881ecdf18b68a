"""glibc's heap: handing its free pages back to the system.

A job's start builds large temporaries and frees them (a GGUF's tokenizer as JSON, then the
weights' separate copies once joined); glibc keeps what it freed for later allocations, so the
process's resident memory stays at that high-water mark. malloc_trim releases every whole free
page of the heap, not only its top; the model loader calls it once, after the weights. Elsewhere
(macOS, musl) these are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform


@functools.cache
def glibc():
    """glibc, or None where its malloc tuning calls do not exist."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (musl has neither)
        return libc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand the free pages of glibc's heap back to the system: after a load frees copies it no longer needs."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
