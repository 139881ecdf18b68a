"""The local Ollama store: a tag resolves offline to its GGUF blob, checked against its digest.

The store is built in a temporary directory exactly as Ollama lays it out (manifests/<host>/
<namespace>/<model>/<tag> holding a Docker distribution manifest; blobs/sha256-<hex> for the
config, the model and the template layers), with the real SmolLM2-135M GGUF as the model blob.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import events_of, run_cli
from tests.support.real_model import smollm2_gguf
from runtime.base.errors import SpillpackError
from runtime.models import ollama

TEMPLATE = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"


def _blob(root: Path, data: bytes | None = None, source: Path | None = None) -> dict:
    h = hashlib.sha256()
    if source is not None:
        with open(source, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        size = source.stat().st_size
    else:
        h.update(data)
        size = len(data)
    path = root / "blobs" / f"sha256-{h.hexdigest()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        if source is not None:
            try:
                os.link(source, path)  # same bytes, no 98 MB copy where the file system allows it
            except OSError:
                shutil.copyfile(source, path)
        else:
            path.write_bytes(data)
    return {"digest": f"sha256:{h.hexdigest()}", "size": size, "path": path}


def add_model(root: Path, host: str, namespace: str, model: str, tag: str, gguf: Path) -> Path:
    """One model as `ollama pull` leaves it: the GGUF, a template and a config layer, and the manifest."""
    weights = _blob(root, source=gguf)
    template = _blob(root, TEMPLATE.encode())
    config = _blob(root, json.dumps({"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
                                     "model_type": "134.52M", "file_type": "Q4_1", "architecture": "amd64", "os": "linux",
                                     "rootfs": {"type": "layers", "diff_ids": [weights["digest"], template["digest"]]}}).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": config["digest"], "size": config["size"]},
                "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": weights["digest"], "size": weights["size"]},
                           {"mediaType": "application/vnd.ollama.image.template", "digest": template["digest"], "size": template["size"]}]}
    path = root / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return weights["path"]


@pytest.fixture
def store(tmp_path, home, monkeypatch):
    root = tmp_path / "ollama-models"
    gguf = smollm2_gguf()
    blob = add_model(root, "registry.ollama.ai", "library", "smollm2", "135m", gguf)
    add_model(root, "registry.ollama.ai", "library", "smollm2", "latest", gguf)
    add_model(root, "registry.ollama.ai", "someone", "smol", "q4", gguf)
    add_model(root, "hf.co", "bartowski", "SmolLM2-135M-Instruct-GGUF", "Q4_1", gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root, blob


def test_names_resolve_as_ollama_lays_them_out(store):
    root, blob = store
    digest = "sha256:" + hashlib.sha256(smollm2_gguf().read_bytes()).hexdigest()
    for name, manifest in [("smollm2:135m", "registry.ollama.ai/library/smollm2/135m"),
                           ("smollm2", "registry.ollama.ai/library/smollm2/latest"),
                           ("someone/smol:q4", "registry.ollama.ai/someone/smol/q4"),
                           ("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/Q4_1")]:
        found = ollama.find(name)
        assert found.manifest == root / "manifests" / manifest and found.blob == blob and found.digest == digest, name
        assert found.family == "llama" and found.file_type == "Q4_1"
    assert ollama.find("smollm2:1.7b") is None and ollama.find("qwen2.5:7b") is None
    assert ollama.parse_name("/abs/path") is None and ollama.parse_name("s3://b/k") is None


def test_a_store_tag_loads_as_the_gguf(store):
    from runtime.models.ref import resolve_model

    root, blob = store
    model = resolve_model("smollm2:135m")
    assert model.path == blob.resolve() and model.is_gguf and model.arch == "llama"
    assert model.config["hidden_size"] == 576 and model.config["num_hidden_layers"] == 30 and model.config["vocab_size"] == 49152
    # the blob has no .gguf suffix: the tokenizer and the weights are still read from it as a GGUF
    from runtime.models.tokenizer import Tokenizer
    from runtime.models.weights import tensor_shapes, weight_files

    assert weight_files(model.path) == [model.path]
    assert tensor_shapes([model.path])["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    text = "What is the capital of France?"
    assert Tokenizer.from_dir(model.path).encode(text) == Tokenizer.from_dir(smollm2_gguf()).encode(text)
    # a known tag whose store copy is another architecture is refused, naming both
    (root / "manifests/registry.ollama.ai/library/qwen2.5").mkdir(parents=True)
    shutil.copy(root / "manifests/registry.ollama.ai/library/smollm2/135m", root / "manifests/registry.ollama.ai/library/qwen2.5/7b")
    with pytest.raises(SpillpackError, match="holds a llama model, but the tag expects 'qwen2'"):
        resolve_model("qwen2.5:7b")


def test_models_marks_what_the_store_holds(store):
    root, blob = store
    p = run_cli(["models", "--headless"])
    assert p.returncode == 0, p.stderr
    rows = {e["name"]: e for e in events_of(p.stdout)}
    assert rows["smollm2:135m"]["here"] == str(blob) and rows["smollm2:135m"]["arch"] == "llama"
    assert rows["smollm2:135m"]["ollama"] == "registry.ollama.ai/library/smollm2:135m"
    assert rows["someone/smol:q4"]["here"] == str(blob)
    assert rows["hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1"]["here"] == str(blob)
    assert rows["qwen2.5:7b"]["here"] is None  # a known tag the store does not hold
    human = run_cli(["models"], env={"SPILLPACK_HEADLESS": "0"})
    assert f"{blob} (Ollama: registry.ollama.ai/library/smollm2:135m)" in human.stdout


def test_emit_config_records_the_verified_blob_and_pack_carries_it(store, tmp_path, phome):
    root, blob = store
    rows = tmp_path / "q.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                                         "max_tokens": 12}}) + "\n")
    cfg = tmp_path / "run.json"
    p = run_cli(["run", "smollm2:135m", str(rows), "--state", str(tmp_path / "state"), "--emit-config", str(cfg)])
    assert p.returncode == 0, p.stderr
    config = json.loads(cfg.read_text())
    assert config["arguments"]["model"] == "smollm2:135m" and config["options"]["weights"] == str(blob)
    assert "SHA-256 checked" in p.stderr

    refused = run_cli(["pack", str(cfg), "-o", str(tmp_path / "no-bundle")])
    assert refused.returncode == 1 and not (tmp_path / "no-bundle").exists()
    line = refused.stderr.strip()
    assert line.count("\n") == 0 and "from the local Ollama store" in line and "--include-weights" in line and "aws s3 cp" in line

    p = run_cli(["pack", str(cfg), "-o", str(tmp_path / "bundle"), "--include-weights"])
    assert p.returncode == 0, p.stderr
    carried = tmp_path / "bundle" / "files" / "weights" / "smollm2-135m" / "smollm2-135m.gguf"
    assert carried.read_bytes() == smollm2_gguf().read_bytes()  # the GGUF as it is, not dequantized
    job = json.loads((tmp_path / "bundle" / "files" / "job.json").read_text())
    assert job["options"]["weights"] == "files/weights/smollm2-135m"
    manifest = json.loads((tmp_path / "bundle" / "MANIFEST.json").read_text())
    assert manifest["files"]["files/weights/smollm2-135m/smollm2-135m.gguf"]["sha256"] == blob.name.removeprefix("sha256-")


def test_a_tag_the_store_holds_is_known_and_others_are_not(store, tmp_path):
    rows = tmp_path / "q.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    p = run_cli(["run", "nothere:1b", str(rows), "--emit-config", str(tmp_path / "x.json")])
    assert p.returncode == 1 and "unknown model tag 'nothere:1b'" in p.stderr and "not in the Ollama store at" in p.stderr
    assert not (tmp_path / "x.json").exists()


def _emit(tmp_path, name="smollm2:135m"):
    rows = tmp_path / "q.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    return run_cli(["run", name, str(rows), "--emit-config", str(tmp_path / "bad.json")])


@pytest.mark.parametrize("damage", ["missing", "corrupted", "truncated", "not json", "no model layer", "bad digest"])
def test_a_damaged_store_is_one_line(damage, store, tmp_path):
    root, blob = store
    manifest = root / "manifests/registry.ollama.ai/library/smollm2/135m"
    if damage in ("missing", "corrupted", "truncated"):
        # the other tags share the blob: give this tag a copy of its own to damage
        data = bytearray(blob.read_bytes())
        own = blob.parent / ("sha256-" + "0" * 64)
        if damage == "corrupted":
            data[len(data) // 2] ^= 0xFF
        if damage == "truncated":
            del data[-1000:]
        if damage != "missing":
            own.write_bytes(bytes(data))
        m = json.loads(manifest.read_text())
        m["layers"][0]["digest"] = "sha256:" + "0" * 64
        manifest.write_text(json.dumps(m))
    elif damage == "not json":
        manifest.write_text("{not json")
    elif damage == "no model layer":
        m = json.loads(manifest.read_text())
        m["layers"] = m["layers"][1:]
        manifest.write_text(json.dumps(m))
    else:
        m = json.loads(manifest.read_text())
        m["layers"][0]["digest"] = "md5:1234"
        manifest.write_text(json.dumps(m))
    p = _emit(tmp_path)
    line = p.stderr.strip()
    assert p.returncode == 1 and line.count("\n") == 0 and line.startswith("spillpack: ") and "Try: " in line, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "bad.json").exists()
    want = {"missing": "which is missing from", "corrupted": "is corrupted: its SHA-256 is", "truncated": "(truncated or replaced)",
            "not json": "is not a valid manifest", "no model layer": "has no layer of media type application/vnd.ollama.image.model",
            "bad digest": "not a sha256 digest"}[damage]
    assert want in line, line


def test_verification_is_remembered_and_redone_when_the_blob_changes(store, home):
    root, blob = store
    found = ollama.find("smollm2:135m")
    seal = home / "cache" / "ollama" / f"{blob.name}.verified"
    assert seal.is_file()
    seal.write_text("0 0 0")  # a stale verdict: hashed again (and still good)
    assert ollama.find("smollm2:135m") == found and seal.read_text() != "0 0 0"


@pytest.mark.slow
def test_a_store_tag_runs_end_to_end_from_a_bundle(store, tmp_path, phome):
    """`run smollm2:135m` packed with --include-weights and run from the bundle: the real model answers."""
    from conftest import clean_env

    rows = tmp_path / "q.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                                         "max_tokens": 12}}) + "\n")
    cfg = tmp_path / "run.json"
    assert run_cli(["run", "smollm2:135m", str(rows), "--state", str(tmp_path / "state"), "--out", str(tmp_path / "out.jsonl"),
                    "--emit-config", str(cfg)]).returncode == 0
    assert run_cli(["pack", str(cfg), "-o", str(tmp_path / "bundle"), "--include-weights"]).returncode == 0
    import subprocess

    # float32: in bfloat16 (auto on a CPU with native bfloat16) this answer's first token is a near
    # tie that may turn (docs/models.md); the answer checked is float32's.
    env = clean_env(phome, {"OLLAMA_MODELS": str(tmp_path / "no-store-here"), "SPILLPACK_HEADLESS": "1",
                            "SPILLPACK_DTYPE": "float32"})
    p = subprocess.run([str(tmp_path / "bundle" / "run.sh")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    answer = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["response"]["body"]["choices"][0]["message"]["content"]
    print(f"smollm2:135m from the bundle: {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow
def test_tune_on_a_store_tag_exports_gguf_that_transformers_reads(store, tmp_path):
    """End to end on the real model from the store: tune smollm2:135m with --merge --gguf, then
    `export` its state: the GGUF (f32) reads back in transformers with the merged model's logits,
    the tokenizer keys are the base GGUF's own, and the adapter GGUF holds the PEFT adapter."""
    import gguf
    import numpy as np
    import torch
    import transformers

    from tests.test_gguf_export import adapter_check

    state, tuned = tmp_path / "state", tmp_path / "tuned.gguf"
    p = run_cli(["tune", "smollm2:135m", "examples/data/train.jsonl", "--steps", "2", "--batch", "2", "--max-seq", "96",
                 "--lr", "1e-3", "--state", str(state), "--merge", "--gguf", str(tuned), "--gguf-type", "f32"], timeout=1200)
    assert p.returncode == 0, p.stderr
    merged = state / "adapter" / "merged"
    adapter = tmp_path / "adapter.gguf"
    p = run_cli(["export", str(state), "--gguf-adapter", str(adapter)], timeout=600)
    assert p.returncode == 0, p.stderr
    ids = torch.tensor(np.random.default_rng(2).integers(0, 49152, size=(1, 24)))
    with torch.no_grad():
        exact = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(str(tuned.parent), gguf_file=tuned.name, dtype=torch.float32)(ids).logits
    diff = (got - exact).abs().max().item()
    print(f"smollm2:135m tuned 2 steps, tune --gguf f32 against the merged safetensors model: max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    base = {k: v.contents() for k, v in gguf.GGUFReader(smollm2_gguf()).fields.items() if k.startswith("tokenizer.")}
    ours = {k: v.contents() for k, v in gguf.GGUFReader(tuned).fields.items() if k.startswith("tokenizer.")}
    assert ours == base and ours["tokenizer.ggml.pre"] == "smollm"
    config = json.loads((merged / "config.json").read_text())
    assert adapter_check(state / "adapter", adapter, config) == 60  # q and k of 30 layers: B permuted for llama.cpp
