"""A GGUF job packed and run elsewhere: the bundle's zipapp carries the gguf package (and the
yaml it imports), and the bundle's run on a clean node gives the rows of a direct run."""

import json
import zipfile

import pytest

from conftest import clean_env, run_cli
from tests.support.gguf_files import write_minimal
from runtime.models.tiny import ensure_tiny
from test_pack import new_home, run_bundle


@pytest.mark.slow
def test_packed_gguf_run_equals_direct_run(phome, tmp_path, tiny_home):
    model = tmp_path / "src" / "model"
    model.mkdir(parents=True)
    write_minimal(model / "m.gguf", ensure_tiny(), qtype="Q8_0")
    rows = tmp_path / "src" / "rows.jsonl"
    rows.write_text("".join(json.dumps({"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"say {i}"}],
                                                                        "max_tokens": 6}}) + "\n" for i in range(3)))
    job = ["run", str(model), str(rows), "--name", "g"]
    direct = run_cli([*job, "--state", str(tmp_path / "direct")])
    assert direct.returncode == 0, direct.stderr

    r = run_cli(["pack", *job, "--include-weights", "-o", str(tmp_path / "b")])
    assert r.returncode == 0, r.stderr
    names = zipfile.ZipFile(tmp_path / "b" / "spillpack.pyz").namelist()
    assert any(n.endswith("site-packages/gguf/quants.py") for n in names)
    assert any("/yaml/" in n and n.endswith("__init__.py") for n in names)
    assert (tmp_path / "b" / "files" / "weights" / "model" / "m.gguf").read_bytes() == (model / "m.gguf").read_bytes()

    home = new_home(tmp_path, tiny_home, "node")
    ran = run_bundle(tmp_path / "b", env=clean_env(home))
    assert ran.returncode == 0, ran.stderr

    def answers(path):
        return [(d["custom_id"], d["response"]["body"]["choices"][0]["message"]["content"])
                for d in map(json.loads, path.read_text().splitlines())]

    assert answers(home / "jobs" / "g" / "results.jsonl") == answers(tmp_path / "direct" / "results.jsonl")
