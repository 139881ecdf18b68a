"""README, docs and the code's comments are for users and readers of the code: what was tried,
when it was measured and which ticket asked for it belong in git log. This test reads every
Markdown page and every comment and docstring of the tree and fails on a ticket number, a
commit hash, a date or a reference to a development round."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("runtime", "spillpack", "benchmarks", "tests", "examples", "docker", ".ci")
SKIP_DIRS = {".venv", ".venv-sky", ".venv-mlflow", "__pycache__", "node_modules", ".git", "golden"}

PATTERNS = {
    "a ticket number": re.compile(r"(?i)\b(?:issues?|tasks?|tickets?)\s*#?\d+|(?<![\w&/])#\d+\b"),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a development round": re.compile(r"(?i)\b(?:this|last|previous|earlier|next) (?:round|session)s?\b"),
}


def findings(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in PATTERNS.items() for m in rx.finditer(text)]


def python_prose(source: str) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file, with their line numbers; string literals
    the code uses (test data such as a fake digest) are not prose."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def shell_prose(source: str) -> list[tuple[int, str]]:
    return [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1)
            if "#" in line and not line.lstrip().startswith("#!")]


def files(pattern: str, dirs=CODE_DIRS):
    for d in dirs:
        for p in sorted((REPO / d).rglob(pattern)):
            if not SKIP_DIRS.intersection(p.relative_to(REPO).parts):
                yield p


def prose_of_tree() -> list[tuple[str, int, str]]:
    out = []
    for p in [REPO / "README.md", *files("*.md", ("docs", *CODE_DIRS))]:
        out += [(str(p.relative_to(REPO)), i, line) for i, line in enumerate(p.read_text().splitlines(), 1)]
    for p in files("*.py"):
        out += [(str(p.relative_to(REPO)), i, text) for i, text in python_prose(p.read_text())]
    shells = [*files("*.sh"), REPO / "Makefile", REPO / "Containerfile", REPO / ".ci" / "run"]
    for p in (p for p in shells if p.is_file()):
        out += [(str(p.relative_to(REPO)), i, text) for i, text in shell_prose(p.read_text())]
    return out


def test_the_scanner_finds_each_kind():
    text = "as issue 12 asked (#31), measured at 1c40608 on 2026-05-01 in this round"
    assert [f.split(":")[0] for f in findings(text)] == ["a ticket number", "a ticket number", "a commit hash",
                                                         "a date", "a development round"]
    # what docs legitimately say: anchors, counts, sizes, a SHA-256 digest, a seed
    assert findings("see [GGUF](models.md#gguf-files), 64 rows, 1.5x, 3f2b" + "a1" * 32 + ", seed 20240613") == []


def test_python_prose_is_comments_and_docstrings_only():
    src = '"""Module doc, issue 7."""\nX = "deadbeef1234"  # comment 1c40608\n'
    assert [findings(t) for _, t in python_prose(src)] == [["a commit hash: '1c40608'"], ["a ticket number: 'issue 7'"]]


def test_readme_docs_and_comments_carry_no_history():
    found = [f"{path}:{line}: {what}" for path, line, text in prose_of_tree() for what in findings(text)]
    if found:
        pytest.fail("history belongs in git log, not here:\n" + "\n".join(found[:40]))
