"""Every GGUF family and tensor type (tests/support/gguf_files.py FAMILIES) in each placement of
the torch engine's weights, in float32, held to transformers' own GGUF loading: kept in their
blocks on the scratch (SPILLPACK_QUANT_GEMM=scratch), Q4_0/Q4_1 on torch's int4pack kernel
(SPILLPACK_QUANT_GEMM=int4pack, the one float32 forces; measured, float32 takes the scratch), and
streamed from the file's map (SPILLPACK_WEIGHTS=stream): logits within 1e-4 of transformers' and
within 1e-5 of the dense load's (dequantized at load, as these small files' default placement is); a type without
a kernel of that placement says how it runs instead. Then `spillpack run` in each placement
answers chat rows as transformers' greedy `generate` does on the same file.

The files and transformers' models are conftest's gguf_oracle, shared with test_gguf_models.py
(one xdist group: written and loaded once); each placement loads each file once."""

import json

import numpy as np
import pytest
import torch

from conftest import events_of, run_cli
from tests.support.gguf_files import FAMILIES, hf_greedy
from runtime.engines.registry import get_engine
from runtime.engines.torch.models import load_model
from runtime.engines.torch.models.quant_blocks import INT4PACK_TYPES
from runtime.engines.torch.models.quant_layout import kernels
from runtime.models.gguf.model import float_types, quantized_types

pytestmark = pytest.mark.xdist_group("gguf_models")
TOL = 1e-4  # to transformers, and to the dense placement
# To the dense load on the same products: the weights dequantized at load, each multiplied by
# F.linear as the other placements (and transformers) multiply. The dense placement itself lays
# its larger float32 linears out for oneDNN, whose sums run in another order: measured up to
# 1.4e-5 from these placements' logits (qwen3), 3.5e-5 on the random MoE, whose routing amplifies
# float32's rounding (on other ids transformers' own float32 logits land 1.3e-4 from the float64
# model's), so it is held to TOL. Between the other placements and the dense load the same sums
# still land some float32 steps apart on some CPUs (gemma3 and phi3 on the scratch: up to 1.9e-5
# on a logit of 16, ten steps there): SAME_REL adds eight steps of each logit's own size.
SAME, SAME_REL = 1e-5, 1e-6
PLACEMENTS = {"dense": {}, "scratch": {"SPILLPACK_QUANT_GEMM": "scratch"}, "int4pack": {"SPILLPACK_QUANT_GEMM": "int4pack"},
              "streamed": {"SPILLPACK_WEIGHTS": "stream"}}
NAMES = sorted(FAMILIES)
WITH_INT4 = [n for n in NAMES if set(FAMILIES[n][4]) & set(INT4PACK_TYPES)]  # the families int4pack has a layer of
CASES = [(n, p) for n in NAMES for p in ("scratch", "streamed")] + [(n, "int4pack") for n in WITH_INT4]


def ids_for(md) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).integers(0, md.config["vocab_size"], size=(2, 19)))


@pytest.fixture(scope="module")
def placed(gguf_oracle):
    """(family, placement) -> (logits, (kept quantized, why), (streamed, why), kernels), loaded once."""
    done = {}

    def get(name, placement):
        if (name, placement) not in done:
            _, md, _, _ = gguf_oracle(name)
            with pytest.MonkeyPatch.context() as mp:
                for key in ("SPILLPACK_QUANT_GEMM", "SPILLPACK_WEIGHTS"):
                    mp.delenv(key, raising=False)
                for key, value in PLACEMENTS[placement].items():
                    mp.setenv(key, value)
                engine = get_engine("torch-cpu", dtype="float32")
                model = engine.load_model(md)
                with torch.no_grad():
                    logits = model(ids_for(md))
                done[name, placement] = logits, engine.quantized_why(md), engine.stream_why(md), kernels(model)
        return done[name, placement]

    return get


@pytest.fixture(scope="module")
def dense_load(gguf_oracle):
    """family -> logits of the file dequantized at load, no layout (runtime...models.load_model)."""
    done = {}

    def get(name):
        if name not in done:
            md = gguf_oracle(name)[1]
            with torch.no_grad():
                done[name] = load_model(md, torch.float32)(ids_for(md))
        return done[name]

    return get


