"""A float32 CPU base's decode step on numpy (runtime/engines/torch/models/numpy_step.py): which
models take it, and its logits held to the model's own forward (the decoder with numpy_step=False)
step after step: rows in and out of slot order, few and most slots, a sliding window, every
product kernel the layout may choose (numpy's BLAS, MKL, oneDNN's packed weights), Qwen2's
biases, a Llama-3 rotation, an adapter's LoRA updates; greedy tokens identical through the Generator."""

import numpy as np
import pytest
import torch

from runtime.engines.generation import Generator, Request
from runtime.engines.torch.decode import TorchDecoder
from runtime.engines.torch.models import layout, load_model
from runtime.engines.torch.models.small_gemm import blas_is_faster
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import WINDOW, make_family

TOL = 1e-5


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "home"))


def family_dir(tmp_path, name):
    if name == "tiny":
        return resolve_model(str(ensure_tiny()))
    return resolve_model(str(make_family(name, tmp_path / name)[0]))


def ids(rng, n):
    return rng.integers(5, 990, size=n).tolist()


def steps_agree(model, slots=5, max_len=64, steps=3):
    """Prefill every slot, then decode on numpy and on the model's forward side by side: all rows
    in order, some out of order (read in place), one (gathered); every step's logits agree."""
    rng = np.random.default_rng(0)
    ours, oracle = TorchDecoder(model, slots, max_len), TorchDecoder(model, slots, max_len, numpy_step=False)
    assert ours.numpy_step is not None and oracle.numpy_step is None
    prompts = [ids(rng, 3 + 7 * i) for i in range(slots)]
    assert max(map(len, prompts)) > WINDOW  # Mistral's window slides
    for dec in (ours, oracle):
        dec.prefill(list(range(slots)), prompts)
    worst = 0.0
    for rows in (list(range(slots)), [3, 0, 2], [4], [1, 4, 0, 3, 2]):
        for _ in range(steps):
            last = [int(t) for t in rng.integers(5, 990, size=len(rows))]
            got, want = np.asarray(ours.decode(rows, last)), np.asarray(oracle.decode(rows, last))
            worst = max(worst, float(np.abs(got - want).max()))
            np.testing.assert_allclose(got, want, atol=TOL)
    assert list(ours.host_lengths) == list(oracle.host_lengths)
    assert torch.equal(ours.cache.lengths, oracle.cache.lengths)
    np.testing.assert_allclose(ours.cache.k.numpy(), oracle.cache.k.numpy(), atol=TOL)
    return worst


@pytest.mark.parametrize("name", ["tiny", "llama", "mistral", "qwen3", "qwen3-window"])
@pytest.mark.parametrize("cpu_inference", [False, True])
def test_numpy_decode_steps_match_the_models_forward(tmp_path, name, cpu_inference):
    steps_agree(load_model(family_dir(tmp_path, name), cpu_inference=cpu_inference))


def packed_agree(model, slots=5, max_len=96):
    """Packed steps (rows starting inside a decode step) on numpy and on the forward's PackedStep:
    a prefill packed without padding, then steps whose decoding rows are most slots (in place) or
    one (gathered), with pieces starting fresh, from the prefix entry (offset, masked), and longer
    than Mistral's window; every logit agrees, and the decode steps after them."""
    from runtime.engines.prefill import MIN_SHARED_PREFIX

    rng = np.random.default_rng(1)
    ours, oracle = TorchDecoder(model, slots, max_len), TorchDecoder(model, slots, max_len, numpy_step=False)
    seen, step = [], ours.numpy_step.step
    ours.numpy_step.step = lambda tokens, slots, lengths, pieces: seen.extend(pieces) or step(tokens, slots, lengths, pieces)
    head = ids(rng, MIN_SHARED_PREFIX + 4)
    first = [head + ids(rng, 5), ids(rng, 9), ids(rng, 3)]
    results = [dec.decode_and_prefill([], [], [0, 1, 2], first) for dec in (ours, oracle)]
    np.testing.assert_allclose(results[0][1], results[1][1], atol=TOL)
    for running, starting, prompts in (([0, 2, 1], [3, 4], [head + ids(rng, 7), ids(rng, WINDOW + 6)]),
                                       ([4], [0], [ids(rng, 12)])):
        for dec in (ours, oracle):
            for slot in starting:
                dec.release(slot)
        last = [int(t) for t in rng.integers(5, 990, size=len(running))]
        (d1, s1), (d2, s2) = (dec.decode_and_prefill(running, last, starting, prompts) for dec in (ours, oracle))
        np.testing.assert_allclose(d1, d2, atol=TOL)
        np.testing.assert_allclose(s1, s2, atol=TOL)
    assert any(start > 0 for _, start, _ in seen)  # a piece started from the prefix entry, at an offset
    assert any(n > WINDOW for _, _, n in seen)
    everyone = list(range(slots))
    for _ in range(2):
        last = [int(t) for t in rng.integers(5, 990, size=slots)]
        np.testing.assert_allclose(ours.decode(everyone, last), oracle.decode(everyone, last), atol=TOL)
    np.testing.assert_allclose(ours.cache.k.numpy(), oracle.cache.k.numpy(), atol=TOL)


@pytest.mark.parametrize("name", ["tiny", "llama", "mistral", "qwen3"])
def test_packed_steps_on_numpy_match_the_forwards_packed_step(tmp_path, name):
    packed_agree(load_model(family_dir(tmp_path, name), cpu_inference=True))


