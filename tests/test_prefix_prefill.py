"""The decoders' prefill savings (runtime/engines/prefill.py, one mechanism for the torch and the
MLX decoder) held to a plain prefill: prompts resuming from the prefix cache, a group's common
start run once, and prefill in chunks give the logits of every prompt prefilled whole (float32,
1e-4) and the same greedy tokens, on the built-in tiny model and on a random Mistral with a sliding
window shorter than the prompts, and through every family's forward; each on both engines (MLX
where it imports).
"""

from types import SimpleNamespace

import numpy as np
import pytest

from runtime.engines.generation import generate
from runtime.engines.prefill import MIN_SHARED_PREFIX
from runtime.models.memory_rows import PREFILL_CHUNK_TOKENS, generation_plan, kv_cache_bytes
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import WINDOW, make_family

TOL = 1e-4
PLAIN = dict(prefix_cache=False, chunk_tokens=10**9)  # the oracle: every prompt whole, in one forward


def recording(decoder):
    """The engine's decoder, recording each prefill forward: (rows, width, offsets)."""

    class Recording(decoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.forwards = []

        def _forward(self, slots, pieces, offsets, width):
            self.forwards.append((len(slots), width, list(offsets)))
            return super()._forward(slots, pieces, offsets, width)

    return Recording


@pytest.fixture(scope="module", params=["torch", "mlx"])
def engine(request):
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
        from runtime.engines.mlx.decode import MLXDecoder as Decoder
        from runtime.engines.mlx.models import load_model
    else:
        from runtime.engines.torch.decode import TorchDecoder as Decoder
        from runtime.engines.torch.models import load_model
    return SimpleNamespace(Decoder=Decoder, Recording=recording(Decoder), load=load_model)


@pytest.fixture(scope="module", params=["tiny", "mistral"])
def model_dir(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        if request.param == "tiny":
            return resolve_model(str(ensure_tiny()))
        path, _ = make_family("mistral", tmp_path_factory.mktemp("mistral") / "m")
        return resolve_model(str(path))


@pytest.fixture(scope="module")
def model(engine, model_dir):
    return engine.load(model_dir)


class Switched:
    """A model whose make_decoder takes these decoder options (generate() calls make_decoder)."""

    def __init__(self, decoder, model, **options):
        self.decoder, self.model, self.options = decoder, model, options

    def make_decoder(self, slots, max_len):
        return self.decoder(self.model, slots, max_len, **self.options)


def ids(rng, n):
    return rng.integers(5, 990, size=n).tolist()


def shared_prompts(seed=0, prefix=40, tails=(3, 9, 20)):
    rng = np.random.default_rng(seed)
    head = ids(rng, prefix)
    return head, [head + ids(rng, n) for n in tails]


def same_steps(a, b, slots, steps=3):
    """Decode a few steps on both decoders (the same tokens fed): the caches they prefilled agree."""
    for t in range(steps):
        last = [7 + t + s for s in slots]
        np.testing.assert_allclose(a.decode(slots, last), b.decode(slots, last), atol=TOL)


def test_shared_prefix_logits_match_whole_prompt_prefill(engine, model):
    head, first = shared_prompts(tails=(3, 9, 20))
    rng = np.random.default_rng(1)
    second = [head + ids(rng, 12), head + first[0][40:] + ids(rng, 5)]  # the second shares all of the entry
    plain, ours = engine.Decoder(model, 4, 96, **PLAIN), engine.Recording(model, 4, 96)
    # The first group: no entry yet, so its common 40 tokens run once, in the first row's slot.
    np.testing.assert_allclose(ours.prefill([0, 1, 2], first), plain.prefill([0, 1, 2], first), atol=TOL)
    assert ours.forwards == [(1, 40, [0]), (3, 20, [40, 40, 40])]
    assert ours.prefix_ids == first[0]
    # The second group resumes from the entry: rows of one forward from different offsets.
    np.testing.assert_allclose(ours.prefill([3, 1], second), plain.prefill([3, 1], second), atol=TOL)
    assert ours.forwards[2:] == [(2, 12, [40, 43])]
    assert ours.prefix_ids == second[0]  # a prompt the entry lacks replaces it
    same_steps(ours, plain, [0, 1, 2, 3])


def test_greedy_generation_is_token_identical_with_and_without_the_savings(engine, model, model_dir):
    tok = Tokenizer.from_dir(model_dir.path)
    tok.eos_token_ids = frozenset()  # random weights: run every row to its max_tokens
    head, prompts = shared_prompts(seed=2, prefix=48, tails=(2, 30, 7, 15, 1, 22))
    prompts += [ids(np.random.default_rng(3), 25)]  # and a row that shares nothing
    expected = [r.tokens for r in generate(Switched(engine.Decoder, model, **PLAIN), tok, prompts, max_tokens=10, batch=3)]
    for options in ({}, {"chunk_tokens": 7}, {"prefix_cache": False, "chunk_tokens": 7}):
        got = generate(Switched(engine.Decoder, model, **options), tok, prompts, max_tokens=10, batch=3)  # slots refill mid-run
        assert [r.tokens for r in got] == expected, options


def test_chunked_prefill_matches_one_forward(engine, model):
    rng = np.random.default_rng(4)
    prompts = [ids(rng, n) for n in (30, 5, 17)]
    assert max(map(len, prompts)) > WINDOW  # a sliding layer slides across chunks
    plain, chunked = engine.Decoder(model, 3, 48, **PLAIN), engine.Recording(model, 3, 48, prefix_cache=False, chunk_tokens=7)
    np.testing.assert_allclose(chunked.prefill([2, 0, 1], prompts), plain.prefill([2, 0, 1], prompts), atol=TOL)
    assert all(rows * width <= 7 for rows, width, _ in chunked.forwards) and len(chunked.forwards) > 3
    assert sum(rows * width for rows, width, _ in chunked.forwards) >= sum(map(len, prompts))
    assert chunked.prefix_ids == [] and chunked.prefix_k is None  # no entry kept, none allocated
    same_steps(chunked, plain, [0, 1, 2])


def test_a_prompt_equal_to_the_entry_and_prompts_shorter_than_the_threshold(engine, model):
    head, (p,) = shared_prompts(seed=5, tails=(6,))
    plain, ours = engine.Decoder(model, 3, 64, **PLAIN), engine.Recording(model, 3, 64)
    ours.prefill([0], [p])
    plain.prefill([0], [p])
    # The whole entry again, and a start of it: all but the last token copied, that one run.
    cases = [p, p[:30]]
    np.testing.assert_allclose(ours.prefill([1, 2], cases), plain.prefill([1, 2], cases), atol=TOL)
    assert ours.forwards[-1] == (2, 1, [len(p) - 1, 29])
    same_steps(ours, plain, [0, 1, 2])
    # Shorter than the threshold, even when all of it is the entry's: run from 0.
    short = [p[:MIN_SHARED_PREFIX], p[:3]]
    np.testing.assert_allclose(ours.prefill([2, 1], short), plain.prefill([2, 1], short), atol=TOL)
    assert ours.forwards[-1] == (2, MIN_SHARED_PREFIX, [0, 0])
    assert ours.prefix_ids == p  # a prompt the entry holds does not replace it
    same_steps(ours, plain, [1, 2])


def test_a_slot_reused_after_release(engine, model):
    head, (a, b) = shared_prompts(seed=6, tails=(25, 4))
    plain, ours = engine.Decoder(model, 2, 80, **PLAIN), engine.Decoder(model, 2, 80)
    for dec in (plain, ours):
        dec.prefill([0], [a])
        dec.decode([0], [11])
        dec.release(0)
    np.testing.assert_allclose(ours.prefill([0], [b]), plain.prefill([0], [b]), atol=TOL)
    same_steps(ours, plain, [0], steps=4)


def test_pad_writes_stay_inside_a_full_slot(engine, model):
    """A row resuming late with little room beside a long row from scratch: one forward at the
    long row's width would write pad tokens past the cache's end, so the width is bounded."""
    head, (p,) = shared_prompts(seed=7, prefix=45, tails=(5,))
    rng = np.random.default_rng(8)
    plain, ours = engine.Decoder(model, 2, 52, **PLAIN), engine.Recording(model, 2, 52)
    ours.prefill([0], [p])
    plain.prefill([0], [p])
    rows = [p + ids(rng, 1), ids(rng, 50)]  # the first resumes at 50, 2 tokens of room
    np.testing.assert_allclose(ours.prefill([0, 1], rows), plain.prefill([0, 1], rows), atol=TOL)
    assert ours.forwards[-2:] == [(2, 2, [50, 0]), (1, 48, [2])]  # the first row done (and a pad at 51)
    same_steps(ours, plain, [0, 1], steps=1)


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "qwen3", "qwen3-window", "qwen3_moe"])
def test_every_family_through_chunks_and_the_prefix_cache(engine, family, tmp_path, monkeypatch):
    """Each model file's forward at per-row offsets: Gemma 3's sliding and full layers with
    their own rotations, Phi-3's partial rotary, Qwen3's q/k norms and window, the MoE router."""
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "home"))
    path, _ = make_family(family, tmp_path / family)
    model = engine.load(resolve_model(str(path)))
    head, first = shared_prompts(seed=9, prefix=20, tails=(3, 11))
    second = [head + ids(np.random.default_rng(10), 6)]
    plain, ours = engine.Decoder(model, 3, 48, **PLAIN), engine.Recording(model, 3, 48, chunk_tokens=7)
    for slots, group in (([0, 1], first), ([2], second)):
        np.testing.assert_allclose(ours.prefill(slots, group), plain.prefill(slots, group), atol=TOL)
    assert ours.forwards[0] == (1, 7, [0])  # the group's common start, in chunks
    assert ours.forwards[-1] == (1, 6, [20])  # the second resumed from the entry
    same_steps(ours, plain, [0, 1, 2])


def test_the_memory_plan_counts_a_chunk_and_the_prefix_entry():
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    short = generation_plan(config, 4, 16, 132, 100, 0.0)
    assert short.prefill == (16, 100)  # 1,600 tokens: one forward
    assert short.kv_cache_gb * 2**30 == kv_cache_bytes(config, 17, 132, 4)  # 16 slots and the entry
    plans = [generation_plan(config, 4, 16, n + 32, n, 0.0) for n in (1000, 2000)]
    assert [p.prefill for p in plans] == [(16, PREFILL_CHUNK_TOKENS // 16)] * 2
    # Past a chunk only the mask and the gathered keys grow with the prompt, not the layers' activations.
    grown = (plans[1].activations_gb - plans[0].activations_gb) * 2**30
    mask = PREFILL_CHUNK_TOKENS * 1000 * 5
    gathered = (kv_cache_bytes(config, 16, 2032, 4) - kv_cache_bytes(config, 16, 1032, 4)) // 24
    assert grown == pytest.approx(mask + gathered)
