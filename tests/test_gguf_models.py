"""GGUFs of every supported family and tensor type, written with gguf's GGUFWriter from random
transformers models, held to transformers' own GGUF loading (`from_pretrained(DIR, gguf_file=NAME)`):
logits within 1e-4 on the torch and MLX engines, the tokenizer (same `tokenizers` JSON, same ids,
same decoding) and the chat template."""

import json

import numpy as np
import pytest
import torch

from tests.support.gguf_files import FAMILIES
from runtime.engines.registry import get_engine
from runtime.models.gguf.reader import read_gguf
from runtime.models.gguf.tensors import SUPPORTED_TYPES
from runtime.models.tokenizer import Tokenizer
from runtime.models.tiny import ensure_tiny

mx = pytest.importorskip("mlx.core")
pytestmark = pytest.mark.xdist_group("gguf_models")  # one worker (with test_gguf_placements): each file written and loaded once
TOL = 1e-4
NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def family(gguf_oracle):
    """name -> (GGUF path, ModelDir, transformers model, transformers tokenizer), built once (conftest)."""
    return gguf_oracle


def test_every_supported_type_is_covered(family):
    types = set()
    for name in NAMES:
        types |= {SUPPORTED_TYPES[t.ggml_type] for t in read_gguf(family(name)[0]).tensors.values()}
    assert types == set(SUPPORTED_TYPES.values())


@pytest.mark.parametrize("engine", ["torch-cpu", "mlx"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(family, name, engine):
    path, md, hf, _ = family(name)
    want_type = {"gemma3": "gemma3_text", "qwen3_moe": "qwen3_moe"}.get(name, name)
    assert md.arch == want_type
    # transformers reads a llama-architecture GGUF named like Mistral as Llama (its Mistral
    # branch needs general.name to be exactly "mistral", and then fails in gguf-py): the same
    # decoder without a window, which is what such a file holds.
    model = get_engine(engine).load_model(md)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, md.config["vocab_size"], size=(2, 19))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
        got = np.array(model(mx.array(ids))) if engine == "mlx" else model(torch.from_numpy(ids)).numpy()
    assert np.abs(want).max() > 0.5  # the weights are not all zero
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


CORPUS = [
    "Hello, world!", "  leading spaces and trailing  ", "<|im_start|>user\nhi<|im_end|>\n", "a<|im_end|>b<|endoftext|>",
    "naïve café — “quotes” and emoji 🦙🔥 with ZWJ 👩‍💻", "日本語のテキスト、中文，한국어", "tabs\tand\r\nnewlines\n\n\n",
    "combining e\u0301 and \u200b zero width", "numbers 1234567 3.14159 -42", "<|im_start|> not quite <|im_start", "",
]


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_tokenizer_matches_transformers(family, name):
    path, md, _, tok = family(name)
    ours = Tokenizer.from_dir(md.path)
    assert json.loads(ours._tok.to_str()) == json.loads(tok.backend_tokenizer.to_str())
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == tok.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_ids >= {tok.eos_token_id} and ours.pad_token_id == tok.pad_token_id


def test_chat_template_matches_transformers(family):
    path, md, _, tok = family("qwen3")
    ours = Tokenizer.from_dir(md.path)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? 🤔"}]):
        for gen in (False, True):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
                tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


SP_CORPUS = ["the quick brown fox", "  hello  world ", "unbelievable café naïve 🦙 日本", "<s>hi</s><|user|>x</s>",
             "tokenization\ttabs\nnewline", ""]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, home, arch):
    """tokenizer.ggml.model `llama` (Llama 2, Mistral, Gemma, Phi-3 files): byte fallback, merges
    recovered from the scores, each architecture's own spacing rules, user-defined tokens whole."""
    from transformers import AutoTokenizer

    from tests.support.gguf_files import sentencepiece_tokenizer, write_minimal

    path = write_minimal(tmp_path / "m.gguf", ensure_tiny(), arch=arch, tokenizer=sentencepiece_tokenizer())
    ours = Tokenizer.from_dir(path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    mine, theirs = json.loads(ours._tok.to_str()), json.loads(hf.backend_tokenizer.to_str())
    # transformers appends GemmaTokenizer's default specials that this small vocabulary lacks,
    # as new ids past the file's vocabulary (no model could embed them): compare the rest
    n = len(sentencepiece_tokenizer()["tokens"])
    theirs["added_tokens"] = [t for t in theirs["added_tokens"] if t["id"] < n]
    assert mine == theirs
    for text in SP_CORPUS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours._tok.encode(text).ids == hf(text).input_ids, text  # add_bos defaults on for `llama` files
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours._tok.encode("hi").ids[0] == 1  # <s>


@pytest.mark.slow
def test_tune_merge_on_a_gguf_base_writes_a_hugging_face_directory(family, tmp_path, home):
    """`tune --merge` on a GGUF: the merged directory (config, tokenizer and template made from the
    file) loads in transformers and gives the adapted model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import run_cli
    from runtime.models.lora import load_adapter

    path, md, _, _ = family("llama")
    r = run_cli(["tune", str(path), "examples/data/train.jsonl", "--name", "m", "--steps", "2", "--batch", "2", "--lr", "1e-2",
                 "--max-seq", "96", "--state", str(tmp_path / "s"), "--merge"])
    assert r.returncode == 0, r.stderr
    merged = tmp_path / "s" / "adapter" / "merged"
    hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(merged))
    ours_tok = Tokenizer.from_dir(md.path)
    text = "<|im_start|>user\nhello there<|im_end|>\n"
    assert tok.encode(text, add_special_tokens=False) == ours_tok.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        ours_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = torch.tensor([ours_tok.encode(text)])
    adapted = get_engine("torch-cpu").load_model(md, load_adapter(tmp_path / "s" / "adapter"))
    with torch.no_grad():
        np.testing.assert_allclose(hf(input_ids=ids).logits.numpy(), adapted(ids).numpy(), atol=TOL, rtol=0)
