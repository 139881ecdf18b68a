"""The wheels of the trackers a packed job reports to (--report-to, docs/trackers.md), carried
under wheels/TAG/ and unpacked on first start like torch's, so run.sh logs on an air-gapped
node without pip. `pack --with-tracker NAME` carries one more (for SPILLPACK_REPORT_TO on the
target). W&B's wheel is large and carries a platform binary: it is carried only when named by
--with-tracker, and a job reporting to it is refused otherwise.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from runtime import trackers
from runtime.base.errors import SpillpackError

from . import wheels

BY_NAME_ONLY = ("wandb",)


def chosen(job_option, with_tracker: list[str] | None, command: str) -> list[str]:
    """The trackers to carry: the job's --report-to and pack's --with-tracker; refuses W&B unless named."""
    asked = trackers.parse(job_option, command)
    named = trackers.parse(with_tracker or [], command)
    for name in asked:
        if name in BY_NAME_ONLY and name not in named:
            raise SpillpackError(f"the job reports to {name}, whose wheels (about 20 MB, with a platform binary) pack carries only when "
                                 f"asked", f"spillpack pack ... --with-tracker {name}")
    return [*asked, *[n for n in named if n not in asked]]


def carried(names: list[str], tag: str, python: str, runtime_wheels: list[Path]) -> list[Path]:
    """The trackers' wheels for `tag` with their dependencies, less what the zipapp already carries
    (its versions win: the carried wheels come first on sys.path)."""
    if not names:
        return []
    reqs = []
    for name in names:
        dist = trackers.TRACKERS[name][2]
        try:
            reqs.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            raise SpillpackError(f"--report-to {name}: {dist} is not installed here, so the packer cannot tell which version to bundle",
                                 f"pip install 'spillpack[{name}]'")
    have = {_norm(w.name.split("-")[0]) for w in runtime_wheels}
    return [w for w in wheels.fetch(tag, python, reqs, with_deps=True) if _norm(w.name.split("-")[0]) not in have]


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")
