"""The model families (Qwen3, Qwen3 with a sliding window, Mistral with a sliding
window, Phi-3 with partial rotary, Gemma 3 text, Qwen3-MoE) held to transformers on random
small configs made with transformers' own config classes: logits of padded batches and
through the KV cache with continuous batching, greedy generation against `generate`, on torch
and MLX; adapters against PEFT; Qwen3-MoE's router choices.
"""

import json

import numpy as np
import pytest
import torch

from runtime.engines import OptimSpec

from runtime.engines.registry import get_engine
from runtime.engines.torch.models import load_model as torch_load
from runtime.engines.generation import generate
from runtime.models.lora import LoraSpec, init_tensors, load_adapter, save_adapter
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import FAMILIES, WINDOW, make_family

peft = pytest.importorskip("peft")
mx = pytest.importorskip("mlx.core")

TOL = 1e-4
NAMES = sorted(FAMILIES)


@pytest.fixture(scope="session")
def family(tmp_path_factory, tiny_home):
    """name -> (ModelDir, transformers model), each built once per session."""
    built = {}

    def get(name):
        if name not in built:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPILLPACK_HOME", str(tiny_home))
                path, hf = make_family(name, tmp_path_factory.mktemp("families") / name)
                built[name] = resolve_model(str(path)), hf
        return built[name]

    return get


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 990, size=n).tolist() for n in lengths]


def hf_alone(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].numpy()  # (T, V)


def decode_through_cache(decoder, prompts, split):
    """Each row prefilled with its first `split[b]` tokens into a shared cache (rows of different
    lengths), then fed one token at a time, every running row in one decode step; returns each
    row's logits at every position from split[b] - 1 on."""
    slots = list(range(len(prompts)))
    first = decoder.prefill(slots, [p[:s] for p, s in zip(prompts, split)])
    got = [[first[b]] for b in slots]
    pos = list(split)
    while True:
        running = [b for b in slots if pos[b] < len(prompts[b])]
        if not running:
            return [np.stack(g) for g in got]
        logits = decoder.decode(running, [prompts[b][pos[b]] for b in running])
        for n, b in enumerate(running):
            got[b].append(logits[n])
            pos[b] += 1


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_torch_padded_batch_matches_transformers(family, name, side):
    md, hf = family(name)
    ours = torch_load(md)
    seqs = prompts_of([20, 7, 13])
    assert max(map(len, seqs)) > WINDOW  # a sliding layer really slides
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = torch.tensor(s), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, positions=positions, attn_mask=mask).numpy()
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(got[b][mask[b].bool().numpy()], hf_alone(hf, s), atol=TOL, rtol=0, err_msg=f"row {b}")


@pytest.mark.parametrize("engine", ["torch-cpu", "mlx"])
@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_and_continuous_batching_match_transformers(family, name, engine):
    """Rows longer than the sliding window, decoded through the cache next to rows of other
    lengths (the generator's path), on both engines; and MLX's right-padded full forward."""
    md, hf = family(name)
    model = get_engine(engine).load_model(md)
    prompts = prompts_of([21, 6, 14], seed=1)
    got = decode_through_cache(model.make_decoder(3, 32), prompts, split=[5, 3, 11])
    for b, p in enumerate(prompts):
        want = hf_alone(hf, p)[[5, 3, 11][b] - 1:]
        np.testing.assert_allclose(got[b], want, atol=TOL, rtol=0, err_msg=f"row {b}")
    if engine == "mlx":
        T = max(map(len, prompts))
        padded = np.array([p + [0] * (T - len(p)) for p in prompts])  # right padding: hidden by causality
        full = np.array(model(mx.array(padded)))
        for b, p in enumerate(prompts):
            np.testing.assert_allclose(full[b, : len(p)], hf_alone(hf, p), atol=TOL, rtol=0, err_msg=f"row {b}")


