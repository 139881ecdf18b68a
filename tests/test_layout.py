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
    runtime.fileio and runtime.core.signals (stdlib-only too: the preemption handler is installed
    first thing), plus the hand-over to the CLI in start.py, once the platform's packages are on sys.path,
    and early.py's hand-over to shiv's bootstrap."""
    import sys

    offenders = {}
    for p in [*sorted((REPO / "runtime" / "bootstrap").glob("*.py")), REPO / "runtime" / "core" / "signals.py"]:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["runtime.bootstrap"]
            for name in names:
                ok = (name.split(".")[0] in sys.stdlib_module_names or name in ("runtime.errors", "runtime.fileio", "runtime.core.signals")
                      or (p.name == "start.py" and name == "runtime.cli")
                      or (p.name == "early.py" and name == "_bootstrap")  # shiv's, beside it at the archive's root
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


MAX_MODULE_LINES = 400  # past this a module is split (docs/architecture.md)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports at import time (module level, not inside functions,
    not under TYPE_CHECKING): the edges along which an import cycle would bite."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        stmts = node.body if isinstance(node, (ast.If, ast.Try)) else [node]
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                names = [a.name for a in stmt.names]
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    anchor = package.split(".")[: len(package.split(".")) - (stmt.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in stmt.names]
            else:
                continue
            for name in names:
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    out.add(name)
    return out


def test_no_import_cycles():
    files = sorted(p for top in ("runtime", "spillpack") for p in (REPO / top).rglob("*.py"))
    known = {_module_name(p) for p in files}
    graph = {_module_name(p): module_imports(p, known) for p in files}

    # A package's __init__ runs before its submodules: importing a.b imports a first.
    def deps(mod):
        return graph.get(mod, set())

    cycles, state = [], {}

    def visit(mod, stack):
        state[mod] = "open"
        for dep in sorted(deps(mod)):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert cycles == []


def test_no_module_over_the_size_limit():
    long = {str(p.relative_to(REPO)): n for top in ("runtime", "spillpack") for p in sorted((REPO / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
