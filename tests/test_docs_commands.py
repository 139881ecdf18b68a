"""The commands the docs show are the commands that work: README.md's quick start and
docs/commands.md's examples run as written on `tiny` (a block that cannot run here says why in a
`<!-- not run: ... -->` line above it), every `spillpack` line of every shell block in README.md
and docs/ parses with today's options, and each command's --help ends with its example."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, events_of
from runtime.base.errors import UsageError
from runtime.cli import build_parser
from spillpack.cli import LAPTOP_COMMANDS

SKIP = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
RUN = {"README.md": ("Quick start", "Walk-through: a real model"), "docs/commands.md": ("Examples",)}


def sh_blocks(path: Path) -> list[tuple[str, str, str | None]]:
    """(section, text, why it is not run) of each ```sh block, section being its `## ` heading."""
    blocks, section, lines, i = [], "", path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        elif lines[i].strip() == "```sh":
            end = lines.index("```", i + 1)
            before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            why = m.group(1) if (m := SKIP.match(before)) else None
            blocks.append((section, "\n".join(lines[i + 1:end]) + "\n", why))
            i = end
        i += 1
    return blocks


def spillpack_lines(text: str) -> list[list[str]]:
    """Each `spillpack ...` command of a block as argv, continuation lines joined, comments dropped."""
    return [argv for line in text.replace("\\\n", " ").splitlines()
            if (argv := shlex.split(line, comments=True)) and argv[0] == "spillpack"]


def parses(argv: list[str]) -> str | None:
    try:
        build_parser(LAPTOP_COMMANDS).parse_args(argv[1:])
    except UsageError as e:
        return e.what
    return None


def documented() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]


def test_the_run_sections_hold_blocks_and_every_skipped_one_says_why(tmp_path):
    for name, sections in RUN.items():
        blocks = [b for b in sh_blocks(REPO / name) if b[0] in sections]
        assert {b[0] for b in blocks} == set(sections), name
        assert any(why is None for _, _, why in blocks), name
    # The marker is read from the line right above a block only.
    fake = "## Quick start\n\n<!-- not run: needs a GPU -->\n```sh\nspillpack doctor\n```\n\n```sh\nspillpack models\n```\n"
    (tmp_path / "fake.md").write_text(fake)
    assert [why for _, _, why in sh_blocks(tmp_path / "fake.md")] == ["needs a GPU", None]


def test_every_spillpack_line_in_the_docs_parses_with_todays_options():
    seen, broken = 0, []
    for path in documented():
        for section, text, _ in sh_blocks(path):
            for argv in spillpack_lines(text):
                seen += 1
                if (what := parses(argv)) is not None:
                    broken.append(f"{path.relative_to(REPO)} ({section}): {shlex.join(argv)}: {what}")
    assert broken == []
    assert seen >= 20
    assert parses(["spillpack", "tune", "tiny", "t.jsonl", "--stepz", "3"]) is not None  # the check can fail


def test_every_command_lists_an_example_that_is_on_the_commands_page():
    parser = build_parser(LAPTOP_COMMANDS)
    commands = parser._subparsers._group_actions[0].choices
    page = (REPO / "docs" / "commands.md").read_text()
    examples = [b for b in sh_blocks(REPO / "docs" / "commands.md") if b[0] == "Examples"]
    lines = {shlex.join(argv) for _, text, _ in examples for argv in spillpack_lines(text)}
    top = parser.format_help()
    for name, sub in commands.items():
        last = sub.format_help().rstrip().splitlines()[-1].strip()
        assert shlex.split(last)[:2] == ["spillpack", name], (name, last)
        assert sub.format_help().rstrip().splitlines()[-2] == "example:", name
        assert parses(shlex.split(last)) is None, last
        assert last in lines and last in page, last
        assert f"\n    {name} " in top and f"\n  {last}\n" in top, name
    assert set(commands) == {"tune", "run", "eval", "distill", "build", "doctor", "export", "resume", "status",
                             "models", "pack"}


def run_blocks(name: str, tmp_path: Path) -> list[dict]:
    """The blocks of `name`'s run sections, in order, in one shell in a fresh directory that sees
    the repository's examples/; the JSON events of every command."""
    blocks = [text for section, text, why in sh_blocks(REPO / name) if section in RUN[name] and why is None]
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "SPILLPACK_HOME": str(tmp_path / "home"),
           "SPILLPACK_HEADLESS": "1", "SPILLPACK_METADATA_URL": os.environ.get("SPILLPACK_METADATA_URL", "http://127.0.0.1:9"),
           "SPILLPACK_THREADS": "1", "TMPDIR": str(tmp_path)}
    script = "set -euo pipefail\n" + "\n".join(blocks)
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return [e for line in r.stdout.splitlines() if line.startswith("{") for e in events_of(line)]


def done(events: list[dict], job: str) -> dict:
    """The `done` event of the command whose `start` named `job` (the events come in order)."""
    current = None
    for e in events:
        current = e.get("job", current) if e.get("event") == "start" else current
        if e.get("event") == "done" and current == job:
            return e
    raise AssertionError(f"no done event for {job}")


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path):
    events = run_blocks("README.md", tmp_path)
    # What the README says it shows: the example task from 0% before the tune to 100% after.
    assert done(events, "before")["accuracy"] == 0.0
    assert done(events, "after")["accuracy"] == 1.0
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"prompt-{i:03d}" for i in range(60)]
    assert (tmp_path / "out" / "mine" / "run.sh").exists() and (tmp_path / "tune.json").exists()


@pytest.mark.slow
def test_the_commands_page_examples_run_as_written(tmp_path):
    import gguf

    events = run_blocks("docs/commands.md", tmp_path)
    assert done(events, "mine")["steps"] == 20
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"prompt-{i:03d}" for i in range(60)]
    assert all(a["response"]["body"]["model"] == "tiny" for a in answers)
    distilled = [json.loads(line) for line in (tmp_path / "distilled.jsonl").read_text().splitlines()]
    assert len(distilled) == 60 and all(d["messages"][-1]["role"] == "assistant" for d in distilled)
    assert 0.0 <= done(events, "scored")["accuracy"] <= 1.0
    merged, lora = gguf.GGUFReader(tmp_path / "mine.gguf"), gguf.GGUFReader(tmp_path / "mine-lora.gguf")
    assert len(merged.tensors) > len(lora.tensors) > 0
    assert "#SBATCH" in (tmp_path / "out" / "packed.sbatch").read_text()
    assert (tmp_path / "out" / "packed" / "MANIFEST.json").exists()
