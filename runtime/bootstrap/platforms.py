"""Wheel platform tags, this machine in their terms, and putting the zipapp's compiled
packages for this machine first on sys.path.

The zipapp carries one directory of compiled packages per target platform, because abi3
extension modules have the same file name on every platform. Standard library only.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

from runtime.base.errors import SpillpackError

PLATFORM_DIR = "_spillpack_platforms"  # inside the zipapp's site-packages

_TAG = re.compile(r"^(manylinux_(\d+)_(\d+)|macosx_(\d+)_(\d+))_(x86_64|aarch64|arm64)$")


def parse_tag(tag: str) -> tuple[str, tuple[int, int], str] | None:
    """'manylinux_2_17_x86_64' -> ('linux', (2, 17), 'x86_64'); None when not a tag we support."""
    m = _TAG.match(tag)
    if not m:
        return None
    if m.group(2):
        return "linux", (int(m.group(2)), int(m.group(3))), m.group(6)
    return "darwin", (int(m.group(4)), int(m.group(5))), m.group(6)


def is_apple_silicon(tag: str) -> bool:
    parsed = parse_tag(tag)
    return parsed is not None and parsed[0] == "darwin" and parsed[2] == "arm64"


def this_machine() -> tuple[str, tuple[int, int], str]:
    """(os, version, arch) in the terms of parse_tag: glibc version on Linux, macOS version on macOS."""
    arch = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "arm64" if sys.platform == "darwin" else "aarch64"}.get(arch, arch)
    if sys.platform == "darwin":
        parts = (platform.mac_ver()[0] or "0.0").split(".") + ["0"]
        return "darwin", (int(parts[0]), int(parts[1])), arch
    libc = ""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # 'glibc 2.36'; musl has none
    except (ValueError, OSError):
        pass
    m = re.search(r"(\d+)\.(\d+)", libc)
    return sys.platform, ((int(m.group(1)), int(m.group(2))) if m else (0, 0)), arch


def runs_here(tag: str, machine=None) -> bool:
    parsed = parse_tag(tag)
    if parsed is None:
        return False
    os_, version, arch = parsed
    m_os, m_version, m_arch = machine or this_machine()
    return os_ == m_os and arch == m_arch and m_version >= version


def describe_machine(machine=None) -> str:
    os_, version, arch = machine or this_machine()
    what = {"linux": "glibc", "darwin": "macOS"}.get(os_, os_)
    return f"{os_} {arch} ({what} {version[0]}.{version[1]})" if version != (0, 0) else f"{os_} {arch}"


def suggest_tag() -> str:
    os_, version, arch = this_machine()
    if os_ == "darwin":
        return f"macosx_11_0_{arch}"
    return f"manylinux_2_17_{arch}" if version < (2, 28) else f"manylinux_2_28_{arch}"


def activate(platforms: list[str], python: str, site: Path) -> str:
    """Put the compiled packages built for this machine first on sys.path; return their tag."""
    have = "%d.%d" % sys.version_info[:2]
    if python and python != have:
        raise SpillpackError(f"this bundle's compiled parts are for Python {python}; this is Python {have}",
                             f"SPILLPACK_PYTHON=python{python} ./run.sh, or spillpack pack ... --python {have}")
    for tag in platforms:
        if runs_here(tag):
            sys.path.insert(0, str(site / PLATFORM_DIR / tag))
            return tag
    raise SpillpackError(f"this bundle's compiled parts are for {', '.join(platforms)}; this machine is {describe_machine()}",
                         f"spillpack pack ... --platform {suggest_tag()}")
