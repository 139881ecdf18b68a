"""The runtime is what the bundle carries: it must not reach for the laptop side or for test peers."""

import ast
from pathlib import Path

from conftest import REPO

FORBIDDEN = {"spillpack", "transformers", "peft", "shiv", "pytest"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_runtime_never_imports_the_packer_or_test_peers():
    offenders = {str(p.relative_to(REPO)): sorted(imported_roots(p) & FORBIDDEN)
                 for p in sorted((REPO / "runtime").rglob("*.py")) if imported_roots(p) & FORBIDDEN}
    assert offenders == {}


def test_bootstrap_imports_only_the_standard_library_its_siblings_and_errors():
    """run.sh's start-up code runs before the zipapp's sys.path is complete, and the packer
    imports it: it may import nothing but the standard library, runtime.bootstrap.*, runtime.errors and
    runtime.fileio (stdlib-only too),
    plus the hand-over to the CLI in start.py, once the platform's packages are on sys.path."""
    import sys

    offenders = {}
    for p in sorted((REPO / "runtime" / "bootstrap").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["runtime.bootstrap"]
            for name in names:
                ok = (name.split(".")[0] in sys.stdlib_module_names or name in ("runtime.errors", "runtime.fileio")
                      or (p.name == "start.py" and name == "runtime.cli")
                      or name == "runtime.bootstrap" or name.startswith("runtime.bootstrap."))
                if not ok:
                    offenders.setdefault(p.name, []).append(name)
    assert offenders == {}
    assert (REPO / "runtime" / "bootstrap" / "manifest.py").exists()


def test_no_module_level_active_bundle():
    """The bundle travels as a value (cli.main(argv, bundle=...), Invocation.bundle), never a global."""
    for p in sorted((REPO / "runtime").rglob("*.py")):
        text = p.read_text()
        assert "_Active" not in text and "os.chdir" not in text, p
