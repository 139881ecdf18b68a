"""The torch decoder's packed step (runtime/engines/torch/models/attention.py's PackedStep): the
rows that start while others decode run inside the decode step's forward, their tokens packed end
to end. Held to the oracle of a decode and then a prefill (float32, 1e-4), on tiny and on a random
Mistral whose sliding window is shorter than the prompts, through every family's forward, and
through the Generator: greedy tokens identical with packing on and off.
"""

import numpy as np
import pytest

from runtime.engines.generation import Generator, Request
from runtime.engines.prefill import MIN_SHARED_PREFIX
from runtime.engines.torch.decode import TorchDecoder
from runtime.engines.torch.models import load_model
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import WINDOW, make_family
from tests.test_prefix_prefill import model_dir  # noqa: F401  (a fixture: tiny and a sliding-window Mistral)

TOL = 1e-4
OFF = dict(pack=False, prefix_cache=False, chunk_tokens=10**9)  # the oracle: decode, then prefill whole


def ids(rng, n):
    return rng.integers(5, 990, size=n).tolist()


class Counting(TorchDecoder):
    """The decoder, counting its packed steps and recording its prefill forwards (rows, width, offsets)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.packed, self.forwards = 0, []

    def _forward(self, slots, pieces, offsets, width):
        self.forwards.append((len(slots), width, list(offsets)))
        return super()._forward(slots, pieces, offsets, width)

    def decode_and_prefill(self, *a):
        self.packed += 1
        return super().decode_and_prefill(*a)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def same_steps(a, b, slots, steps=3):
    """Decode a few steps on both decoders: the caches they hold agree."""
    for t in range(steps):
        last = [7 + t + s for s in slots]
        np.testing.assert_allclose(a.decode(slots, last), b.decode(slots, last), atol=TOL)


def packed_against_oracle(model, running, starting, slots=5, max_len=96):
    """Prefill `running` in slots 0.., decode one step, then one packed step that decodes them and
    starts `starting` in the next slots; every logit held to the oracle's decode then prefill."""
    ours, oracle = Counting(model, slots, max_len), TorchDecoder(model, slots, max_len, **OFF)
    old = list(range(len(running)))
    new = list(range(len(running), len(running) + len(starting)))
    for dec in (ours, oracle):
        dec.prefill(old, running)
        dec.decode(old, [11 + s for s in old])
    assert ours.packs(starting, len(running))
    last = [21 + s for s in old]
    decoded, started = ours.decode_and_prefill(old, last, new, starting)
    np.testing.assert_allclose(decoded, oracle.decode(old, last), atol=TOL)
    np.testing.assert_allclose(started, oracle.prefill(new, starting), atol=TOL)
    assert list(ours.host_lengths[old + new]) == [len(p) + 2 for p in running] + list(map(len, starting))
    same_steps(ours, oracle, old + new)
    return ours


def test_a_packed_step_matches_decode_then_prefill(model):
    rng = np.random.default_rng(0)
    running = [ids(rng, 30), ids(rng, 5), ids(rng, 17)]  # rows of different lengths, longer than the window
    starting = [ids(rng, 3), ids(rng, 25)]
    assert max(map(len, starting)) > WINDOW  # a piece's sliding layer slides within the piece
    packed_against_oracle(model, running, starting, slots=6)


def test_with_no_row_decoding_a_packed_step_is_a_prefill_without_padding(model):
    """Prompts of different lengths as one packed forward; the group's long common start runs once."""
    rng = np.random.default_rng(5)
    head = ids(rng, 30)
    prompts = [head + ids(rng, 2), head + ids(rng, 19), head + ids(rng, 7)]
    ours, oracle = Counting(model, 4, 64), TorchDecoder(model, 4, 64, **OFF)
    decoded, started = ours.decode_and_prefill([], [], [3, 0, 1], prompts)
    assert decoded.shape[0] == 0
    np.testing.assert_allclose(started, oracle.prefill([3, 0, 1], prompts), atol=TOL)
    assert ours.forwards == [(1, 30, [0])]  # the common start ran once, then the rest packed
    assert ours.prefix_ids == prompts[0]
    same_steps(ours, oracle, [3, 0, 1])


