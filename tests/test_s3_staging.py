"""Weights from s3:// staged once into SPILLPACK_HOME/cache, keyed by ETag and size; a download
killed half-way never counts as cached."""

import json
import os
import signal
import subprocess
import sys

import pytest

from runtime.base.errors import SpillpackError
from runtime.models.ref import resolve_model
from runtime.state.staging import MANIFEST, cache_dir, stage
from tests.conftest import REPO
from tests.support.s3_fixtures import fault_proxy, s3, s3_uri  # noqa: F401


def upload_dir(s3, uri, local):
    prefix = uri[len(f"s3://{s3.bucket}/"):]
    for f in sorted(local.iterdir()):
        s3.put(f"{prefix}/{f.name}", f.read_bytes())


@pytest.fixture
def tiny_on_s3(home, s3, s3_uri):
    local = home / "models" / "tiny"
    uri = s3_uri + "/weights/tiny"
    upload_dir(s3, uri, local)
    return uri, local


def test_weights_are_staged_once_and_load_like_local(tiny_on_s3, fault_proxy, monkeypatch):
    uri, local = tiny_on_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    staged = resolve_model(uri)
    assert staged.fingerprint() == resolve_model(str(local)).fingerprint()
    for f in local.iterdir():
        assert (staged.path / f.name).read_bytes() == f.read_bytes()
    gets = fault_proxy.count("GET", r"/weights/tiny/[^?]")
    assert gets == len(list(local.iterdir()))
    # A restart on the same machine: only the listing is read again.
    assert resolve_model("qwen2.5:0.5b", uri).path == staged.path
    assert fault_proxy.count("GET", r"/weights/tiny/[^?]") == gets


def test_changed_object_is_fetched_again_and_only_it(tiny_on_s3, s3, fault_proxy, monkeypatch):
    uri, local = tiny_on_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    dest = stage(uri)
    cfg = json.loads((local / "config.json").read_text())
    cfg["spillpack_note"] = "changed"
    s3.put(uri[len(f"s3://{s3.bucket}/"):] + "/config.json", json.dumps(cfg).encode())
    before = fault_proxy.count("GET", r"/weights/tiny/[^?]")
    assert stage(uri) == dest
    assert fault_proxy.count("GET", r"/weights/tiny/[^?]") == before + 1
    assert fault_proxy.count("GET", r"/weights/tiny/config\.json") == 2
    assert json.loads((dest / "config.json").read_text())["spillpack_note"] == "changed"


def test_download_killed_half_way_is_not_cached(tiny_on_s3, fault_proxy, home):
    uri, local = tiny_on_s3
    held = fault_proxy.stall(r"/weights/tiny/model\.safetensors", method="GET")
    env = {**os.environ, "AWS_ENDPOINT_URL": fault_proxy.endpoint, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", f"from runtime.state.staging import stage; stage({uri!r})"], env=env, cwd=REPO)
    try:
        assert held.arrived.wait(120), "the download never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        held.release()
    dest = cache_dir(uri, "weights")
    assert not (dest / "model.safetensors").exists()
    assert "model.safetensors" not in json.loads((dest / MANIFEST).read_text() if (dest / MANIFEST).exists() else "{}")
    assert stage(uri) == dest
    assert (dest / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert not list(dest.rglob("*.tmp"))


def test_empty_prefix_is_one_line(s3_uri, home):
    with pytest.raises(SpillpackError) as e:
        resolve_model(s3_uri + "/no/weights/here")
    assert f"nothing under {s3_uri}/no/weights/here" in e.value.line() and f"aws s3 ls {s3_uri}/no/weights/here/" in e.value.line()
