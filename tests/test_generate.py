"""Generation with our KV cache against transformers' generate, and sampling reproducibility."""

import pytest
import torch

from runtime.base.errors import SpillpackError
from runtime.engines.generation import Generator, Request, generate
from runtime.models.ref import resolve_model
from runtime.engines.torch.models import load_model
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import make_llama, make_qwen2


@pytest.fixture(autouse=True, scope="module")
def spillpack_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path, hf = make_qwen2(tmp_path_factory.mktemp("qwen") / "m")
    return load_model(resolve_model(str(path))), Tokenizer.from_dir(path), hf


def hf_greedy(hf, prompts, max_new, pad_id):
    """transformers' generate on a left-padded batch, greedy, without early stopping."""
    T = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                      do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    return out[:, T:].tolist()


PROMPTS = ["Hi", "Zebras quietly vex", "Grumpy wizards make toxic brew for the jovial queen", "Hello, how are you? I"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_transformers(arch, tmp_path):
    path, hf = (make_qwen2 if arch == "qwen2" else make_llama)(tmp_path / arch)
    model, tok = load_model(resolve_model(str(path))), Tokenizer.from_dir(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len(set(map(len, prompts))) == len(prompts)  # different lengths: padding is exercised
    expected = hf_greedy(hf, prompts, 12, tok.pad_token_id)
    # No eos in the random model's way: compare the full 12 tokens.
    tok.eos_token_ids = frozenset()
    # batch=2 < 4 prompts: slots are refilled mid-run (continuous batching)
    got = generate(model, tok, prompts, max_tokens=12, batch=2)
    assert [r.tokens for r in got] == expected
    assert all(r.finish_reason == "length" and r.completion_tokens == 12 for r in got)
    assert [r.prompt_tokens for r in got] == [len(p) for p in prompts]


def test_rows_of_different_lengths_match_transformers(qwen):
    """Rows end at different steps: slots idle, refill and prefill together; each row is still
    the prefix of transformers' greedy output for its prompt."""
    model, tok, hf = qwen
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    limits = [3, 12, 1, 7, 10, 2, 12, 5]
    expected = hf_greedy(hf, prompts, 12, tok.pad_token_id)
    tok_free = Tokenizer.from_dir(tok.path)
    tok_free.eos_token_ids = frozenset()
    gen = Generator(model.make_decoder(3, 64), tok_free)
    for i, (p, n) in enumerate(zip(prompts, limits)):
        gen.add(Request(str(i), p, max_tokens=n))
    got = {}
    while gen.active:
        got.update({r.key: r.tokens for r in gen.step()})
    assert [got[str(i)] for i in range(len(prompts))] == [e[:n] for e, n in zip(expected, limits)]


def test_stop_on_eos(qwen):
    model, tok, _ = qwen
    prompt = tok.encode(PROMPTS[0])
    free = generate(model, tok, [prompt], max_tokens=6)[0]
    # Declare the 3rd greedy token an eos: generation must stop right there, with it.
    tok_stop = Tokenizer.from_dir(tok.path)
    tok_stop.eos_token_ids = frozenset({free.tokens[2]}) - set(free.tokens[:2])
    if not tok_stop.eos_token_ids:
        pytest.skip("greedy output repeats its first tokens")
    stopped = generate(model, tok_stop, [prompt], max_tokens=6)[0]
    assert stopped.tokens == free.tokens[:3] and stopped.finish_reason == "stop" and stopped.completion_tokens == 3
    assert stopped.text == tok.decode(free.tokens[:2])


def test_sampling_does_not_depend_on_batch_mates(qwen):
    model, tok, _ = qwen
    prompts = [tok.encode(p) for p in PROMPTS]
    kw = dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)

    def run(keys_prompts, slots):
        gen = Generator(model.make_decoder(slots, 64), tok)
        for key, p in keys_prompts:
            gen.add(Request(key, p, **kw))
        out = {}
        while gen.active:
            out.update({r.key: r.tokens for r in gen.step()})
        return out

    together = run([(f"k{i}", p) for i, p in enumerate(prompts)], slots=4)
    alone = run([("k2", prompts[2])], slots=1)
    assert together["k2"] == alone["k2"]
    again = run([(f"k{i}", p) for i, p in reversed(list(enumerate(prompts)))], slots=3)
    assert again == together
    assert len({tuple(v) for v in together.values()}) > 1


def test_seed_changes_samples(qwen):
    model, tok, _ = qwen
    p = [tok.encode(PROMPTS[1])]
    a = generate(model, tok, p, max_tokens=12, temperature=1.0, seed=1)[0].tokens
    b = generate(model, tok, p, max_tokens=12, temperature=1.0, seed=2)[0].tokens
    assert a != b


def test_top_p_tiny_is_greedy(qwen):
    model, tok, _ = qwen
    p = [tok.encode(PROMPTS[3])]
    greedy = generate(model, tok, p, max_tokens=8)[0].tokens
    nucleus = generate(model, tok, p, max_tokens=8, temperature=1.0, top_p=1e-6, seed=3)[0].tokens
    assert nucleus == greedy


def test_request_too_long_is_refused(qwen):
    model, tok, _ = qwen
    gen = Generator(model.make_decoder(1, 8), tok)
    with pytest.raises(SpillpackError, match="exceed the context of 8"):
        gen.add(Request("a", [1, 2, 3, 4, 5], max_tokens=4))


def test_sample_is_numpy_and_follows_the_distribution():
    """Sampling is numpy's: a row's draws depend on (seed, key) and the logits only, follow the
    softmax at the temperature, and top-p keeps exactly the nucleus."""
    import numpy as np

    from runtime.engines.generation import request_generator, sample

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    draws = [sample(logits, 1.0, 1.0, request_generator(0, "k")) for _ in range(3)]
    assert len(set(draws)) == 1  # the same stream gives the same first draw
    rng = request_generator(0, "k")
    counts = np.bincount([sample(logits, 1.0, 1.0, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    rng = request_generator(1, "k")
    nucleus = {sample(logits, 1.0, 0.7, rng) for _ in range(2000)}
    assert nucleus == {0, 1}  # 0.5 < 0.7 <= 0.8: the first two tokens
    assert sample(logits, 0.0, 1.0, None) == 0
    # A low temperature sharpens toward the argmax.
    rng = request_generator(2, "k")
    assert sum(sample(logits, 0.05, 1.0, rng) == 0 for _ in range(200)) == 200
