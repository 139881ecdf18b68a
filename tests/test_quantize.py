"""--quantize int8|int4: a Hugging Face directory's float weights quantized at load (gguf's
reference quantizers, Q8_0 / Q4_1 blocks of 32) and kept so on torch-cpu. Held to the same model
with its weights quantized and dequantized again by gguf (the exact arithmetic): logits, a tune's
adapter, and, in bfloat16, greedy answers against float32's. The job's identity carries it."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from conftest import events_of, one_line, run_cli
from tests.test_qlora import assert_same_adapter
from runtime.models.quantize import TYPES, quantizable
from runtime.models.tiny import ensure_tiny

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Write a haiku about the sea.", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.", "What is the boiling point of water in Celsius?", "List two mammals that can fly.",
    "Explain photosynthesis in one sentence.", "What day comes after Monday?", "Is a tomato a fruit or a vegetable?",
    "Say hello in French.", "What is the largest planet in our solar system?", "Complete: the quick brown fox...",
    "Why is the sky blue? Answer briefly.",
]


def round_trip(w: np.ndarray, block: str) -> np.ndarray:
    """w quantized to `block` and dequantized again by gguf's reference."""
    import gguf

    kind = gguf.GGMLQuantizationType[block]
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind), kind).reshape(w.shape)


def dequantized_dir(src, dest, block: str):
    """A copy of the directory `src` whose quantizable weights hold their `block` round trip (float32)."""
    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: round_trip(v.astype(np.float32), block) if quantizable(k, v.shape) else v for k, v in tensors.items()},
                  str(f), metadata={"format": "pt"})
    return dest


def rows_file(path, n: int = 16, max_tokens: int = 32):
    path.write_text("".join(json.dumps({"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                        "max_tokens": max_tokens}}) + "\n"
                            for i, p in enumerate(PROMPTS[:n])))
    return path


def answers(out) -> list[str]:
    return [json.loads(l)["response"]["body"]["choices"][0]["message"]["content"] for l in out.read_text().splitlines()]


def test_run_with_quantize_keeps_blocks_and_its_identity(home, tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 3, 8)
    state = tmp_path / "state"
    r = run_cli(["run", "tiny", str(rows), "--name", "q", "--state", str(state), "--quantize", "int4"])
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert set(start["memory_plan"]["quantized"]) == {"Q4_1"} and "--quantize" in start["weights_why"], start
    assert "kept quantized" in start["message"]
    # The state was made with int4: without it, or with int8, the job is another one.
    for other in ([], ["--quantize", "int8"]):
        r = run_cli(["run", "tiny", str(rows), "--name", "q", "--state", str(state), *other])
        one_line(r, "quantize is 'int4' there")


def test_quantize_refusals_are_one_line(home, tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 1, 4)
    one_line(run_cli(["run", "tiny", str(rows), "--quantize", "int3"]), "--quantize", code=2)
    from tests.support.real_model import smollm2_gguf

    state = tmp_path / "g"
    one_line(run_cli(["run", str(smollm2_gguf()), str(rows), "--state", str(state), "--quantize", "int8"]),
             "is a GGUF, quantized already", code=2)
    assert not state.exists()
    one_line(run_cli(["tune", str(smollm2_gguf()), "examples/data/train.jsonl", "--state", str(state), "--quantize", "int8"]),
             "is a GGUF, quantized already", code=2)
    assert not state.exists()


@pytest.mark.parametrize("value", ["int8", "int4"])
def test_tune_with_quantize_is_the_dense_tune_of_the_round_trip(home, tmp_path, value):
    oracle = dequantized_dir(ensure_tiny(), tmp_path / "deq", TYPES[value])
    common = ["examples/data/train.jsonl", "--name", "t", "--steps", "3", "--batch", "2", "--lr", "1e-3", "--rank", "4",
              "--max-seq", "96", "--dtype", "float32"]
    env = {"SPILLPACK_THREADS": "1"}
    r = run_cli(["tune", "tiny", *common, "--state", str(tmp_path / "q"), "--quantize", value], env=env)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["base_quantized"] is True and TYPES[value] in start["weights_why"], start
    r = run_cli(["tune", str(oracle), *common, "--state", str(tmp_path / "d")], env=env)
    assert r.returncode == 0, r.stderr
    assert_same_adapter(load_file(str(tmp_path / "q/adapter/adapter_model.safetensors")),
                        load_file(str(tmp_path / "d/adapter/adapter_model.safetensors")))


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from tests.support.real_model import smollm2_hf_dir

    return smollm2_hf_dir(tmp_path_factory.mktemp("smol") / "hf")


@pytest.mark.slow
def test_int8_logits_are_the_round_trips_in_float32(smol_dir):
    from runtime.engines.torch.models import load_model
    from runtime.engines.torch.models.quant_layout import resident_bytes
    from runtime.models.ref import resolve_model

    md = resolve_model(str(smol_dir))
    quant = load_model(md, torch.float32, cpu_inference=True, quantized="Q8_0")
    dense = load_model(md, torch.float32)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if quantizable(name, tuple(p.shape)):
                p.copy_(torch.from_numpy(round_trip(p.numpy(), "Q8_0")))  # in place: joined views keep their memory
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 4, 1359, 2, 77, 900], [28, 1842, 2830, 355, 2023, 30, 216, 216, 42, 9, 7]])
    with torch.no_grad():
        a, b = quant(ids), dense(ids)
    err = (a - b).abs().max().item()
    print(f"int8 logits against the round trip: {err:.2e} (logits up to {b.abs().max():.1f}); "
          f"{resident_bytes(quant) / 1e6:.1f} MB resident")
    assert err <= 1e-4


@pytest.mark.slow
def test_int8_bfloat16_greedy_answers_agree_with_float32_as_the_float_models_do(smol_dir, tmp_path, home):
    """16 prompts, 32 greedy tokens: how many answers bfloat16 leaves identical to float32's, with
    --quantize int8 and without. This model's float weights themselves keep only about half (8 of 16
    measured: bfloat16's rounding moves a near tie within 32 tokens), so the promise held here is that
    int8 keeps as many, within one; and float32 with int8 still answers the France prompt."""
    rows = rows_file(tmp_path / "rows.jsonl")
    got = {}
    for quantize in ([], ["--quantize", "int8"]):
        for dtype in ("float32", "bfloat16"):
            name = f"{dtype}{'-int8' if quantize else ''}"
            out = tmp_path / f"{name}.jsonl"
            r = run_cli(["run", str(smol_dir), str(rows), "--name", name, "--state", str(tmp_path / name), "--out", str(out),
                         "--dtype", dtype, "--batch", "16", *quantize], timeout=900)
            assert r.returncode == 0, r.stderr
            got[name] = answers(out)
    same = lambda a, b: sum(x == y for x, y in zip(got[a], got[b]))
    dense, int8 = same("float32", "bfloat16"), same("float32-int8", "bfloat16-int8")
    print(f"bfloat16 greedy answers identical to float32's: {dense} of 16 dense, {int8} of 16 with --quantize int8")
    assert "Paris" in got["float32-int8"][0]
    assert int8 >= dense - 1, (dense, int8)
