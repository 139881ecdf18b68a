"""MANIFEST.json: the one contract between the packer and the bundle's runtime.

The packer builds a `Manifest` and writes `to_json()`; run.sh's bootstrap reads it back
with `Manifest.read(root)`. Reading checks the shape field by field, so a damaged or
hand-edited file is one line naming what is wrong, never a KeyError deep in a job, and
every file path it lists is confined to the bundle (relative, no `..`): a manifest can
never make the runtime read outside its own directory.

Standard library only: it is read before sys.path is complete.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from runtime.base.errors import SpillpackError

MANIFEST = "MANIFEST.json"
FORMAT = 1  # "spillpack_manifest": bumped when a reader of the old shape would misread the new one
BUNDLE_PREFIX = "files/"  # every bundle-relative path in files/job.json starts with this
WHEELS_DIR = "wheels"  # wheels/TAG/*.whl: torch and mlx carried for an offline first start
PRIVATE_DIR = ".spillpack"  # written by the bundle itself at run time (unpacked wheels), never packed


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    origin: str  # where the packer took it from: a local path, "command line", "built by spillpack pack"


@dataclass
class Manifest:
    packer: str  # "spillpack 0.1.0"
    command: str
    name: str
    python: str  # "3.11": the compiled parts are for this Python
    platforms: list[str]  # wheel platform tags the zipapp carries compiled packages for
    zipapp: dict  # {"entry_point", "carries": {"common": [...], TAG: [...]}}
    with_torch: str | None = None  # "cpu" | "cuda": torch wheels under wheels/TAG/
    with_mlx: bool = False  # mlx wheels under wheels/TAG/ for macOS arm64 targets
    engines: dict[str, list[str]] = field(default_factory=dict)  # TAG -> engines the bundle can use there
    trackers: list[str] = field(default_factory=list)  # --report-to trackers whose wheels are under wheels/TAG/
    files: dict[str, FileEntry] = field(default_factory=dict)  # bundle-relative POSIX path -> entry

    @property
    def wheels_key(self) -> str:
        """Where the carried wheels are unpacked: a new set of carried packages never reuses an old install."""
        parts = ([f"torch-{self.with_torch}"] if self.with_torch else []) + (["mlx"] if self.with_mlx else []) + self.trackers
        return "-".join(parts) + f"-py{self.python}"

    def to_json(self) -> bytes:
        data = {"spillpack_manifest": FORMAT, **asdict(self)}
        data["files"] = {rel: asdict(self.files[rel]) for rel in sorted(self.files)}
        return (json.dumps(data, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Manifest":
        def damaged(why: str) -> SpillpackError:
            return SpillpackError(f"{where} is damaged ({why})", "copy the bundle again, then ./run.sh --verify")

        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise damaged(f"not JSON: {e}")
        if not isinstance(data, dict):
            raise damaged("not a JSON object")
        if data.get("spillpack_manifest") != FORMAT:
            raise SpillpackError(f"{where} is manifest format {data.get('spillpack_manifest')!r}, this runtime reads {FORMAT}",
                                 "run the bundle with the spillpack.pyz beside it, or pack it again")
        kinds = {"packer": str, "command": str, "name": str, "python": str, "platforms": list, "zipapp": dict,
                 "with_mlx": bool, "engines": dict, "files": dict}
        for key, kind in kinds.items():
            if not isinstance(data.get(key), kind):
                raise damaged(f"{key!r} is missing or not a {kind.__name__}")
        if data.get("with_torch") not in (None, "cpu", "cuda"):
            raise damaged(f"'with_torch' is {data.get('with_torch')!r}")
        if not all(isinstance(t, str) for t in data["platforms"]):
            raise damaged("'platforms' holds a non-string")
        trackers = data.get("trackers", [])  # absent in a bundle packed before trackers were carried
        if not (isinstance(trackers, list) and all(isinstance(t, str) and t.isalpha() for t in trackers)):
            raise damaged(f"'trackers' is {trackers!r}")
        files = {}
        for rel, entry in data["files"].items():
            check_rel(rel, where)
            if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool)
                    and isinstance(entry.get("sha256"), str) and isinstance(entry.get("origin"), str)):
                raise damaged(f"the entry of {rel!r} needs size, sha256 and origin")
            files[rel] = FileEntry(entry["size"], entry["sha256"], entry["origin"])
        return cls(packer=data["packer"], command=data["command"], name=data["name"], python=data["python"],
                   platforms=list(data["platforms"]), zipapp=data["zipapp"], with_torch=data.get("with_torch"),
                   with_mlx=data["with_mlx"], engines=data["engines"], files=files, trackers=list(trackers))

    @classmethod
    def read(cls, root: Path) -> "Manifest":
        path = root / MANIFEST
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise SpillpackError(f"{path} is unreadable ({e.strerror})", "copy the bundle again")
        return cls.from_json(raw, str(path))


def check_rel(rel: str, where: str) -> str:
    """A manifest path names a file inside the bundle: relative, POSIX, no `.`/`..`/empty parts."""
    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    if (not parts or rel.startswith("/") or "\\" in rel or "\x00" in rel or any(p in (".", "..") for p in parts)
            or rel != "/".join(parts) or rel == MANIFEST or parts[0] == PRIVATE_DIR):
        raise SpillpackError(f"{where} lists {rel!r}, a path outside the bundle's own files; the manifest is damaged or forged",
                             "copy the bundle again from where it was packed, then ./run.sh --verify")
    return rel
