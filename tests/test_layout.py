"""The runtime is what the bundle carries: it must not reach for the laptop side or for test peers."""

import ast
import re
from pathlib import Path

from conftest import REPO
from tests.support.imports import cycles, graph, upward

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


def test_bootstrap_and_base_import_only_the_standard_library_and_the_layers_below():
    """run.sh's start-up code runs before the zipapp's sys.path is complete, and the packer
    imports it: runtime/bootstrap/ may import nothing but the standard library, its siblings and
    runtime/base/ (stdlib-only itself: the preemption handler is installed first thing), plus
    early.py's hand-over to shiv's bootstrap."""
    import sys

    offenders = {}
    for folder, allowed in (("bootstrap", ("runtime.bootstrap", "runtime.base")), ("base", ("runtime.base",))):
        for p in sorted((REPO / "runtime" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] if node.level == 0 else [f"runtime.{folder}"]
                for name in names:
                    ok = (name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
                          or (p.name == "early.py" and name == "_bootstrap")  # shiv's, beside it at the archive's root
                          or any(name == a or name.startswith(a + ".") for a in allowed))
                    if not ok:
                        offenders.setdefault(f"{folder}/{p.name}", []).append(name)
    assert offenders == {}
    assert (REPO / "runtime" / "bootstrap" / "manifest.py").exists()


def test_no_module_level_active_bundle():
    """The bundle travels as a value (cli.main(argv, bundle=...), Invocation.bundle), never a global."""
    for p in sorted((REPO / "runtime").rglob("*.py")):
        text = p.read_text()
        assert "_Active" not in text and "os.chdir" not in text, p


MAX_MODULE_LINES = 400  # past this a module is split (docs/architecture.md)


def test_folders_depend_one_way_down_the_layers():
    """base < bootstrap < state < models < data < engines < trackers < core < config < jobs < commands < cli
    (tests/support/imports.py): no module imports a folder above its own, imports inside
    functions counted."""
    assert upward(graph()) == []


def test_the_layer_check_sees_an_upward_import_even_inside_a_function():
    lazy = "def f():\n    from runtime.jobs import tune\n    return tune\n"
    assert upward(graph({"runtime.base.signals": lazy})) == [
        "runtime.base.signals -> runtime.jobs.tune (base imports jobs, a layer above it)"]
    assert upward(graph({"runtime.models.arch": "import runtime.engines.torch.models.llama\n"}))[0].startswith(
        "runtime.models.arch -> runtime.engines.torch.models.llama (models imports engines")


def framework_reaches(g: dict[str, set[str]], folder: str) -> list[str]:
    """Imports from runtime/<folder>/ into one framework's engine (runtime.engines.torch / .mlx)."""
    return sorted(f"{m} -> {d}" for m, deps in g.items() if m.startswith(f"runtime.{folder}.")
                  for d in deps if d.startswith(("runtime.engines.torch", "runtime.engines.mlx")))


def test_the_job_core_reaches_an_engine_only_through_the_registry():
    """core/ is framework-free: an engine, its process group and its group launcher are looked up
    by name in runtime/engines/registry.py, never imported from a framework's folder, not even
    inside a function."""
    assert framework_reaches(graph(), "core") == []
    lazy = "def f():\n    from runtime.engines.torch.launcher import run_group\n    return run_group\n"
    assert framework_reaches(graph({"runtime.core.launch": lazy}), "core") == [
        "runtime.core.launch -> runtime.engines.torch.launcher"]


def test_no_import_cycles_counting_imports_inside_functions():
    """A factory's lazy import (a store by URI scheme, an engine by name, a model file by
    architecture) is still a dependency: the one that would close a cycle lives above both."""
    assert cycles(graph(tops=("runtime", "spillpack"))) == []
    assert cycles(graph({"runtime.state.store": "def f():\n    from runtime.state.uri import open_store\n"})) == [
        ["runtime.state.s3", "runtime.state.store", "runtime.state.uri"]]


def test_no_module_over_the_size_limit():
    long = {str(p.relative_to(REPO)): n for top in ("runtime", "spillpack") for p in sorted((REPO / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def documented_modules() -> dict[str, set[str]]:
    """folder -> the module files docs/architecture.md's tree names on that folder's lines."""
    text = (REPO / "docs" / "architecture.md").read_text()
    tree = text.split("## The tree", 1)[1].split("```")[1]
    out, folder = {}, None
    for line in tree.splitlines():
        if line and not line.startswith(" "):
            folder = line.split()[0].rstrip("/")
        if folder:
            out.setdefault(folder, set()).update(re.findall(r"\b([a-z_0-9]+)\.py\b", line))
    return out


def test_every_module_is_named_in_the_architecture_doc():
    named = documented_modules()
    missing = sorted(str(p.relative_to(REPO)) for top in ("runtime", "spillpack") for p in (REPO / top).rglob("*.py")
                     if p.name != "__init__.py" and p.stem not in named.get(str(p.parent.relative_to(REPO)), set()))
    assert missing == []
    stale = sorted(f"{folder}/{m}.py" for folder, mods in named.items() if folder.startswith(("runtime", "spillpack"))
                   for m in mods if not (REPO / folder / f"{m}.py").exists())
    assert stale == []


def test_docstring_paths_name_files_that_exist():
    """A path such as runtime/x/y.py written in a docstring or comment is a file of the tree."""
    stale = {}
    for p in sorted(p for top in ("runtime", "spillpack") for p in (REPO / top).rglob("*.py")):
        for ref in re.findall(r"\b((?:runtime|spillpack)/[a-z_0-9/]+\.py)\b", p.read_text()):
            if not (REPO / ref).exists():
                stale.setdefault(str(p.relative_to(REPO)), []).append(ref)
    assert stale == {}


def test_the_job_core_and_the_cli_import_without_any_framework(tmp_path):
    """The job core names no engine's framework: with torch and mlx unimportable, the core,
    the job commands' registry and the CLI still import (a framework comes in with its engine)."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\nsys.modules["mlx"] = None\n')
    code = ("import sys, runtime.core.job, runtime.cli, runtime.jobs.tune, runtime.jobs.rowjob\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None], 'torch imported'\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
