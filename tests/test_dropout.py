"""LoRA dropout's counter-based masks: the same on numpy, torch and MLX; a step's result does
not depend on how it is cut into micro-batches; torch and MLX train the same with dropout.
(Checkpointing on vs off with dropout, and resumes, run through the CLI in test_memory.py and
test_tune_device.py.)"""

import numpy as np
import pytest
import torch

from runtime.engines import OptimSpec

from runtime.engines.registry import get_engine
from runtime.models import dropout
from runtime.models.lora import LoraSpec, init_tensors
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_masks_are_the_same_everywhere_and_drop_p():
    tokens = dropout.token_keys(7, 3, np.array([0, 5, 2]), 300)  # (3, 300)
    features = dropout.feature_keys("model.layers.1.self_attn.q_proj", 257)
    ref = dropout.keep_mask(tokens, features, 0.25)  # numpy
    assert ref.shape == (3, 300, 257) and abs(ref.mean() - 0.75) < 0.005
    assert np.array_equal(dropout.keep_mask(torch.from_numpy(tokens), torch.from_numpy(features), 0.25).numpy(), ref)
    try:
        import mlx.core as mx
    except ImportError:
        pass
    else:
        assert np.array_equal(np.array(dropout.keep_mask(mx.array(tokens), mx.array(features), 0.25)), ref)
    # A row's mask is its own: not its neighbours', nor moved by padding after it.
    assert np.array_equal(dropout.keep_mask(dropout.token_keys(7, 3, np.array([5]), 120), features, 0.25)[0], ref[1, :120])
    assert not np.array_equal(ref[0], ref[1])
    # Other steps, seeds and modules draw other masks, each about independent of the first.
    for other in (dropout.keep_mask(dropout.token_keys(7, 4, np.array([0, 5, 2]), 300), features, 0.25),
                  dropout.keep_mask(dropout.token_keys(8, 3, np.array([0, 5, 2]), 300), features, 0.25),
                  dropout.keep_mask(tokens, dropout.feature_keys("model.layers.1.self_attn.k_proj", 257), 0.25)):
        assert abs((ref & other).mean() - 0.75**2) < 0.005


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        return resolve_model(str(ensure_tiny()))


def rows(vocab, n=4, length=24, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(n, length))
    labels = ids.copy()
    labels[:, :4] = -100
    labels[1, 15:] = -100  # a shorter row: padding after it
    return ids, labels


def step_results(session, cuts, ids, labels, steps=2):
    n = int((labels != -100).sum())
    out = []
    for step in range(steps):
        mbs = [(ids[a:b], labels[a:b]) for a, b in cuts]
        loss, _ = session.forward_backward(mbs, n, step)
        session.apply(1e-2)
        out.append(loss / n)
    return out, session.export()


@pytest.mark.parametrize("engine", ["torch-cpu", "mlx"])
def test_a_step_cut_into_other_micro_batches_drops_the_same(tiny, engine):
    """4 x 1 and 1 x 4 with dropout: the same masks, so the same math (within float32 summation)."""
    if engine == "mlx":
        pytest.importorskip("mlx.core")
    spec = LoraSpec(4, 8.0, ALL, dropout=0.3)
    init = init_tensors(tiny.config, spec, 0)
    ids, labels = rows(tiny.config["vocab_size"])
    whole = step_results(get_engine(engine).train_session(tiny, spec, init, OptimSpec(), seed=5), [(0, 4)], ids, labels)
    split = step_results(get_engine(engine).train_session(tiny, spec, init, OptimSpec(), seed=5),
                         [(0, 1), (1, 2), (2, 3), (3, 4)], ids, labels)
    np.testing.assert_allclose(split[0], whole[0], rtol=1e-5)
    # AdamW's first moments are the gradients averaged (its update divides them by their own
    # size, which magnifies float32 summation order where a gradient is near zero)
    for k in (k for k in whole[1] if k.endswith(".exp_avg")):
        scale = np.abs(whole[1][k]).max()
        np.testing.assert_allclose(split[1][k], whole[1][k], rtol=1e-4, atol=1e-5 * scale, err_msg=k)
    # and the masks matter: another seed trains differently
    other = step_results(get_engine(engine).train_session(tiny, spec, init, OptimSpec(), seed=6), [(0, 4)], ids, labels)
    assert other[0][1] != whole[0][1]  # (step 1 cannot differ: B starts at zero)


def test_torch_and_mlx_drop_the_same(tiny):
    pytest.importorskip("mlx.core")
    spec = LoraSpec(4, 8.0, ALL, dropout=0.3)
    init = init_tensors(tiny.config, spec, 0)
    ids, labels = rows(tiny.config["vocab_size"], seed=1)
    a = step_results(get_engine("torch-cpu").train_session(tiny, spec, init, OptimSpec(), seed=5), [(0, 2), (2, 4)], ids, labels)
    b = step_results(get_engine("mlx").train_session(tiny, spec, init, OptimSpec(), seed=5), [(0, 2), (2, 4)], ids, labels)
    np.testing.assert_allclose(b[0], a[0], atol=1e-5)
    # The gradients, as above, to within the two engines' float32 kernels (other masks would
    # move them by about their own size).
    for k in (k for k in a[1] if k.endswith(".exp_avg")):
        np.testing.assert_allclose(b[1][k], a[1][k], rtol=0, atol=1e-3 * np.abs(a[1][k]).max(), err_msg=k)


def test_moe_experts_drop_by_token_on_both_engines(tmp_path, monkeypatch):
    """Qwen3-MoE's experts see some of the tokens (torch gathers those routed to them, MLX runs
    every token): each token keeps its own masks either way, and checkpointing changes nothing."""
    pytest.importorskip("mlx.core")
    from tests.support.hf_fixtures import make_family

    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path / "home"))
    md = resolve_model(str(make_family("qwen3_moe", tmp_path / "moe")[0]))
    spec = LoraSpec(4, 8.0, ("q_proj", "gate_proj", "up_proj", "down_proj"), dropout=0.3)
    init = init_tensors(md.config, spec, 0)
    assert any(".experts." in k for k in init)
    ids, labels = rows(md.config["vocab_size"], length=12, seed=2)
    results = {}
    for engine, ckpt in (("torch-cpu", False), ("torch-cpu", True), ("mlx", False)):
        session = get_engine(engine).train_session(md, spec, init, OptimSpec(), seed=5)
        session.grad_checkpoint = ckpt
        results[engine, ckpt] = step_results(session, [(0, 2), (2, 4)], ids, labels, steps=3)
    plain, ckpt = results["torch-cpu", False], results["torch-cpu", True]
    assert plain[0] == ckpt[0] and all(np.array_equal(plain[1][k], ckpt[1][k]) for k in plain[1])
    np.testing.assert_allclose(results["mlx", False][0], plain[0], atol=1e-5)