def hf_greedy(hf, prompts, max_new, pad_id):
    T = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    return out[:, T:].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers_generate(family, name):
    md, hf = family(name)
    tok = Tokenizer.from_dir(md.path)
    tok.eos_token_ids = frozenset()  # random weights: compare every token
    prompts = prompts_of([3 + (7 * i) % 19 for i in range(16)], seed=2)
    assert len(prompts) >= 16 and len(set(map(len, prompts))) >= 12
    expected = hf_greedy(hf, prompts, 8, md.config["vocab_size"] - 3)
    for engine in ("torch-cpu", "mlx"):
        model = get_engine(engine).load_model(md)
        got = generate(model, tok, prompts, max_tokens=8, batch=5)  # 5 slots, 16 rows: refills mid-run
        assert [r.tokens for r in got] == expected, engine


def lora_targets(md):
    from runtime.models.arch import architecture

    args = architecture(md.config).args.from_dict(md.config)
    return tuple(sorted({k.split(".")[-1] for i in range(args.num_hidden_layers) for k in args.lora_linears(i)}))


def peft_targets(md):
    """What PEFT can wrap in transformers' model: transformers 5 keeps Qwen3-MoE's experts as
    3-D parameters, not linears, so there the attention projections only."""
    if md.arch == "qwen3_moe":
        return ("k_proj", "o_proj", "q_proj", "v_proj")
    return lora_targets(md)


def random_lora(config, spec, seed=3):
    tensors = init_tensors(config, spec, seed)
    rng = np.random.default_rng(seed)
    return {k: (v if "lora_A" in k else rng.normal(0, 0.05, v.shape).astype(np.float32)) for k, v in tensors.items()}