@pytest.mark.parametrize("name,placement", CASES)
def test_each_placement_gives_transformers_logits_and_the_dense_ones(gguf_oracle, placed, dense_load, name, placement):
    path, md, hf, _ = gguf_oracle(name)
    got, (kept, why), (streamed, _), found = placed(name, placement)
    dense, (dense_kept, dense_why), _, dense_found = placed(name, "dense")
    quant, floats = set(quantized_types(path)), set(float_types(path))
    assert not dense_kept and dense_found == {}  # the reference: dequantized at load, by default here
    assert dense_why is None if not quant else dense_why.startswith("dequantized at load"), dense_why
    on = {k.split(" on ")[0].split()[0]: k.split(" on ")[1] for k in found}  # type -> its kernel
    if placement == "streamed":  # every 2-D weight read from the map on the scratch, the float ones too
        assert streamed and not kept and on == dict.fromkeys(quant | floats, "scratch"), found
    elif not quant:  # F16/BF16 only: nothing to keep in blocks, and the why says so
        assert not kept and found == {}
        assert why == (f"dense: its weights are {', '.join(sorted(floats))}, float types with no blocks to keep "
                       f"(SPILLPACK_QUANT_GEMM={placement} applies to Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)"), why
    else:
        assert kept and not streamed and why.startswith(f"kept quantized (SPILLPACK_QUANT_GEMM={placement})"), why
        int4 = placement == "int4pack"
        assert on == {k: "int4pack" if int4 and k in INT4PACK_TYPES else "scratch" for k in quant}, found
        others = sorted(quant - set(INT4PACK_TYPES))
        assert (f"{', '.join(others)} ha" in why and "no int4pack kernel" in why) == (int4 and bool(others)), why
        assert ("weights dense in float32 (a float type has no blocks)" in why) == bool(floats), why
    with torch.no_grad():
        want = hf(input_ids=ids_for(md)).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(got.numpy(), dense.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(got.numpy(), dense_load(name).numpy(), atol=SAME, rtol=SAME_REL)


PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.", "hi"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def greedy(gguf_oracle):
    """transformers' greedy answers on llama's Q8_0/Q4_0 file: (prompt tokens, new ids) a prompt."""
    _, _, hf, tok = gguf_oracle("llama")
    return [hf_greedy(hf, tok, [{"role": "user", "content": p}], MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_run_in_each_placement_answers_as_transformers_greedy(gguf_oracle, greedy, placement, tmp_path, home):
    """Through the CLI, float32: each row's text, token counts and finish reason are transformers'
    greedy generation's; the start event says the placement, and where int4pack is forced that
    Q8_0 (no int4pack kernel) is dequantized into the scratch."""
    path, _, _, tok = gguf_oracle("llama")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                        "max_tokens": MAX_NEW}}) + "\n" for i, p in enumerate(PROMPTS)))
    env = {"SPILLPACK_THREADS": "1", "SPILLPACK_QUANT_GEMM": "", "SPILLPACK_WEIGHTS": "", **PLACEMENTS[placement]}
    r = run_cli(["run", str(path), str(rows), "--name", placement, "--state", str(tmp_path / "s"), "--out",
                 str(tmp_path / "out.jsonl"), "--dtype", "float32"], env=env)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    why = start.get("weights_why") or start["memory_plan"]["weights_why"]
    assert why.startswith({"dense": "dequantized at load", "scratch": "kept quantized (SPILLPACK_QUANT_GEMM=scratch)",
                           "int4pack": "kept quantized (SPILLPACK_QUANT_GEMM=int4pack); Q8_0 has no int4pack kernel: "
                                       "dequantized a chunk of rows at a time into the scratch",
                           "streamed": "streamed from the file"}[placement]), why
    got = [json.loads(line)["response"]["body"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(got) == len(PROMPTS)
    for body, prompt, (n_prompt, want) in zip(got, PROMPTS, greedy):
        assert body["usage"]["prompt_tokens"] == n_prompt, prompt
        assert body["usage"]["completion_tokens"] == len(want), prompt
        assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), prompt
        assert body["choices"][0]["finish_reason"] == ("stop" if want[-1] == tok.eos_token_id else "length"), prompt
