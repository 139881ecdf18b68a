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
