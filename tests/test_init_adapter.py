"""tune --init-adapter: step 0 is the adapter as PEFT loads it, and an adapter that does not fit
its base is refused with one line before anything is trained."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import REPO, events_of, run_cli
from tests.support.hf_fixtures import SMALL, _randomize, _save, copy_tiny_tokenizer
from runtime.models.tiny import ensure_tiny
from runtime.data.train import BatchOrder, collate, load_train_data
from runtime.engines import OptimSpec
from runtime.engines.registry import get_engine
from runtime.jobs import init_adapter
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer

peft = pytest.importorskip("peft")

DATA = str(REPO / "examples/data/train.jsonl")
TARGETS = ["q_proj", "v_proj", "up_proj"]


def qwen2(out, seed=0, **changes):
    """A small random Qwen2 checkpoint with tiny's tokenizer (so it tunes on the example data)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    copy_tiny_tokenizer(out)
    vocab = json.loads((ensure_tiny() / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, eos_token_id=vocab - 1, bos_token_id=vocab - 3, **{**SMALL, **changes})
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model)
    return _save(model, out), model


def peft_adapter(hf, out, r=4, alpha=12.0, seed=5):
    """An adapter written by PEFT itself, with a non-zero B (at B = 0 any loader would agree)."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(str(out))
    base = pm.unload()  # the base model back, without the LoRA layers
    return out, base


@pytest.fixture
def base(tmp_path, home):
    path, hf = qwen2(tmp_path / "base")
    return path, hf


def test_step0_equals_peft_loading_and_the_first_loss_is_peft_loss(base, tmp_path):
    path, hf = base
    src, hf = peft_adapter(hf, tmp_path / "peft")
    model_dir = resolve_model(str(path))
    got = init_adapter.load(str(src), model_dir, {})
    assert (got.kind, got.spec.rank, got.spec.alpha, got.spec.targets) == ("peft", 4, 12.0, ("q_proj", "up_proj", "v_proj"))

    ids = np.random.default_rng(0).integers(0, model_dir.config["vocab_size"] - 10, size=(2, 11))
    session = get_engine("torch-cpu").train_session(model_dir, got.spec, got.tensors, OptimSpec())
    with torch.no_grad():
        ours = session.model(torch.from_numpy(ids))
        theirs = peft.PeftModel.from_pretrained(hf, str(src)).eval()
        want = theirs(input_ids=torch.from_numpy(ids)).logits
        with theirs.disable_adapter():
            plain = theirs(input_ids=torch.from_numpy(ids)).logits
    assert (ours - want).abs().max().item() < 1e-5
    assert (plain - want).abs().max().item() > 1e-3  # the adapter really changes the logits

    # Through the CLI: the first step's loss is computed before any update, so it is PEFT's
    # loss on step 0's rows with the adapter loaded.
    r = run_cli(["tune", str(path), DATA, "--steps", "2", "--batch", "4", "--init-adapter", str(src), "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    tok = Tokenizer.from_dir(path)
    data = load_train_data(DATA, tok, 2048)
    rows = BatchOrder([len(e.ids) for e in data.examples], 4, 1, 0).step_examples(0)
    x, y = collate([data.examples[i] for i in rows], tok.pad_token_id or 0)
    with torch.no_grad():
        logits = theirs(input_ids=torch.from_numpy(x)).logits
        lab = torch.from_numpy(y)
        loss = torch.nn.functional.cross_entropy(logits[lab != -100], lab[lab != -100]).item()
    assert abs(done["first_loss"] - loss) < 1e-5
    # The job's identity holds the adapter's hash; the adapter written records the base.
    job = json.loads((tmp_path / "s" / "job.json").read_text())
    assert job["init_adapter"] == got.sha256 and job["rank"] == 4 and job["alpha"] == 12.0
    record = json.loads((tmp_path / "s" / "adapter" / "base.json").read_text())
    assert record["weights_sha256"] == model_dir.fingerprint() and record["num_hidden_layers"] == 2


def test_mlx_lm_layout_loads_the_same_tensors(base, tmp_path):
    """spillpack writes mlx-lm's layout under mlx/ beside PEFT's: both read back equal."""
    path, hf = base
    r = run_cli(["tune", str(path), DATA, "--steps", "2", "--targets", "q_proj,v_proj", "--rank", "4", "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    model_dir = resolve_model(str(path))
    a = init_adapter.load(str(tmp_path / "s" / "adapter"), model_dir, {})
    b = init_adapter.load(str(tmp_path / "s" / "adapter" / "mlx"), model_dir, {})
    assert b.kind == "mlx-lm" and (b.spec.rank, b.spec.alpha, b.spec.targets) == (a.spec.rank, a.spec.alpha, a.spec.targets)
    assert a.tensors.keys() == b.tensors.keys() and all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert a.sha256 == b.sha256


def _refused(r, tmp_path, needle):
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("spillpack: --init-adapter") and needle in line and "Try:" in line, line
    assert not (tmp_path / "s").exists()  # nothing trained, no state claimed


def test_refuses_a_tensor_shaped_for_another_base(base, tmp_path):
    _, other = qwen2(tmp_path / "wide", hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
    src, _ = peft_adapter(other, tmp_path / "peft")  # PEFT's own files: no base record, so the shapes tell
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(src), "--state", str(tmp_path / "s")])
    _refused(r, tmp_path, "tensor model.layers.0.mlp.up_proj.lora_A.weight has shape (4, 96)")


def test_refuses_a_layer_the_base_does_not_have(base, tmp_path):
    _, deeper = qwen2(tmp_path / "deep", num_hidden_layers=3)
    src, _ = peft_adapter(deeper, tmp_path / "peft")
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(src), "--state", str(tmp_path / "s")])
    _refused(r, tmp_path, "tensor model.layers.2.mlp.up_proj.lora_A.weight adapts model.layers.2.mlp.up_proj, which this base "
                          "does not have (2 layers)")


def test_refuses_an_adapter_whose_recorded_base_has_other_weights(base, tmp_path):
    """Same architecture and shapes, other weights: only the recorded weights hash tells them apart."""
    other, _ = qwen2(tmp_path / "other", seed=1)
    first = run_cli(["tune", str(other), DATA, "--steps", "1", "--rank", "4", "--state", str(tmp_path / "trained")])
    assert first.returncode == 0, first.stderr
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(tmp_path / "trained" / "adapter"),
                 "--state", str(tmp_path / "s")])
    _refused(r, tmp_path, "was trained on a different base: weights_sample_sha256 is")
    # The state itself as SRC says the same (from its finished adapter's record).
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(tmp_path / "trained"), "--state", str(tmp_path / "s")])
    _refused(r, tmp_path, "was trained on a different base: weights_sample_sha256 is")


def test_conflicting_rank_and_not_an_adapter_are_one_line(base, tmp_path):
    src, _ = peft_adapter(base[1], tmp_path / "peft")
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(src), "--rank", "8", "--state", str(tmp_path / "s")])
    assert r.returncode == 1 and "spillpack: --rank 8 conflicts with --init-adapter" in r.stderr and "whose rank is 4" in r.stderr
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    r = run_cli(["tune", str(base[0]), DATA, "--steps", "1", "--init-adapter", str(tmp_path / "junk"), "--state", str(tmp_path / "s")])
    _refused(r, tmp_path, "is not a LoRA adapter")


@pytest.mark.slow
def test_a_state_of_the_same_job_is_a_resume_and_another_adapter_a_fresh_optimizer(home, tmp_path):
    args = ["tune", "tiny", DATA, "--steps", "8", "--rank", "4", "--lr", "2e-3", "--ckpt-every", "4"]
    r = run_cli(args + ["--state", str(tmp_path / "a"), "--stop-after", "4"])
    assert r.returncode == 0, r.stderr
    # The same job elsewhere, from the first one's state: it continues at step 4 with the optimizer's moments.
    r = run_cli(args + ["--state", str(tmp_path / "b"), "--init-adapter", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert [e["step"] for e in ev if e["event"] == "restore"] == [4]
    assert [e["step"] for e in ev if e["event"] == "step"] == [5, 6, 7, 8]
    # ... and ends where the first one ends when it is simply run on.
    r = run_cli(args + ["--state", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr
    a, b = load_file(str(tmp_path / "a/adapter/adapter_model.safetensors")), load_file(str(tmp_path / "b/adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a/adapter/train_log.jsonl").read_text() == (tmp_path / "b/adapter/train_log.jsonl").read_text()
    # Another job (another --lr) from that state: its adapter, a fresh optimizer from step 1.
    r = run_cli(args[:-4] + ["--lr", "1e-3", "--ckpt-every", "4", "--state", str(tmp_path / "c"), "--init-adapter", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr
    ev = events_of(r.stdout)
    assert not [e for e in ev if e["event"] == "restore"] and [e["step"] for e in ev if e["event"] == "step"][0] == 1
    # Its own state as SRC is a plain resume: one line.
    r = run_cli(args + ["--state", str(tmp_path / "a"), "--init-adapter", str(tmp_path / "a")])
    assert r.returncode == 1 and "is this job's own --state" in r.stderr


def test_pack_carries_the_init_adapter_and_the_val_file(tmp_path):
    """Both are files the job reads: copied into the bundle and their options rewritten."""
    from spillpack.pack.inputs import plan

    (tmp_path / "adapter" / "mlx").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "base.json", "mlx/adapters.safetensors"):
        (tmp_path / "adapter" / name).write_bytes(b"x")
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "val.jsonl").write_text("{}\n")
    p = plan({"data": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "val.jsonl"), "init_adapter": str(tmp_path / "adapter")}, False)
    assert p.rewrites == {"data": "files/data/train.jsonl", "val": "files/data/val.jsonl", "init_adapter": "files/data/adapter"}
    assert sorted(p.files) == ["files/data/adapter/adapter_config.json", "files/data/adapter/adapter_model.safetensors",
                               "files/data/adapter/base.json", "files/data/adapter/mlx/adapters.safetensors",
                               "files/data/train.jsonl", "files/data/val.jsonl"]