@pytest.mark.parametrize("kernel", ["blas", "mkl", "packed"])
def test_every_product_kernel_of_the_inference_layout(tmp_path, monkeypatch, kernel):
    """The layout's products as the machine's measurement may choose them: numpy's BLAS, MKL over
    the transposed weights, or oneDNN's packed weights (the threshold lowered so tiny's are)."""
    monkeypatch.setenv("SPILLPACK_SMALL_GEMM", "mkl" if kernel == "mkl" else "blas")
    blas_is_faster.cache_clear()
    if kernel == "packed":
        monkeypatch.setattr(layout, "PACK_MIN_WEIGHTS", 1)
    try:
        model = load_model(family_dir(tmp_path, "tiny"), cpu_inference=True)
        qkv = model.model.layers[0].self_attn.__dict__["joined_linears"][1][0]
        assert isinstance(qkv, np.ndarray) == (kernel == "blas")
        assert (getattr(qkv, "layout", None) == torch._mkldnn) == (kernel == "packed")
        steps_agree(model)
        packed_agree(model)
    finally:
        blas_is_faster.cache_clear()


@pytest.mark.parametrize("name", ["phi3", "gemma3_text", "qwen3_moe"])
def test_families_with_their_own_layers_decode_through_their_forward(tmp_path, name):
    model = load_model(family_dir(tmp_path, name), cpu_inference=True)
    assert TorchDecoder(model, 2, 32).numpy_step is None


@pytest.mark.parametrize("kernel", ["blas", "packed"])
def test_an_adapters_updates_are_added_on_numpy(tmp_path, monkeypatch, kernel):
    """`run --adapter`: a random rank-4 LoRA on q/v/o and the whole MLP (q and v inside the joined
    q/k/v GEMM, k not; gate and up inside theirs), over the layout's BLAS or packed products; the
    adapter moves the logits, and the step agrees with the forward through the LoRA wrappers."""
    from tests.test_models import _random_lora

    monkeypatch.setenv("SPILLPACK_SMALL_GEMM", "blas")
    blas_is_faster.cache_clear()
    if kernel == "packed":
        monkeypatch.setattr(layout, "PACK_MIN_WEIGHTS", 1)
    try:
        model_dir = family_dir(tmp_path, "tiny")
        plain, with_adapter = load_model(model_dir, cpu_inference=True), load_model(model_dir, cpu_inference=True)
        _random_lora(model_dir, with_adapter, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        steps_agree(with_adapter)
        packed_agree(with_adapter)
        a, b = TorchDecoder(plain, 1, 16), TorchDecoder(with_adapter, 1, 16)
        for dec in (a, b):
            dec.prefill([0], [[5, 6, 7]])
        assert np.abs(np.asarray(a.decode([0], [9])) - np.asarray(b.decode([0], [9]))).max() > 1e-2
    finally:
        blas_is_faster.cache_clear()


def test_dropout_in_training_or_a_bfloat16_base_decodes_through_the_forward(tmp_path):
    from runtime.engines.torch.engine import apply_lora
    from runtime.models.lora import LoraSpec, init_tensors

    model_dir = family_dir(tmp_path, "tiny")
    training = load_model(model_dir, cpu_inference=True)
    spec = LoraSpec(4, 8.0, ("q_proj",), dropout=0.1)
    apply_lora(training, init_tensors(model_dir.config, spec, 0), spec, "cpu")
    assert TorchDecoder(training.train(), 2, 32).numpy_step is None  # dropout's masks are the forward's
    assert TorchDecoder(training.eval(), 2, 32).numpy_step is not None
    assert TorchDecoder(load_model(model_dir, dtype=torch.bfloat16), 2, 32).numpy_step is None
    assert TorchDecoder(load_model(model_dir), 2, 32, every_slot=True).numpy_step is None


def test_greedy_generation_is_token_identical_on_numpy_and_on_the_forward(tmp_path):
    """tiny's rows of mixed lengths through the Generator (slots refill, packed steps between the
    numpy ones): the same tokens, row for row, and rows that stop at tiny's end-of-turn."""
    model_dir = family_dir(tmp_path, "tiny")
    model = load_model(model_dir, cpu_inference=True)
    tok = Tokenizer.from_dir(model_dir.path)
    words = (ensure_tiny().parent / "tiny_corpus.txt")
    text = words.read_text().split() if words.exists() else ["the", "cat", "sat"] * 100
    rng = np.random.default_rng(5)
    prompts = [tok.encode(" ".join(text[int(s):int(s) + int(n)])) for s, n in zip(rng.integers(0, 200, 24), rng.integers(2, 40, 24))]
    limits = [int(n) for n in rng.integers(1, 24, size=len(prompts))]
    runs = {}
    for numpy_step in (False, True):
        gen = Generator(TorchDecoder(model, 4, 128, numpy_step=numpy_step), tok)
        for i, (p, n) in enumerate(zip(prompts, limits)):
            gen.add(Request(str(i), p, n))
        done = {}
        while gen.active:
            done.update((r.key, r.tokens) for r in gen.step())
        runs[numpy_step] = [done[str(i)] for i in range(len(prompts))]
    assert runs[True] == runs[False]
    assert all(0 < len(t) <= n for t, n in zip(runs[True], limits))
