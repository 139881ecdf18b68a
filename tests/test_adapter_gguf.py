"""A LoRA adapter GGUF (llama.cpp's `--lora` file) as `--adapter` and `--init-adapter`: read back
into the tensors PEFT's adapter holds, and a run with it answers as the run with the PEFT
directory it was written from. The file is written by `gguf_write.write_adapter`, whose layout
tests/test_gguf_export.py checks against the `gguf` package's reader."""

import json
import os

import numpy as np
import pytest

from tests.conftest import events_of, one_line, run_cli
from tests.support.hf_fixtures import make_family
from tests.support.s3_fixtures import s3, s3_uri  # noqa: F401  (pytest fixtures)
from tests.test_multi_adapter import ALL, random_adapter
from runtime.base.errors import SpillpackError
from runtime.jobs import init_adapter
from runtime.models import gguf_write
from runtime.models.lora import save_adapter
from runtime.models.ref import resolve_model

pytest.importorskip("gguf")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_adapter_gguf_reads_back_the_adapter_it_was_written_from(family, tmp_path, home):
    """f32 exactly (llama's q and k updates un-permuted), f16 as float16 rounds each value."""
    path, _ = make_family(family, tmp_path / family, **({"rope_scaling": None} if family == "llama" else {}))
    md = resolve_model(str(path))
    tensors, spec = random_adapter(md.config, ALL, 4, 7)
    for kind in gguf_write.ADAPTER_TYPES:
        out = tmp_path / f"adapter-{kind}.gguf"
        gguf_write.write_adapter(out, tensors, spec.alpha, md.config, kind)
        got = init_adapter.load(str(out), md, {})
        assert got.kind == "gguf" and (got.spec.rank, got.spec.alpha, got.spec.targets) == (spec.rank, spec.alpha, tuple(sorted(ALL)))
        assert sorted(got.tensors) == sorted(tensors)
        for k, v in tensors.items():
            want = v if kind == "f32" else v.astype(np.float16).astype(np.float32)
            assert got.tensors[k].dtype == np.float32 and np.array_equal(got.tensors[k], want), (kind, k)


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    """tiny's PEFT adapter and the adapter GGUF of the same tensors, and a few rows."""
    tmp = tmp_path_factory.mktemp("adapter-gguf")
    md = resolve_model("tiny")
    tensors, spec = random_adapter(md.config, ALL, 4, 11)
    save_adapter(tmp / "peft", tensors, spec, "tiny", md.config["num_hidden_layers"])
    gguf_write.write_adapter(tmp / "tuned.gguf", tensors, spec.alpha, md.config)
    rows = [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"say {w}"}], "max_tokens": 12}}
            for i, w in enumerate(["hello", "a long word", "two", "the cat sat", "green"])]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        r["body"]["model"] = "tuned"
    (tmp / "named.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def answers(path):
    return {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
            for x in map(json.loads, path.read_text().splitlines())}


def test_run_with_an_adapter_gguf_answers_as_its_peft_directory(tiny_adapter, tmp_path):
    t = tiny_adapter
    got = {}
    for label, src in (("peft", t / "peft"), ("gguf", t / "tuned.gguf"), ("named", f"tuned={t / 'tuned.gguf'}"), ("base", None)):
        args = ["run", "tiny", str(t / ("named.jsonl" if label == "named" else "rows.jsonl")), "--batch", "3", "--state", str(tmp_path / label),
                "--out", str(tmp_path / f"{label}.jsonl")] + (["--adapter", str(src)] if src else [])
        p = run_cli(args)
        assert p.returncode == 0, p.stderr
        assert events_of(p.stdout)[-1]["event"] == "done"
        got[label] = answers(tmp_path / f"{label}.jsonl")
    assert got["gguf"] == got["peft"] and len(got["gguf"]) == 5
    assert got["named"] == got["peft"]  # rows naming the adapter GGUF by its NAME
    assert got["gguf"] != got["base"]


def test_a_tune_continues_from_an_adapter_gguf(tiny_adapter, tmp_path):
    t = tiny_adapter
    p = run_cli(["tune", "tiny", "examples/data/train.jsonl", "--steps", "2", "--init-adapter", str(t / "tuned.gguf"),
                 "--state", str(tmp_path / "st")])
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "st" / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and sorted(cfg["target_modules"]) == sorted(ALL)


def test_a_model_gguf_or_another_family_as_adapter_is_one_line(tiny_adapter, tmp_path, home):
    from tests.support.real_model import smollm2_gguf

    t = tiny_adapter
    model = smollm2_gguf()
    p = run_cli(["run", "tiny", str(t / "rows.jsonl"), "--adapter", str(model), "--state", str(tmp_path / "a")])
    one_line(p, "--adapter", "is a GGUF but not a LoRA adapter (general.type")
    assert not (tmp_path / "a" / "segments").exists()
    path, _ = make_family("qwen3", tmp_path / "qwen3")
    md = resolve_model(str(path))
    other = tmp_path / "qwen3.gguf"
    gguf_write.write_adapter(other, random_adapter(md.config, ("q_proj",), 2, 0)[0], 4.0, md.config)
    p = run_cli(["run", "tiny", str(t / "rows.jsonl"), "--adapter", f"x={other}", "--state", str(tmp_path / "b")])
    line = one_line(p, "--adapter", "was trained on a different base: its architecture is 'qwen3'")
    assert "--init-adapter" not in line
    with pytest.raises(SpillpackError, match="not a 2-D LoRA"):
        bad = tmp_path / "bad.gguf"
        import gguf

        w = gguf.GGUFWriter(str(bad), "qwen2")
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
        w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        init_adapter.load(str(bad), resolve_model("tiny"), {})


@pytest.mark.slow
def test_an_adapter_gguf_on_s3_answers_as_the_local_file(tiny_adapter, tmp_path, s3, s3_uri):
    """`--adapter s3://.../tuned.gguf` (fetched to a temporary file, then read as a local one), plain
    and as a named adapter beside a local one, answers as the local file; nothing is left behind."""
    import tempfile

    t = tiny_adapter
    key = s3_uri.split("/", 3)[3] + "/tuned.gguf"
    s3.put(key, (t / "tuned.gguf").read_bytes())
    before = set(os.listdir(tempfile.gettempdir()))
    got = {}
    for label, src, rows in (("local", str(t / "tuned.gguf"), "rows.jsonl"), ("s3", f"s3://{s3.bucket}/{key}", "rows.jsonl"),
                             ("named", f"tuned=s3://{s3.bucket}/{key},other={t / 'peft'}", "named.jsonl")):
        p = run_cli(["run", "tiny", str(t / rows), "--batch", "3", "--adapter", src, "--state", str(tmp_path / label),
                     "--out", str(tmp_path / f"{label}.jsonl")])
        assert p.returncode == 0, p.stderr
        got[label] = answers(tmp_path / f"{label}.jsonl")
    assert got["s3"] == got["local"] == got["named"] and len(got["s3"]) == 5
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("spillpack-adapter-")]
    p = run_cli(["run", "tiny", str(t / "rows.jsonl"), "--adapter", f"s3://{s3.bucket}/{key}.missing", "--state", str(tmp_path / "m")])
    one_line(p, "--adapter")
    assert not (tmp_path / "m" / "segments").exists()
