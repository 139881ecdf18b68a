"""The import graph of runtime/, read from the source with ast: every import statement,
those inside functions included (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top: a folder may import its own modules and the folders below it, never one above.
LAYERS = ("base", "bootstrap", "state", "models", "data", "engines", "trackers", "core", "config", "jobs", "commands", "cli")
# runtime/*.py: the package root holds only the version (every import of runtime.x runs it);
# the others are the command line and the entry points, on top.
ROOT_MODULES = {"runtime": None, "runtime.cli": "cli", "runtime.entry": "cli", "runtime.__main__": "cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(overrides: dict[str, str] | None = None, tops=("runtime",)) -> dict[str, tuple[str, bool]]:
    """module -> (source, is_package) under `tops`, with `overrides` (module -> source) laid over the tree."""
    out = {module_name(p): (p.read_text(), p.name == "__init__.py") for top in tops for p in sorted((ROOT / top).rglob("*.py"))}
    for mod, src in (overrides or {}).items():
        out[mod] = (src, out.get(mod, ("", False))[1])
    return out


def imports(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The runtime modules `module` imports anywhere in its body (`from pkg import sub` names sub)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (prefix, node.module or "") if p)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in {k.split(".")[0] for k in known}}
    return found


def graph(overrides: dict[str, str] | None = None, tops=("runtime",)) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name that is not a module counts as its package)."""
    found = sources(overrides, tops)
    known = set(found)

    def module_of(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    return {m: {module_of(t) for t in imports(m, src, pkg, known)} - {m, ""} for m, (src, pkg) in found.items()}


def layer(module: str) -> str | None:
    """The runtime layer `module` is in (None: the package root, or not a runtime module)."""
    if not module.startswith("runtime"):
        return None
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    return module.split(".")[1]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of a folder above the importer's, as 'importer -> imported (layer < layer)'."""
    out = []
    for mod, targets in sorted(g.items()):
        lo = layer(mod)
        for t in sorted(targets):
            hi = layer(t)
            if lo is None or hi is None or hi == lo:
                continue
            if LAYERS.index(hi) > LAYERS.index(lo):
                out.append(f"{mod} -> {t} ({lo} imports {hi}, a layer above it)")
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Module-level import cycles (Tarjan's strongly connected components of more than one module)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1
        stack.append(v); on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out
