"""The bundle's start-up before any job code: find the bundle, activate this platform's
compiled packages, install carried wheels on first start (runtime/entry.py, the zipapp's
entry point, then hands the Bundle to the CLI).

`./run.sh --verify` stops here, after checking every file against MANIFEST.json.
Standard library only at module level: it runs before sys.path is complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.bootstrap.bundle import Bundle
from runtime.bootstrap.manifest import MANIFEST
from runtime.bootstrap.platforms import activate
from runtime.bootstrap.wheels import ensure_engines


def bundle_root() -> Path | None:
    """The bundle directory when this process runs a bundle's spillpack.pyz, else None."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is None or argv0.suffix != ".pyz":
        return None
    root = argv0.resolve().parent
    return root if (root / MANIFEST).is_file() else None


def prepare(argv: list[str]) -> Bundle | int | None:
    """The bundle this process runs, ready to import the job's packages; an exit code when it
    should stop here (--verify); None outside a bundle."""
    root = bundle_root()
    if root is None:
        return None
    bundle = Bundle.open(root)
    if argv[:1] == ["--verify"]:
        n = bundle.verify()
        sys.stderr.write(f"spillpack: all {n} files of {root} match MANIFEST.json\n")
        return 0
    site = Path(__file__).resolve().parents[2]  # the zipapp's site-packages: runtime/bootstrap/start.py
    tag = activate(bundle.manifest.platforms, bundle.manifest.python, site)
    if "--help" not in argv and "-h" not in argv:
        ensure_engines(root, bundle.manifest, tag)
    return bundle
