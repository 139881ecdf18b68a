"""examples/smollm2/walkthrough.sh as a user runs it, on the real SmolLM2-135M-Instruct GGUF: the
tuned model scores better than the base, the exports are GGUF files of the right kind, and the
batch file is answered once per row with the task's labels."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN
from tests.support.real_model import smollm2_gguf

sys.path.insert(0, str(REPO / "examples" / "data"))
import make_task  # noqa: E402  (the generator of the walk-through's files)


@pytest.mark.slow
def test_the_walkthrough_tunes_exports_and_answers(tmp_path):
    import gguf

    smollm2_gguf()  # installed, or the test fails saying how to install it; the script finds it itself
    work = tmp_path / "work"
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "WORK": str(work), "TMPDIR": str(tmp_path),
           "SPILLPACK_METADATA_URL": os.environ.get("SPILLPACK_METADATA_URL", "http://127.0.0.1:9"),
           "SPILLPACK_DTYPE": os.environ.get("SPILLPACK_DTYPE", "float32")}
    r = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "walkthrough.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])

    def last(name: str) -> dict:
        return json.loads((work / name).read_text().splitlines()[-1])
    before, after = last("before.jsonl"), last("after.jsonl")
    assert before["rows"] == after["rows"] == 60
    assert after["accuracy"] >= 0.9 and after["ci95"][0] > before["ci95"][1], (before, after)
    assert f"after   accuracy {after['accuracy']:.2f}" in r.stdout

    merged, lora = gguf.GGUFReader(work / "smol-q8_0.gguf"), gguf.GGUFReader(work / "smol-lora.gguf")
    assert bytes(merged.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in merged.tensors)
    assert bytes(lora.fields["adapter.type"].parts[-1]).decode() == "lora"

    gen = make_task.rows(random.Random(77))
    labels = [label for _, label in [next(gen) for _ in range(320)][260:]]
    answers = {json.loads(line)["custom_id"]: json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()}
    assert sorted(answers) == [f"prompt-{i:03d}" for i in range(60)]
    said = [answers[f"prompt-{i:03d}"]["response"]["body"]["choices"][0]["message"]["content"].strip().lower()
            for i in range(60)]
    assert sum(s == label for s, label in zip(said, labels)) >= 54, list(zip(said, labels))