def test_a_packed_piece_resumes_from_the_prefix_entry(model):
    """A new row that shares the entry's start runs only its tail, from an offset, inside the step."""
    rng = np.random.default_rng(1)
    head = ids(rng, 40)
    running = [head + ids(rng, 6), ids(rng, 9)]  # the first becomes the entry
    starting = [ids(rng, 4), head + ids(rng, 7), head[:MIN_SHARED_PREFIX + 2]]
    ours = packed_against_oracle(model, running, starting, slots=5)
    assert ours.prefix_ids == running[0]  # the entry still holds the longer prompt's start


@pytest.mark.parametrize("cpu_inference", [False, True])
@pytest.mark.parametrize("old", [[3, 0, 2], [4]])
def test_decoding_rows_in_any_slot_order_read_in_place_or_gathered(model_dir, cpu_inference, old):
    """Rows decoding in a packed step out of slot order: with most slots decoding (3 of 5) their
    attention reads every slot's keys where they lie, with few (1 of 5) a gathered copy; both held
    to the oracle, on the plain layout and on the inference layout's (numpy's BLAS, packed)."""
    from runtime.engines.torch.models.attention import PackedStep

    model = load_model(model_dir, cpu_inference=cpu_inference)
    rng = np.random.default_rng(3)
    ours, oracle = TorchDecoder(model, 5, 64), TorchDecoder(model, 5, 64, **OFF)
    running, starting = [ids(rng, 9 + 7 * i) for i in range(len(old))], [ids(rng, 11)]
    for dec in (ours, oracle):
        dec.prefill(old, running)
    assert PackedStep(ours.cache, old, [1] * len(old), [], [], [], 2).in_place == (len(old) == 3)
    last = [21 + s for s in old]
    decoded, started = ours.decode_and_prefill(old, last, [1], starting)
    np.testing.assert_allclose(decoded, oracle.decode(old, last), atol=TOL)
    np.testing.assert_allclose(started, oracle.prefill([1], starting), atol=TOL)
    same_steps(ours, oracle, old + [1])


@pytest.mark.parametrize("cpu_inference", [False, True])
@pytest.mark.parametrize("rows", [[3, 0, 2], [4]])
def test_a_decode_step_over_some_slots_matches_the_whole_sequence(model_dir, cpu_inference, rows):
    """A plain decode step over some slots, out of order: with most of them (3 of 5) it reads every
    slot's keys in place (KVCache.reads_in_place), with one a gathered copy. Each row's logits
    are the model's over its whole sequence without a cache, at its last position."""
    import torch

    model = load_model(model_dir, cpu_inference=cpu_inference)
    rng = np.random.default_rng(4)
    dec = TorchDecoder(model, 5, 64, prefix_cache=False)
    prompts = [ids(rng, 6 + 9 * i) for i in range(5)]
    dec.prefill(list(range(5)), prompts)
    assert dec.cache.view(rows).reads_in_place() == (len(rows) == 3)
    for step in range(2):
        last = [30 + 3 * step + r for r in rows]
        got = np.asarray(dec.decode(rows, last))
        for r, t in zip(rows, last):
            prompts[r] = prompts[r] + [t]
        with torch.inference_mode():
            want = [model(torch.tensor([prompts[r]]))[0, -1].numpy() for r in rows]
        np.testing.assert_allclose(got, np.stack(want), atol=TOL)


def test_a_slot_reused_by_a_packed_step(model):
    """A released slot's old keys (a longer prompt) stay masked out when a packed piece takes it."""
    rng = np.random.default_rng(2)
    ours, oracle = TorchDecoder(model, 2, 64), TorchDecoder(model, 2, 64, **OFF)
    long, other, short = ids(rng, 40), ids(rng, 12), ids(rng, 6)
    for dec in (ours, oracle):
        dec.prefill([0, 1], [long, other])
        dec.release(0)
    decoded, started = ours.decode_and_prefill([1], [5], [0], [short])
    np.testing.assert_allclose(decoded, oracle.decode([1], [5]), atol=TOL)
    np.testing.assert_allclose(started, oracle.prefill([0], [short]), atol=TOL)
    same_steps(ours, oracle, [0, 1], steps=4)


