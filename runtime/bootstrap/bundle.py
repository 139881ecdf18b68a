"""A bundle on disk: its root and its manifest, and the checks that tie the two together.

run.sh's bootstrap builds one and hands it to the CLI (`runtime.cli.main(argv, bundle=...)`);
`resume FOLDER` builds one for a bundle folder. The job receives it on its Invocation: it
turns `files/...` values into absolute paths (run.sh may start from any directory) and
checks every bundled file the job reads against the manifest. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.bootstrap.manifest import BUNDLE_PREFIX, MANIFEST, PRIVATE_DIR, Manifest
from runtime.base.errors import SpillpackError
from runtime.base.fileio import sha256_bytes, sha256_file


def _damaged(rel: str, why: str) -> SpillpackError:
    return SpillpackError(f"bundled file {rel} {why}; the bundle is damaged", "copy the bundle again, then ./run.sh --verify")


class Bundle:
    def __init__(self, root: Path, manifest: Manifest):
        self.root = root
        self.manifest = manifest

    @classmethod
    def open(cls, root: Path) -> "Bundle":
        root = Path(root).resolve()
        return cls(root, Manifest.read(root))

    def check_file(self, rel: str, data: bytes | None = None) -> None:
        """Compare one bundled file (or the bytes just read from it) with the manifest."""
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise _damaged(rel, "is not in MANIFEST.json")
        digest = None
        if data is None:
            path = self.root / rel
            if path.is_symlink() or not path.is_file():
                raise _damaged(rel, "is missing" if not path.exists() else "is not a regular file")
            size = path.stat().st_size
            if size == entry.size:
                digest = sha256_file(path)
        else:
            size = len(data)
            if size == entry.size:
                digest = sha256_bytes(data)
        if size != entry.size:
            raise _damaged(rel, f"has {size} bytes, not {entry.size}")
        if digest != entry.sha256:
            raise _damaged(rel, "does not match its SHA-256 in MANIFEST.json")

    def present(self, under: str = "") -> list[str]:
        """Every file in the bundle directory (or its folder `under`) but the manifest and what
        the bundle writes at run time."""
        out = []
        for dirpath, dirs, files in os.walk(self.root / under):
            rel_dir = Path(dirpath).relative_to(self.root)
            if rel_dir == Path("."):
                dirs[:] = [d for d in dirs if d != PRIVATE_DIR]
            for name in files + [d for d in dirs if Path(dirpath, d).is_symlink()]:
                rel = (rel_dir / name).as_posix()
                if rel != MANIFEST:
                    out.append(rel)
        return sorted(out)

    def verify(self) -> int:
        """Every listed file matches, and the bundle holds no file the manifest does not list."""
        extra = sorted(set(self.present()) - set(self.manifest.files))
        if extra:
            raise _damaged(extra[0], f"is not in MANIFEST.json ({len(extra)} unlisted file{'s' if len(extra) > 1 else ''})")
        for rel in sorted(self.manifest.files):
            self.check_file(rel)
        return len(self.manifest.files)

    def check_read(self, path: str | Path, data: bytes) -> None:
        """Called with the bytes of each data file a job reads: a bundled file must be the one packed."""
        try:
            rel = Path(path).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return  # not inside the bundle
        if rel in self.manifest.files:
            self.check_file(rel, data)
        elif rel.startswith(BUNDLE_PREFIX):
            raise _damaged(rel, "is not in MANIFEST.json")

    def localize(self, values: dict) -> dict:
        """`files/...` values made absolute under the bundle; every file inside a bundled directory
        is checked now, since weights and adapters are read by libraries that do not go through
        check_read (a single file is checked as it is read), and such a directory may hold no
        file the manifest does not list (a library would read an added shard as well)."""
        out = dict(values)
        for key, value in values.items():
            if isinstance(value, str) and value.startswith(BUNDLE_PREFIX):
                out[key] = str(self.root / value)
                prefix = value.rstrip("/") + "/"
                if (self.root / value).is_dir():
                    extra = sorted(set(self.present(value.rstrip("/"))) - set(self.manifest.files))
                    if extra:
                        raise _damaged(extra[0], "is not in MANIFEST.json")
                for rel in sorted(self.manifest.files):
                    if rel.startswith(prefix):
                        self.check_file(rel)
        return out
