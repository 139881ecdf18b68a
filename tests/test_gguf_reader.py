"""Bad GGUF files: each one line naming what is wrong, exit 1, nothing written, and no
allocation of what a lying header claims (the counts are checked against the file's size)."""

import json
import struct

import numpy as np
import pytest

from conftest import run_cli
from tests.support.gguf_files import write_minimal
from runtime.base.errors import SpillpackError
from runtime.models.gguf.reader import read_gguf
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny


@pytest.fixture
def good(tmp_path, home):
    return write_minimal(tmp_path / "m.gguf", ensure_tiny())


def refused(path) -> str:
    with pytest.raises(SpillpackError) as e:
        resolve_model(str(path))
    return str(e.value)


def patched(src, dest, offset, fmt, value):
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    dest.write_bytes(bytes(data))
    return dest


def test_a_good_file_reads(good):
    gf = read_gguf(good)
    assert gf.version == 3 and gf.architecture == "llama" and len(gf.tensors) == 11
    md = resolve_model(str(good))
    assert md.is_gguf and md.arch == "llama" and md.config["hidden_size"] == 32 and md.config["tie_word_embeddings"]
    # a directory holding exactly that one file names the same model
    assert resolve_model(str(good.parent)).fingerprint() == md.fingerprint()


def test_truncated_file(good, tmp_path):
    data = good.read_bytes()
    for cut in (3, 20, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        msg = refused(bad)
        assert "not a readable GGUF" in msg and ("truncated" in msg or "magic" in msg), (cut, msg)


def test_wrong_magic_and_unknown_version(good, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    assert "wrong magic" in refused(bad)
    assert "unknown GGUF version 7" in refused(patched(good, tmp_path / "v7.gguf", 4, "<I", 7))
    # big-endian files read as a huge version on a little-endian reader
    assert "unknown GGUF version" in refused(patched(good, tmp_path / "be.gguf", 4, ">I", 3))


@pytest.mark.parametrize("offset,what", [(8, "tensor entries"), (16, "metadata entries"), (24, "metadata key 0")])
def test_header_claiming_more_than_the_file_has(good, tmp_path, offset, what):
    # 2^60 tensors, metadata entries or key bytes: refused from the file size, never allocated
    msg = refused(patched(good, tmp_path / "huge.gguf", offset, "<Q", 1 << 60))
    assert what in msg and "the file has" in msg


def test_tensor_past_the_end(good, tmp_path):
    gf = read_gguf(good)
    last = max(gf.tensors.values(), key=lambda t: t.offset)
    data = good.read_bytes()
    bad = tmp_path / "short.gguf"
    bad.write_bytes(data[: gf.data_start + last.offset + last.nbytes - 4])
    assert f"tensor {last.name} claims bytes" in refused(bad)


def test_string_array_claiming_more_than_the_file(good, tmp_path):
    data = good.read_bytes()
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # after the key, its value type (array) and item type (string)
    msg = refused(patched(good, tmp_path / "tokens.gguf", at, "<Q", 1 << 40))
    assert "tokenizer.ggml.tokens" in msg and "strings" in msg


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.model"])
def test_missing_tokenizer_key(tmp_path, home, key):
    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), drop_keys=(key,))
    assert f"no {key} key" in refused(path)


def test_missing_shape_key(tmp_path, home):
    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), drop_keys=("embedding_length",))
    assert "no llama.embedding_length key" in refused(path)


@pytest.mark.parametrize("heads", [0, "two"])
def test_a_head_count_that_is_no_count(tmp_path, home, heads):
    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), head_count=heads)
    assert "llama.attention.head_count must be a positive whole number" in refused(path)


def test_unsupported_architecture(tmp_path, home):
    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), arch="falcon")
    msg = refused(path)
    assert "GGUF architecture 'falcon' is not supported" in msg and "qwen3moe" in msg


def test_unsupported_tensor_type(tmp_path, home):
    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), qtype="I8")
    msg = refused(path)
    assert "has type I8, which spillpack does not read" in msg and "Q4_K" in msg


def test_directory_with_two_ggufs(good, tmp_path):
    (tmp_path / "n.gguf").write_bytes(good.read_bytes())
    assert "holds 2 GGUF files" in refused(tmp_path)


def test_cli_refuses_in_one_line_and_writes_nothing(good, tmp_path, home):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:100])
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    for args in (["run", str(bad), str(rows)], ["tune", str(bad), "examples/data/train.jsonl", "--name", "t", "--steps", "1"]):
        state = tmp_path / "state"
        r = run_cli([*args, "--state", str(state)], env={"SPILLPACK_HEADLESS": "0"})
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("spillpack: ") and "truncated" in lines[0] and "Try:" in lines[0], r.stderr
        assert not state.exists()


def test_dequantized_types_are_the_gguf_packages(tmp_path, home):
    """Q8_0, Q4_0, Q4_1 weights come back as gguf.quants.dequantize gives them."""
    import gguf

    from runtime.models.weights import read_tensors

    for qtype in ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16"):
        path = write_minimal(tmp_path / f"{qtype}.gguf", ensure_tiny(), qtype=qtype)
        gf = read_gguf(path)
        info = gf.tensors["blk.0.ffn_up.weight"]
        want = gguf.quants.dequantize(gf.read_raw(info), gguf.GGMLQuantizationType(info.ggml_type))
        got = dict((n, a) for n, _, a in read_tensors([path]))["model.layers.0.mlp.up_proj.weight"]
        assert got.dtype == np.float32 and got.shape == (64, 32)
        np.testing.assert_array_equal(got, want)
