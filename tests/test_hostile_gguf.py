"""GGUF headers that lie about the model: a count no tensor backs (a billion layers over a file
of one), metadata nested to exhaust the stack, a token list shorter than the vocabulary or
than the ids that name its tokens. Each is one line naming the key, before anything of the
claimed size is built; and a property pass sets every count and size the header states to 0, 1,
2^31, 2^63 and one off, each answered correctly or refused in one line, within bounded memory."""

import json
import struct
import subprocess
import sys

import gguf
import pytest

from conftest import REPO, one_line
from runtime.base.errors import SpillpackError
from runtime.models.ref import resolve_model
from tests.support.gguf_files import _tiny_tokenizer, write_minimal
from tests.support.peak import run_with_peak

U32, U64, ARR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64, gguf.GGUFValueType.ARRAY


def refused(path) -> str:
    with pytest.raises(SpillpackError) as e:
        resolve_model(str(path))
    line = e.value.line()
    assert "\n" not in line and ". Try: " in line
    return line


def test_a_header_claiming_a_billion_layers_is_one_line_before_any_allocation(home, tmp_path):
    path = write_minimal(tmp_path / "m.gguf", home / "models" / "tiny", overrides={"block_count": (1_000_000_000, U32)})
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    r = run_with_peak(["run", str(path), str(rows), "--state", str(tmp_path / "s")], tmp_path, env={"SPILLPACK_HEADLESS": "0"})
    one_line(r, '"llama.block_count" must be the number of layers the weights hold (layers 0 to 0), not 1000000000')
    assert not (tmp_path / "s").exists()
    assert r.peak_gb < 1.0, r.peak_gb  # it grew past 5 GB before the check


@pytest.mark.parametrize("key,value,said", [
    ("embedding_length", 64, '"llama.embedding_length" must be the embedding\'s width 32'),
    ("feed_forward_length", 65, '"llama.feed_forward_length" must be the up projection\'s 64 rows'),
    ("head_count_kv", 1, '"llama.attention.head_count_kv" must be 32 // head_dim 16'),
])
def test_a_size_the_tensors_contradict_is_one_line_naming_the_key(home, tmp_path, key, value, said):
    path = write_minimal(tmp_path / "m.gguf", home / "models" / "tiny", overrides={key: (value, U32)})
    assert said in refused(path)


def test_metadata_nested_a_thousand_deep_is_one_line(tmp_path):
    """Written by hand: an array of arrays 1,000 deep (the gguf writer itself would recurse)."""
    key = b"general.deep"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    entry += struct.pack("<IQ", 9, 1) * 1000 + struct.pack("<IQ", 0, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry)
    line = refused(path)
    assert "general.deep nests arrays more than 8 deep" in line and "RecursionError" not in line


@pytest.mark.parametrize("cut,key,said", [
    ("tokens", "tokenizer.ggml.tokens", "lists 100 tokens but the embedding has"),
    ("types", "tokenizer.ggml.token_type", "has 100 entries for"),
    ("eos", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eos_token_id is 99999, not the id of one of its"),
])
def test_a_token_list_shorter_than_what_names_it_is_one_line(home, tmp_path, cut, key, said):
    tk = _tiny_tokenizer(home / "models" / "tiny")
    n, overrides = len(tk["tokens"]), {}
    if cut == "tokens":  # the embedding keeps its rows: the writer sizes it from the full list
        overrides = {"tokenizer.ggml.tokens": (tk["tokens"][:100], ARR), "tokenizer.ggml.token_type": (tk["types"][:100], ARR)}
        tk["eos"] = 3
    elif cut == "types":
        overrides = {"tokenizer.ggml.token_type": (tk["types"][:100], ARR)}
    else:
        tk["eos"] = 99999
    path = write_minimal(tmp_path / "m.gguf", home / "models" / "tiny", tokenizer=tk, overrides=overrides)
    line = refused(path)
    assert said in line and "IndexError" not in line, line
    if cut != "eos":
        assert f"for {n} tokens" in line or f"has {n} rows" in line, line  # the true count is named


# -- the property pass -------------------------------------------------------------------------------

FIELDS = ["context_length", "embedding_length", "block_count", "feed_forward_length", "head_count", "head_count_kv",
          "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "general.alignment"]
TRUE = {"context_length": 256, "embedding_length": 32, "block_count": 1, "feed_forward_length": 64, "head_count": 2,
        "head_count_kv": 2, "general.alignment": 32}

PASS = r'''
import json, sys, time, traceback
from pathlib import Path
import gguf
sys.path[:0] = [{repo!r}, {tests!r}]
from runtime.base.errors import SpillpackError
from runtime.models.ref import resolve_model
import torch
from runtime.engines.torch.models import load_model
from runtime.models.tokenizer import Tokenizer
from tests.support.gguf_files import _tiny_tokenizer, write_minimal
tiny, out = Path(sys.argv[1]), Path(sys.argv[2])
tk = _tiny_tokenizer(tiny)
truth = {{**{truth!r}, "tokenizer.ggml.eos_token_id": tk["eos"], "tokenizer.ggml.bos_token_id": tk["bos"]}}
results = []
for key in {fields!r}:
    for value in sorted({{0, 1, 2**31, 2**63, truth[key] - 1, truth[key] + 1}}):
        if value < 0:
            continue
        path = out / f"{{key}}-{{value}}.gguf"
        write_minimal(path, tiny, overrides={{key: (value, gguf.GGUFValueType.UINT64)}})
        t0 = time.monotonic()
        try:
            md = resolve_model(str(path))
            ids = Tokenizer.from_gguf(path).encode_prompt([{{"role": "user", "content": "hi"}}])
            with torch.no_grad():
                logits = load_model(md)(torch.tensor([ids]))
            outcome = "ok" if bool(torch.isfinite(logits).all()) else "NONFINITE"
        except SpillpackError as e:
            outcome = e.line()
        except BaseException as e:
            outcome = "CRASH " + "".join(traceback.format_exception(e))[-800:]
        results.append({{"key": key, "value": value, "outcome": outcome, "seconds": time.monotonic() - t0}})
print(json.dumps(results))
'''


def test_every_count_and_size_of_the_header_is_answered_or_refused_in_one_line(home, tmp_path):
    script = PASS.format(repo=str(REPO), tests=str(REPO / "tests"), truth=TRUE, fields=FIELDS)
    (tmp_path / "files").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script, str(home / "models" / "tiny"), str(tmp_path / "files")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    from tests.support.peak import vm_hwm_kb

    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, vm_hwm_kb(proc.pid))
        except (OSError, AssertionError):
            pass
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    results = json.loads(stdout.splitlines()[-1])
    assert len(results) >= 5 * len(FIELDS)
    for r in results:
        assert not r["outcome"].startswith("CRASH"), r
        assert r["outcome"] == "ok" or (r["outcome"].startswith("spillpack: ") and ". Try: " in r["outcome"]
                                        and "unexpected" not in r["outcome"]), r
        assert r["seconds"] < 30, r
    ok = {(r["key"], r["value"]) for r in results if r["outcome"] == "ok"}
    # the true values (and a longer context, which nothing allocates from) load; a lie about a shape never does
    assert ("block_count", 1) in ok and ("context_length", 257) in ok and ("context_length", 2**31) not in ok
    for key in ("embedding_length", "block_count", "feed_forward_length", "head_count"):
        assert {v for k, v in ok if k == key} <= {TRUE[key]}, (key, sorted(ok))
    assert peak * 1024 < 1.0 * 2**30, peak  # no value made the process allocate what it claimed