def test_packing_is_off_where_it_would_cost(model):
    dec = TorchDecoder(model, 4, 64, chunk_tokens=16)
    # Past one chunk, the decoding rows' tokens counted: a prefill.
    assert dec.packs([[1] * 10, [2] * 4], 2) and not dec.packs([[1] * 10, [2] * 5], 2)
    assert not TorchDecoder(model, 4, 64, pack=False).packs([[1]], 0)
    assert not TorchDecoder(model, 4, 64, every_slot=True).packs([[1]], 0)  # a GPU decodes every slot in place


def test_greedy_generation_is_token_identical_with_packing_on_and_off(model, model_dir):
    tok = Tokenizer.from_dir(model_dir.path)
    tok.eos_token_ids = frozenset()  # random weights: every row runs to its own max_tokens
    rng = np.random.default_rng(3)
    head = ids(rng, 30)
    prompts = [ids(rng, n) for n in (12, 3, 40, 7, 19, 1, 26, 9)] + [head + ids(rng, n) for n in (2, 14, 5)]
    limits = [int(n) for n in rng.integers(1, 12, size=len(prompts))]  # rows finish at different steps
    runs = {}
    for pack in (False, True):
        dec = Counting(model, 3, max(map(len, prompts)) + max(limits), pack=pack)
        gen = Generator(dec, tok)
        for i, (p, n) in enumerate(zip(prompts, limits)):
            gen.add(Request(str(i), p, n, 0.0, 1.0, 0))
        done = {}
        while gen.active:  # 3 slots for 11 rows: slots refill mid-run
            done.update((r.key, r.tokens) for r in gen.step())
        runs[pack] = [done[str(i)] for i in range(len(prompts))], dec.packed
    assert runs[True][0] == runs[False][0]
    assert [len(t) for t in runs[True][0]] == limits
    assert runs[False][1] == 0 and runs[True][1] >= 3  # rows really started inside decode steps


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "qwen3", "qwen3-window", "qwen3_moe"])
def test_every_family_through_a_packed_step(family, tmp_path, monkeypatch):
    """Each model file's layers over a packed sequence: Gemma 3's sliding and full layers with
    their own rotations, Phi-3's partial rotary, Qwen3's q/k norms and window, the MoE router."""
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "home"))
    path, _ = make_family(family, tmp_path / family)
    model = load_model(resolve_model(str(path)))
    rng = np.random.default_rng(4)
    packed_against_oracle(model, [ids(rng, 20), ids(rng, 6)], [ids(rng, 13), ids(rng, 2)], slots=4, max_len=48)


def test_flat_index_writes_where_the_advanced_index_assignment_did():
    """store at flat_index's indices lands every head of every token where the cache's indexing
    says (slot, head, position) is: per-row slots (a forward's view) and per-token ones (a packed step)."""
    import torch

    from runtime.engines.torch.models.attention import flat_index, store

    class Cache:
        k = torch.zeros(2, 5, 3, 12, 4)  # layers, slots, kv heads, max_len, head_dim
        v = torch.zeros(2, 5, 3, 12, 4)

    Cache.flat = [(Cache.k[i].view(-1, 4), Cache.v[i].view(-1, 4)) for i in range(2)]  # as KVCache lays them
    rows, positions = torch.tensor([4, 1]), torch.tensor([[2, 3, 4], [7, 8, 9]])
    k, v = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4)  # (B, kv_heads, T, head_dim)
    store(Cache, 1, k, v, flat_index(rows, positions, 3, 12))
    want = torch.zeros(5, 3, 12, 4)
    want[rows[:, None], :, positions] = k.transpose(1, 2)
    assert torch.equal(Cache.k[1], want) and not Cache.k[0].any()
    packed_rows, packed_pos = torch.tensor([[0, 2, 2]]), torch.tensor([[5, 0, 1]])
    k1 = torch.randn(1, 3, 3, 4)
    store(Cache, 0, k1, k1, flat_index(packed_rows, packed_pos, 3, 12))
    want0 = torch.zeros(5, 3, 12, 4)
    want0[packed_rows[0], :, packed_pos[0]] = k1[0].transpose(0, 1)
    assert torch.equal(Cache.k[0], want0) and torch.equal(Cache.v[0], want0)
