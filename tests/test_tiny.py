"""The built-in tiny model is the same bytes every time, and two processes can build it at once."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[1]


def digests(d: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_built_twice_is_byte_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "a"))
    first = digests(ensure_tiny())
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "b"))
    second = digests(ensure_tiny())
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors", "spillpack_tiny.json",
                          "tokenizer.json", "tokenizer_config.json"}
    assert first == second


def test_layout_is_an_ordinary_hf_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path))
    d = ensure_tiny()
    assert d == tmp_path / "models" / "tiny"
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert 990 <= config["vocab_size"] <= 1010 and config["hidden_size"] == 128 and config["num_hidden_layers"] == 4
    assert (d / "model.safetensors").stat().st_size < 5_000_000
    assert "<|im_start|>" in json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    # no temporary build directories left beside it
    assert sorted(p.name for p in d.parent.iterdir() if not p.name.startswith(".tiny.lock")) == ["tiny"]


def test_second_call_reuses_and_stale_version_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path))
    d = ensure_tiny()
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny() == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    (d / "spillpack_tiny.json").write_text('{"version": 0}')
    (d / "model.safetensors").write_bytes(b"junk")
    good = digests(ensure_tiny())
    assert good["model.safetensors"] != hashlib.sha256(b"junk").hexdigest()


def test_concurrent_builds_agree(tmp_path):
    env = {**os.environ, "SPILLPACK_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    code = "from runtime.models.tiny import ensure_tiny; print(ensure_tiny())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / "models" / "tiny")
    monkey_home = tmp_path / "check"
    env["SPILLPACK_HOME"] = str(monkey_home)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert digests(tmp_path / "models" / "tiny") == digests(monkey_home / "models" / "tiny")
