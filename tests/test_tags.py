"""Every tag a user types resolves to an architecture and its Hugging Face repository, is listed
by `spillpack models`, and is checked where the job is written down."""

import json

import pytest

from runtime.models.arch import ARCHITECTURES
from runtime.models.ref import TAGS
from tests.conftest import events_of, run_cli
from tests.support.hf_fixtures import make_qwen2

ISSUE_TAGS = ([f"qwen2.5:{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b")]
              + [f"qwen3:{s}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b", "30b-a3b")]
              + ["llama3.2:1b", "llama3.2:3b", "llama3.1:8b"] + [f"gemma3:{s}" for s in ("1b", "4b", "12b", "27b")]
              + ["mistral:7b", "phi4-mini", "phi3.5-mini"])


def test_every_tag_names_a_supported_architecture_and_a_repo():
    assert set(ISSUE_TAGS) <= set(TAGS)
    for tag, t in TAGS.items():
        assert t.arch in ARCHITECTURES, tag
        assert t.hf_repo.count("/") == 1, tag
    assert TAGS["qwen3:30b-a3b"].arch == "qwen3_moe" and TAGS["phi4-mini"].arch == "phi3"
    assert TAGS["gemma3:1b"].arch == "gemma3_text" and TAGS["gemma3:27b"].arch == "gemma3"


def test_models_lists_every_tag_with_its_repo(home):
    r = run_cli(["models"])
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in events_of(r.stdout)}
    for tag in ISSUE_TAGS:
        assert rows[tag]["arch"] == TAGS[tag].arch and rows[tag]["hf_repo"] == TAGS[tag].hf_repo, tag
    human = run_cli(["models"], env={"SPILLPACK_HEADLESS": "0"})
    assert "qwen3:30b-a3b  qwen3_moe" in human.stdout and "google/gemma-3-4b-it" in human.stdout


def test_emit_config_refuses_an_unknown_tag_on_the_laptop(home, tmp_path):
    cfg = tmp_path / "job.json"
    r = run_cli(["tune", "qwen9:7b", "examples/data/train.jsonl", "--emit-config", str(cfg)])
    assert r.returncode == 1 and not cfg.exists()
    assert "unknown model tag 'qwen9:7b' (known: tiny, qwen2.5:0.5b," in r.stderr and "Traceback" not in r.stderr
    r = run_cli(["build", "examples/data", "--teacher", "llama9:1b", "--emit-config", str(cfg)])
    assert r.returncode == 1 and "unknown model tag 'llama9:1b'" in r.stderr
    r = run_cli(["tune", "qwen2.5:7b", "examples/data/train.jsonl", "--weights", "s3://bucket/qwen7b", "--emit-config", str(cfg)])
    assert r.returncode == 0, r.stderr
    assert json.loads(cfg.read_text())["arguments"]["model"] == "qwen2.5:7b"


@pytest.mark.slow
def test_the_readme_example_emits_packs_and_runs_with_weights_of_that_architecture(home, tmp_path):
    """`spillpack tune qwen2.5:7b train.jsonl --weights DIR`: emitted, packed, and run from the
    bundle with a (small, random) Qwen2 directory standing in for the 7B weights."""
    weights, _ = make_qwen2(tmp_path / "qwen2.5-7b")
    cfg = tmp_path / "tune.json"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(open("examples/data/train.jsonl").readlines()[:16]))
    r = run_cli(["tune", "qwen2.5:7b", str(data), "--weights", str(weights), "--steps", "2", "--batch", "2",
                 "--name", "q7", "--emit-config", str(cfg)])
    assert r.returncode == 0, r.stderr
    r = run_cli(["pack", str(cfg), "-o", str(tmp_path / "b")], timeout=600)
    assert r.returncode == 0, r.stderr
    import subprocess
    import sys
    from pathlib import Path

    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "SPILLPACK_HOME": str(home),
           "TMPDIR": str(tmp_path), "SPILLPACK_METADATA_URL": "http://127.0.0.1:9"}
    r = subprocess.run([str(tmp_path / "b" / "run.sh")], capture_output=True, text=True, env=env, cwd="/", timeout=600)
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["complete"] and done["steps"] == 2
    assert (home / "jobs" / "q7" / "adapter" / "adapter_model.safetensors").is_file()
