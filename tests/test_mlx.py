"""The MLX engine against the torch engine, the peer that is itself checked against transformers.

Logits on the same HF directories, greedy generation, the training step tensor for tensor,
and a tune checkpoint that moves between torch-cpu and mlx through the CLI.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("mlx.core")

import mlx.core as mx  # noqa: E402

from runtime.models.lora import LoraSpec, init_tensors  # noqa: E402
from runtime.engines import OptimSpec  # noqa: E402
from runtime.engines.registry import get_engine  # noqa: E402
from runtime.engines.generation import generate  # noqa: E402
from runtime.engines.mlx.models import load_model as mlx_load  # noqa: E402
from runtime.models.ref import resolve_model  # noqa: E402
from runtime.engines.torch.models import load_model as torch_load  # noqa: E402
from runtime.models.tiny import ensure_tiny  # noqa: E402
from runtime.models.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import events_of, run_cli  # noqa: E402
from tests.support.hf_fixtures import make_llama, make_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        root = tmp_path_factory.mktemp("models")
        yield {
            "qwen2": make_qwen2(root / "qwen2")[0],
            "qwen2-tied": make_qwen2(root / "qwen2-tied", tied=True)[0],
            "llama": make_llama(root / "llama")[0],
            "llama-tied-sharded": make_llama(root / "llama-ts", tied=True, max_shard_size="100KB")[0],
            "tiny": ensure_tiny(),
        }


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "llama", "llama-tied-sharded", "tiny"])
def test_logits_match_torch(models, name):
    md = resolve_model(str(models[name]))
    ids = np.random.default_rng(0).integers(0, md.config["vocab_size"], size=(3, 17))
    with torch.no_grad():
        expected = torch_load(md)(torch.from_numpy(ids)).numpy()
    mm = mlx_load(md)
    got = np.array(mm(mx.array(ids)))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # Through the KV cache: a prefill of 10 tokens into row 1, then one token at a time.
    cache = mm.make_cache(2, 32)

    def row1(x):  # a forward through slot 1 only; a view's lengths are stored back, as the decoder does
        view = cache.view([1])
        out = np.array(mm(mx.array(x), cache=view))
        cache.lengths[1] = view.lengths[0]
        return out

    first = row1(ids[:1, :10])
    steps = [row1(ids[:1, t : t + 1])[0, 0] for t in range(10, 17)]
    np.testing.assert_allclose(first[0], expected[0, :10], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.stack(steps), expected[0, 10:], atol=1e-4, rtol=0)
    assert cache.lengths.tolist() == [0, 17]


def test_mlx_refuses_mismatched_weights(models, tmp_path):
    import dataclasses
    import json
    import shutil

    from runtime.base.errors import SpillpackError

    bad = tmp_path / "bad"
    shutil.copytree(models["qwen2"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg.pop("layer_types", None)  # a consistent config for 3 layers: the weights for the third are what is missing
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpillpackError, match="must be the number of layers the weights hold"):
        resolve_model(str(bad))  # refused from the headers first
    # the engine's own check, for weights that change after the model was resolved
    md = dataclasses.replace(resolve_model(str(models["qwen2"])), path=bad.resolve(), config=cfg)
    with pytest.raises(SpillpackError, match="missing .* tensor"):
        mlx_load(md)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_greedy_generation_identical(models, name):
    md = resolve_model(str(models[name]))
    tok = Tokenizer.from_dir(md.path)
    tok.eos_token_ids = frozenset()  # random weights: compare all tokens
    prompts = [tok.encode(p) for p in ["Hi", "Zebras quietly vex", "Grumpy wizards make toxic brew", "Hello, how are you? I"]]
    expected = generate(torch_load(md), tok, prompts, max_tokens=12, batch=2)  # 2 slots, 4 prompts: refills
    got = generate(get_engine("mlx").load_model(md), tok, prompts, max_tokens=12, batch=2)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    assert all(r.completion_tokens == 12 for r in got)


def test_generator_with_adapter_matches_torch(models):
    md = resolve_model(str(models["qwen2"]))
    tok = Tokenizer.from_dir(md.path)
    tok.eos_token_ids = frozenset()
    spec = LoraSpec(4, 8.0, ("q_proj", "down_proj"))
    tensors = init_tensors(md.config, spec, 1)
    rng = np.random.default_rng(1)
    tensors = {k: v if "lora_A" in k else rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in tensors.items()}
    outs = []
    for engine in ("torch-cpu", "mlx"):
        gen = get_engine(engine).generator(md, tok, adapter=(tensors, spec), slots=2, max_len=40)
        outs.append(generate_with(gen, [tok.encode("Hi there"), tok.encode("Zebras")]))
    assert outs[0] == outs[1]


def test_sampled_generation_identical(models):
    """Sampling is the generator's (numpy), not the engine's: the same rows sampled on torch and
    on MLX give the same tokens."""
    md = resolve_model(str(models["tiny"]))
    tok = Tokenizer.from_dir(md.path)
    tok.eos_token_ids = frozenset()
    prompts = [tok.encode(p) for p in ["Hi there", "Zebras quietly vex", "Great food, slow service."]]
    outs = []
    for engine in ("torch-cpu", "mlx"):
        gen = get_engine(engine).generator(md, tok, slots=2, max_len=40)
        outs.append(generate_with(gen, prompts, temperature=0.9, top_p=0.9, seed=5))
    assert outs[0] == outs[1]
    greedy = generate_with(get_engine("mlx").generator(md, tok, slots=2, max_len=40), prompts)
    assert outs[0] != greedy  # it really sampled


def generate_with(gen, prompts, **kw):
    from runtime.engines.generation import Request

    for i, p in enumerate(prompts):
        gen.add(Request(str(i), p, max_tokens=8, **kw))
    out = {}
    while gen.active:
        out.update({r.key: r.tokens for r in gen.step()})
    return out


def test_training_steps_match_torch(models):
    """Five AdamW steps with gradient accumulation, weight decay and padding: the same losses,
    adapter, moments and merged weights on both engines."""
    md = resolve_model(str(models["qwen2"]))
    spec = LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj"))
    init = init_tensors(md.config, spec, 0)
    sessions = {e: get_engine(e).train_session(md, spec, init, OptimSpec(weight_decay=0.01)) for e in ("torch-cpu", "mlx")}
    rng = np.random.default_rng(0)
    for step in range(5):
        mbs = []
        for _ in range(2):
            ids = rng.integers(0, 900, size=(2, 9))
            labels = ids.copy()
            labels[:, :3] = -100  # prompt
            labels[1, 7:] = -100  # padding
            mbs.append((ids, labels))
        n = int(sum((labels != -100).sum() for _, labels in mbs))
        losses = {}
        for e, s in sessions.items():
            loss_sum, tokens = s.forward_backward(mbs, n)
            s.apply(1e-2)
            losses[e] = loss_sum / n
            assert tokens == 36
        assert losses["mlx"] == pytest.approx(losses["torch-cpu"], abs=1e-5)
    a, b = (s.export() for s in sessions.values())
    assert sorted(a) == sorted(b) and any(k.endswith(".exp_avg_sq") for k in a)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=0, err_msg=k)
    ma, mb = (s.merged_weights() for s in sessions.values())
    assert sorted(ma) == sorted(mb)
    for k in ma:
        np.testing.assert_allclose(mb[k], ma[k], atol=1e-5, rtol=0, err_msg=k)


def test_load_export_roundtrip_across_engines(models):
    """A torch checkpoint loaded into MLX continues exactly as torch would: one more step each."""
    md = resolve_model(str(models["llama"]))
    spec = LoraSpec(2, 4.0, ("k_proj", "up_proj"))
    init = init_tensors(md.config, spec, 3)
    t = get_engine("torch-cpu").train_session(md, spec, init, OptimSpec())
    rng = np.random.default_rng(2)
    batch = [(ids, ids.copy()) for ids in [rng.integers(0, 900, size=(2, 8))]]
    for _ in range(3):
        t.forward_backward(batch, 16)
        t.apply(5e-3)
    m = get_engine("mlx").train_session(md, spec, init, OptimSpec())
    m.load(t.export(), 3)
    for s in (t, m):
        s.forward_backward(batch, 16)
        s.apply(5e-3)
    a, b = t.export(), m.export()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-6, rtol=0, err_msg=k)


# -- through the CLI -------------------------------------------------------------------------

TUNE = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "8", "--batch", "2", "--lr", "2e-3", "--warmup", "2",
        "--ckpt-every", "2", "--targets", "q_proj,v_proj,down_proj"]
LOSS_TOL = 1e-4  # absolute, on per-step mean losses of ~4-8; measured differences are ~1e-6


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


ADAPTER_TOL = 1e-4  # of each tensor's norm (docs/state.md); measured <= 1.1e-5 on tiny


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_home):
    """The uninterrupted torch-cpu run that both switched runs are held to: its losses and adapter."""
    import os

    from safetensors.numpy import load_file

    env = {"SPILLPACK_HOME": str(tiny_home)}
    state = tmp_path_factory.mktemp("ref") / "state"
    r = run_cli([*TUNE, "--engine", "torch-cpu", "--state", str(state)], env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    losses = _losses(events_of(r.stdout))
    assert sorted(losses) == list(range(1, 9))
    return losses, load_file(str(state / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("torch-cpu", "mlx"), ("mlx", "torch-cpu")])
def test_tune_resumes_on_the_other_engine(home, tmp_path, reference, first, second):
    """A real SIGTERM on one engine (exit 75), the same command on the other: each step run once,
    losses and the final adapter within docs/state.md's cross-engine tolerance of an
    uninterrupted run, and `status` telling which engine ran which steps and that promise."""
    from safetensors.numpy import load_file

    from tests.support.jobproc import run_until

    reference_losses, reference_adapter = reference
    state = tmp_path / "state"
    rc, ev1, err = run_until([*TUNE, "--engine", first, "--state", str(state)], lambda e: e["event"] == "step")
    assert rc == 75, err
    assert {e["engine"] for e in ev1} == {first}
    stopped = [e["step"] for e in ev1 if e["event"] == "checkpoint"][-1]
    assert [e["step"] for e in ev1 if e["event"] == "preempted"] == [stopped] and 1 <= stopped < 8

    r2 = run_cli([*TUNE, "--engine", second, "--state", str(state)])
    assert r2.returncode == 0, r2.stderr
    ev2 = events_of(r2.stdout)
    assert {e["engine"] for e in ev2} == {second}
    assert [e["step"] for e in ev2 if e["event"] == "restore"] == [stopped]
    assert next(e for e in ev2 if e["event"] == "start")["placement"].startswith(second)
    assert sorted(_losses(ev2)) == list(range(stopped + 1, 9))  # continues at the right step, runs each step once
    losses = {**{s: x for s, x in _losses(ev1).items() if s <= stopped}, **_losses(ev2)}
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, abs=LOSS_TOL), (step, losses[step], loss)
    done = ev2[-1]
    assert done["event"] == "done" and done["complete"] and done["steps"] == 8
    got = load_file(str(state / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(reference_adapter)
    for k, want in reference_adapter.items():  # by norm: AdamW may move one element with a near-zero moment more
        assert np.linalg.norm(got[k] - want) <= ADAPTER_TOL * np.linalg.norm(want), k

    # The history says which engine ran which steps, and which promise that gives.
    st = run_cli(["status", str(state)])
    assert st.returncode == 0, st.stderr
    story = events_of(st.stdout)
    told = [(e["kind"], e.get("engine"), e["step"]) for e in story if e["kind"] in ("process", "resume", "interrupted", "done")]
    assert told == [("process", first, None), ("interrupted", None, stopped), ("process", second, None), ("resume", None, stopped),
                    ("done", None, 8)]
    promise = story[-1]
    assert promise["kind"] == "resume_promise" and promise["promise"] == "within tolerance"
    assert promise["why"].startswith("the engine and software changed")  # one machine: the same CPU either way
    assert [(p["engine"], p["first"], p["last"]) for p in promise["ran"]] == [(first, 1, stopped), (second, stopped + 1, 8)]
    assert "each adapter tensor within 1e-4 of its norm" in promise["tolerance"]
    human = run_cli(["status", str(state)], env={"SPILLPACK_HEADLESS": "0"}).stdout
    span = lambda a, b: f"step {a}" if a == b else f"steps {a}-{b}"  # noqa: E731
    assert f"{span(1, stopped)} on {first} (" in human and f"{span(stopped + 1, 8)} on {second} (" in human


def test_doctor_measures_each_usable_engine(home):
    r = run_cli(["doctor"])
    assert r.returncode == 0, r.stderr
    report = events_of(r.stdout)[0]
    engines = report["engines"]
    for name in ("mlx", "torch-cpu"):
        assert engines[name]["usable"], engines[name]
        assert engines[name]["matmul_gflops"] > 0 and engines[name]["mem_gbps"] > 0
    if not torch.cuda.is_available():
        assert engines["torch-cuda"] == {"usable": False, "detail": "this torch has no CUDA support"} or \
            engines["torch-cuda"]["detail"] == "no CUDA device is visible"
    assert report["engine"] == "torch-cpu" and report["engine_reason"]


RUN = ["run", "tiny", None, "--max-tokens", "12", "--batch", "3", "--commit-rows", "2"]


@pytest.fixture(scope="module")
def clean_rows(tmp_path_factory, tiny_home):
    """Rows and the output of an uninterrupted torch-cpu run of them."""
    import os

    from tests.test_rows import rows_file

    d = tmp_path_factory.mktemp("rows")
    inp = rows_file(d / "in.jsonl", n=8)
    cmd = [str(inp) if a is None else a for a in RUN]
    r = run_cli(cmd + ["--engine", "torch-cpu", "--state", str(d / "clean"), "--out", str(d / "clean.jsonl")],
                env={**os.environ, "SPILLPACK_HOME": str(tiny_home)})
    assert r.returncode == 0, r.stderr
    return cmd, (d / "clean.jsonl").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("torch-cpu", "mlx"), ("mlx", "torch-cpu")])
def test_run_resumes_on_the_other_engine(home, tmp_path, clean_rows, first, second):
    """A batch `run` stopped on one engine and finished on the other: greedy rows byte-identical
    to an uninterrupted torch-cpu run, each row generated once."""
    cmd, expected = clean_rows
    state = str(tmp_path / "st")
    out = tmp_path / "out.jsonl"
    r1 = run_cli(cmd + ["--engine", first, "--state", state, "--stop-after", "3"])
    assert r1.returncode == 0, r1.stderr
    r2 = run_cli(cmd + ["--engine", second, "--state", state, "--out", str(out)])
    assert r2.returncode == 0, r2.stderr
    ev1, ev2 = events_of(r1.stdout), events_of(r2.stdout)
    assert {e["engine"] for e in ev1} == {first} and {e["engine"] for e in ev2} == {second}
    restored = [e["step"] for e in ev2 if e["event"] == "restore"]
    assert restored and restored[0] >= 3
    assert sum(e["event"] == "row" for e in ev1) + sum(e["event"] == "row" for e in ev2) == 8
    assert out.read_bytes() == expected
    story = events_of(run_cli(["status", state]).stdout)
    assert [p["engine"] for p in story if p["kind"] == "process"] == [first, second]
    assert story[-1]["kind"] == "resume_promise" and story[-1]["promise"] == "identical rows"
    assert [p["engine"] for p in story[-1]["ran"]] == [first, second]