def train_batch(seed=0):
    from runtime.data.train import Example, collate

    rng = np.random.default_rng(seed)
    examples = [Example(rng.integers(0, 990, size=n).tolist(), [0] * (n // 2) + [1] * (n - n // 2)) for n in (9, 14, 5)]
    return collate(examples, pad_id=0)


@pytest.mark.parametrize("name", NAMES)
def test_four_step_adapter_loads_in_peft_with_the_same_logits(family, name, tmp_path):
    md, hf = family(name)
    targets = peft_targets(md)
    if name == "phi3":
        assert targets == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")  # the fused names PEFT uses
    spec = LoraSpec(rank=4, alpha=8.0, targets=targets)
    session = get_engine("torch-cpu").train_session(md, spec, random_lora(md.config, spec), OptimSpec())
    ids, labels = train_batch()
    for _ in range(4):
        session.forward_backward([(ids, labels)], int((labels != -100).sum()))
        session.apply(1e-2)
    save_adapter(tmp_path / "adapter", session.adapter(), spec, str(md.path), md.config["num_hidden_layers"])
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == list(targets)
    ours = get_engine("torch-cpu").load_model(md, load_adapter(tmp_path / "adapter"))
    with torch.no_grad():
        got = ours(torch.from_numpy(ids))
        pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        want = pm(input_ids=torch.from_numpy(ids)).logits
        with pm.disable_adapter():
            plain = pm(input_ids=torch.from_numpy(ids)).logits
    assert (got - want).abs().max().item() < TOL
    assert (plain - want).abs().max().item() > 1e-3  # the adapter really changes the model
    pm.unload()  # the session-shared HF model gets its plain linears back


@pytest.mark.parametrize("rows", [1, 2], ids=["one-thread", "row-threads"])
@pytest.mark.parametrize("name", NAMES)
def test_lora_gradients_match_peft(family, name, rows):
    """Also with the batch's 3 rows split across 2 threads (runtime/engines/torch/row_threads.py):
    each family's per-thread state (an MoE's routed tokens, a window's masks) kept apart."""
    from runtime.engines.torch.row_threads import RowThreads

    md, hf = family(name)
    spec = LoraSpec(rank=4, alpha=8.0, targets=peft_targets(md))
    tensors = random_lora(md.config, spec)
    ids, labels = train_batch(1)
    n = int((labels != -100).sum())
    session = get_engine("torch-cpu").train_session(md, spec, tensors, OptimSpec())
    session.rows = RowThreads(rows)
    session.forward_backward([(ids, labels)], n)
    ours = {k: session.params[k].grad.detach().clone() for k in session.names}

    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0)
    pm = peft.get_peft_model(hf.train(), cfg)
    try:
        peft.set_peft_model_state_dict(pm, {f"base_model.model.{k}": torch.from_numpy(v) for k, v in tensors.items()})
        logits = pm(input_ids=torch.from_numpy(ids)).logits
        lab = torch.from_numpy(labels)
        loss = torch.nn.functional.cross_entropy(logits[lab != -100], lab[lab != -100], reduction="sum") / n
        loss.backward()
        theirs = {k.replace("base_model.model.", "").replace(".default", ""): p.grad
                  for k, p in pm.named_parameters() if p.requires_grad}
    finally:
        pm.unload()
        hf.eval()
    assert set(theirs) == set(ours)
    for k in ours:
        cos = torch.nn.functional.cosine_similarity(ours[k].flatten(), theirs[k].flatten(), dim=0).item()
        assert cos >= 0.9999, (k, cos)


@pytest.mark.parametrize("name", NAMES)
def test_training_moves_between_engines(family, name):
    """Two AdamW steps on torch, the checkpoint tensors loaded into MLX: one more step on each
    leaves the same adapter and moments, so a tune of this family resumes on the other engine."""
    md, _ = family(name)
    spec = LoraSpec(rank=2, alpha=4.0, targets=lora_targets(md))
    init = init_tensors(md.config, spec, 3)
    ids, labels = train_batch(2)
    n = int((labels != -100).sum())
    t = get_engine("torch-cpu").train_session(md, spec, init, OptimSpec(weight_decay=0.01))
    for _ in range(2):
        t.forward_backward([(ids, labels)], n)
        t.apply(5e-3)
    m = get_engine("mlx").train_session(md, spec, init, OptimSpec(weight_decay=0.01))
    m.load(t.export(), 2)
    losses = [s.forward_backward([(ids, labels)], n)[0] / n for s in (t, m)]
    for s in (t, m):
        s.apply(5e-3)
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    a, b = t.export(), m.export()
    assert sorted(a) == sorted(b) and any(k.endswith(".exp_avg_sq") for k in a)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=0, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_tune_resumes_on_the_other_engine_through_the_cli(family, name, home, tmp_path):
    """A tune of each family stopped after 2 of 4 steps on torch-cpu and finished on mlx: every
    step's loss within 1e-4 of an uninterrupted torch-cpu run, each step run once."""
    from tests.conftest import REPO, events_of, run_cli

    md, _ = family(name)
    data = tmp_path / "train.jsonl"
    data.write_text("".join((REPO / "examples/data/train.jsonl").read_text().splitlines(True)[:24]))
    base = ["tune", str(md.path), str(data), "--steps", "4", "--batch", "2", "--lr", "1e-3", "--ckpt-every", "1",
            "--targets", ",".join(lora_targets(md))]

    def losses(r):
        assert r.returncode == 0, r.stderr
        return {e["step"]: e["loss"] for e in events_of(r.stdout) if e["event"] == "step"}

    ref = losses(run_cli(base + ["--engine", "torch-cpu", "--state", str(tmp_path / "ref")]))
    first = losses(run_cli(base + ["--engine", "torch-cpu", "--state", str(tmp_path / "s"), "--stop-after", "2"]))
    second = run_cli(base + ["--engine", "mlx", "--state", str(tmp_path / "s")])
    rest = losses(second)
    assert sorted(ref) == [1, 2, 3, 4] and sorted(first) == [1, 2] and sorted(rest) == [3, 4]
    assert [e["step"] for e in events_of(second.stdout) if e["event"] == "restore"] == [2]
    for step, loss in {**first, **rest}.items():
        assert loss == pytest.approx(ref[step], abs=1e-4), (step, loss, ref[step])
    assert (tmp_path / "s" / "adapter" / "adapter_model.safetensors").is_file()
