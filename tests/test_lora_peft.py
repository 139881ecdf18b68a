"""LoRA against PEFT, the reference: same logits through a saved adapter, same gradients."""

import numpy as np
import pytest
import torch

from tests.support.hf_fixtures import make_llama, make_qwen2
from runtime.models.lora import LoraSpec, init_tensors, load_adapter, save_adapter
from runtime.data.train import Example, collate
from runtime.engines import OptimSpec
from runtime.engines.registry import get_engine
from runtime.models.ref import resolve_model

peft = pytest.importorskip("peft")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_lora(config, spec, seed=3):
    """Non-zero A and B: with B at zero (the real init) both sides would trivially agree."""
    tensors = init_tensors(config, spec, seed)
    rng = np.random.default_rng(seed)
    return {k: (v if "lora_A" in k else rng.normal(0, 0.05, v.shape).astype(np.float32)) for k, v in tensors.items()}


@pytest.fixture(params=["qwen2", "llama"])
def model(request, tmp_path, home):
    make = make_qwen2 if request.param == "qwen2" else make_llama
    path, hf = make(tmp_path / request.param)
    return resolve_model(str(path)), hf


def batch(vocab):
    rng = np.random.default_rng(0)
    examples = []
    for n in (9, 14, 5):
        ids = rng.integers(0, vocab - 10, size=n).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        examples.append(Example(ids, mask))
    return collate(examples, pad_id=0)


def test_saved_adapter_gives_peft_the_same_logits(model, tmp_path):
    model_dir, hf = model
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    tensors = random_lora(model_dir.config, spec)
    save_adapter(tmp_path / "adapter", tensors, spec, str(model_dir.path), model_dir.config["num_hidden_layers"])

    ids, _ = batch(model_dir.config["vocab_size"])
    ours = get_engine("torch-cpu").load_model(model_dir, load_adapter(tmp_path / "adapter"))
    with torch.no_grad():
        got = ours(torch.from_numpy(ids))
        peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        want = peft_model(input_ids=torch.from_numpy(ids)).logits
    assert (got - want).abs().max().item() < 1e-4
    # The adapter really changes the model (otherwise the test proves nothing).
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(input_ids=torch.from_numpy(ids)).logits
    assert (plain - want).abs().max().item() > 1e-3


def test_lora_gradients_match_peft(model):
    model_dir, hf = model
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    tensors = random_lora(model_dir.config, spec)
    ids, labels = batch(model_dir.config["vocab_size"])
    n_targets = int((labels != -100).sum())

    session = get_engine("torch-cpu").train_session(model_dir, spec, tensors, OptimSpec())
    session.forward_backward([(ids, labels)], n_targets)
    ours = {n: session.params[n].grad.detach().clone() for n in session.names}

    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(TARGETS), lora_dropout=0.0)
    pm = peft.get_peft_model(hf.train(), cfg)
    peft.set_peft_model_state_dict(pm, {f"base_model.model.{k}": torch.from_numpy(v) for k, v in tensors.items()})
    logits = pm(input_ids=torch.from_numpy(ids)).logits  # (B, T, V)
    lab = torch.from_numpy(labels)
    loss = torch.nn.functional.cross_entropy(logits[lab != -100], lab[lab != -100], reduction="sum") / n_targets
    loss.backward()
    theirs = {n.replace("base_model.model.", "").replace(".default", ""): p.grad for n, p in pm.named_parameters() if p.requires_grad}

    assert set(theirs) == set(ours)
    for name in ours:
        a, b = ours[name].flatten(), theirs[name].flatten()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert cos >= 0.9999, (name, cos)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-3), name


def test_merge_equals_adapter(tmp_path, home):
    """--merge folds B@A*scale into the weights: the merged model alone gives the adapted logits."""
    path, _ = make_qwen2(tmp_path / "m", tied=True)
    model_dir = resolve_model(str(path))
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    tensors = random_lora(model_dir.config, spec)
    session = get_engine("torch-cpu").train_session(model_dir, spec, tensors, OptimSpec())
    from runtime.jobs.tune import write_merged

    write_merged(tmp_path / "merged", session, model_dir)
    ids, _ = batch(model_dir.config["vocab_size"])
    with torch.no_grad():
        want = session.model(torch.from_numpy(ids))
        merged = get_engine("torch-cpu").load_model(resolve_model(str(tmp_path / "merged")))
        got = merged(torch.from_numpy(ids))
    assert (got - want).abs().max().item() < 1e-4
