"""Writing the bundle directory: copy and hash each file in one pass, run.sh, MANIFEST.json.

Everything is written into a private directory beside DIR and renamed into place at the
end, so a failed pack leaves nothing behind and a finished one appears whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

from runtime.bootstrap.manifest import MANIFEST, FileEntry, Manifest
from runtime.base.fileio import naming, sha256_bytes, sha256_file

from ..quoting import comment, sh

CHUNK = 8 << 20

RUN_SH = """\
#!/bin/sh
# A spillpack bundle: the {command_c} job {name_c}, packed by {packer_c} for Python {python_c} on {platforms_c}.
#   ./run.sh [OPTIONS]   run the job, or continue it; OPTIONS go to `spillpack {command_c}` (e.g. --stop-after 5)
#   ./run.sh --verify    check every file of the bundle against MANIFEST.json
# Exit 0: done. 75: preempted after a checkpoint; run this again to continue. 1: error. 2: usage.
# SPILLPACK_PYTHON picks the interpreter (default python3), SHIV_ROOT where the zipapp unpacks.
# A stop before the job starts (checking files and Python) writes nothing, so its truth is
# "run me again": 75, not the shell's 143. exec below hands later signals to the job itself.
trap 'exit 75' TERM HUP INT
command={command}
want={python}
# Where this script really is: $0 may be a symlink to it (or a chain of them), and the bundle's
# files lie beside the script, not beside the link.
self=$0 hops=0
while [ -h "$self" ] && [ "$hops" -lt 40 ]; do  # 40: the kernel's own bound on a chain of links
  hops=$((hops + 1))
  link=$(readlink -- "$self") || break
  case $link in
    /*) self=$link ;;
    *) self=$(dirname -- "$self")/$link ;;
  esac
done
here=$(CDPATH= cd -- "$(dirname -- "$self")" && pwd -P) || exit 1
# The bundle's own files first: a partial copy is one line here, not Python's traceback later.
for f in spillpack.pyz MANIFEST.json files/job.json; do
  if [ ! -f "$here/$f" ]; then
    echo "spillpack: $here/$f is missing, so the bundle is incomplete. Try: copy the bundle again, then $0 --verify" >&2
    exit 1
  fi
done
py=${{SPILLPACK_PYTHON:-python3}}
have=$("$py" -S -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {{
  echo "spillpack: no Python found as '$py'. Try: install Python $want, or SPILLPACK_PYTHON=/path/to/python$want $0" >&2; exit 1; }}
if [ "$have" != "$want" ]; then
  echo "spillpack: this bundle needs Python $want, but $py is Python $have. Try: SPILLPACK_PYTHON=/path/to/python$want $0, or spillpack pack ... --python $have" >&2
  exit 1
fi
# Unpack the zipapp on a node-local disk: HOME may be read-only, or shared by every node.
if [ -z "${{SHIV_ROOT:-}}" ]; then
  uid=$(id -u)
  for d in "${{TMPDIR:-/tmp}}" /var/tmp "$here/.spillpack"; do
    if mkdir -p "$d/spillpack-$uid" 2>/dev/null && [ -O "$d/spillpack-$uid" ] && [ -w "$d/spillpack-$uid" ]; then
      chmod 700 "$d/spillpack-$uid" 2>/dev/null; SHIV_ROOT=$d/spillpack-$uid; break
    fi
  done
  export SHIV_ROOT
fi
if [ "${{1:-}}" = "--verify" ]; then
  exec "$py" "$here/spillpack.pyz" --verify
fi
# OpenMP's idle threads sleep rather than spin on cores other processes hold (runtime/base/threads.py).
export OMP_WAIT_POLICY="${{OMP_WAIT_POLICY:-PASSIVE}}"
# exec: the job becomes this process, so a scheduler's SIGTERM reaches it (also as PID 1).
exec "$py" "$here/spillpack.pyz" "$command" --config "$here/files/job.json" "$@"
"""


def run_sh(command: str, name: str, packer: str, python: str, platforms: list[str]) -> bytes:
    """run.sh for one job. Every value goes through spillpack.quoting: shell code gets
    shlex.quote, comments an escaped form with no line break, so a job name or a path can
    never become a command (the name comes from a file name by default)."""
    return RUN_SH.format(command=sh(command), python=sh(python), command_c=comment(command), name_c=comment(name),
                         packer_c=comment(packer), python_c=comment(python),
                         platforms_c=comment(", ".join(platforms))).encode()


def copy_hashed(src: Path, dest: Path, on_chunk=lambda n: None) -> tuple[int, str]:
    """Copy and hash in one read: packing costs about what copying costs. `on_chunk(bytes)`
    after each chunk (the progress line)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    with naming(dest), open(src, "rb") as fi, open(dest, "wb") as fo:
        while chunk := fi.read(CHUNK):
            h.update(chunk)
            fo.write(chunk)
            size += len(chunk)
            on_chunk(len(chunk))
    return size, h.hexdigest()


def write_hashed(dest: Path, data: bytes, mode: int = 0o644) -> tuple[int, str]:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with naming(dest):
        dest.write_bytes(data)
    os.chmod(dest, mode)
    return len(data), sha256_bytes(data)


class Writer:
    """Files go into `tmp`; `finish` writes the manifest and renames tmp to the output."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.parent / f".{out.name}.packing-{os.getpid()}"
        self.entries: dict[str, FileEntry] = {}

    def __enter__(self) -> "Writer":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.tmp.mkdir()
            return self
        except BaseException:  # a stop (Abandon) right after mkdir: __exit__ would not run
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def copy(self, rel: str, src: Path, on_chunk=lambda n: None) -> None:
        size, digest = copy_hashed(src, self.tmp / rel, on_chunk)
        self.entries[rel] = FileEntry(size, digest, str(src))

    def write(self, rel: str, data: bytes, origin: str, mode: int = 0o644) -> None:
        size, digest = write_hashed(self.tmp / rel, data, mode)
        self.entries[rel] = FileEntry(size, digest, origin)

    def add_existing(self, rel: str, origin: str) -> None:
        path = self.tmp / rel
        self.entries[rel] = FileEntry(path.stat().st_size, sha256_file(path), origin)

    def finish(self, manifest: Manifest) -> None:
        with naming(self.tmp / MANIFEST):
            (self.tmp / MANIFEST).write_bytes(replace(manifest, files=dict(self.entries)).to_json())
        if self.out.exists():  # appeared while we were packing
            raise FileExistsError(str(self.out))
        os.rename(self.tmp, self.out)
