"""Many LoRA adapters in one batch (`--adapter NAME=SRC`): each row answered as a one-adapter
run answers it, with PEFT's mixed-adapter batch as the oracle of what the adapters mean."""

import hashlib
import json
import signal

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load

from tests.conftest import events_of, one_line, run_cli
from tests.support.hf_fixtures import make_family
from tests.test_rows import kill_after_rows
from runtime.base.errors import SpillpackError
from runtime.data.rows import parse_rows
from runtime.engines.generation import Request
from runtime.engines.registry import get_engine
from runtime.jobs import adapters
from runtime.models.lora import LoraSpec, init_tensors, save_adapter
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapters of different ranks and targets: q/k/v and gate/up joined products, parts of them, and the rest.
SHAPES = [(ALL, 4), (("gate_proj", "up_proj", "down_proj"), 8), (("q_proj", "v_proj"), 2), (("k_proj", "o_proj"), 16)]


def random_adapter(config, targets, rank, seed):
    """PEFT-format tensors with B != 0 (B at zero would be the base)."""
    spec = LoraSpec(rank, 2.0 * rank, tuple(targets))
    tensors = init_tensors(config, spec, seed)
    rng = np.random.default_rng(seed)
    return {k: (v if "lora_A" in k else rng.normal(0, 0.3, v.shape).astype(np.float32)) for k, v in tensors.items()}, spec


def family_targets(config):
    """Every linear a LoRA may target: Phi-3's fused q/k/v and gate/up, the others' seven."""
    return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if config.get("model_type") == "phi3" else ALL


def generate(engine, model_dir, tokenizer, adapter, requests, slots=4, every_slot=None):
    """Any engine's greedy tokens per request key; `every_slot` (torch only): a GPU's decode step
    (every slot in place, idle ones computing a throwaway token), here on the CPU."""
    from runtime.engines.generation import Generator

    if every_slot is None:
        gen = engine.generator(model_dir, tokenizer, adapter, slots=slots, max_len=96)
    else:
        from runtime.engines.torch.decode import TorchDecoder

        gen = Generator(TorchDecoder(engine.load_model(model_dir, adapter), slots, 96, every_slot=every_slot), tokenizer)
    for r in requests:
        gen.add(r)
    out = {}
    while gen.active:
        for res in gen.step():
            out[res.key] = res.tokens
    return out


def check_rows_match_single_runs(model_dir, engine, n=12, every_slot=None):
    """A batch mixing three adapters and the base gives each row the tokens a run of its model alone gives."""
    config = model_dir.config
    targets = family_targets(config)
    ads = [random_adapter(config, targets, 4, 1), random_adapter(config, targets[:2], 8, 2),
           random_adapter(config, targets[-2:], 2, 3)]
    tok = Tokenizer.from_dir(model_dir.path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config["vocab_size"] - 10, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]
    # All but a few start alike for longer than the prefix cache's threshold: its keys are one adapter's.
    shared = rng.integers(0, config["vocab_size"] - 10, size=24).tolist()
    prompts = [p if i % 5 == 4 else shared + p for i, p in enumerate(prompts)]
    reqs = [Request(str(i), p, 8, adapter=i % 4 - 1) for i, p in enumerate(prompts)]
    mixed = generate(engine, model_dir, tok, [(t, s) for t, s in ads], reqs, every_slot=every_slot)
    base = generate(engine, model_dir, tok, None, [Request(r.key, r.prompt_ids, 8) for r in reqs])
    for a in (-1, 0, 1, 2):
        alone = generate(engine, model_dir, tok, None if a < 0 else ads[a], [Request(r.key, r.prompt_ids, 8) for r in reqs if r.adapter == a],
                         every_slot=every_slot)
        assert {k: mixed[k] for k in alone} == alone, (a, config.get("model_type"))
    for a in (0, 1, 2):  # each adapter changes its answers (a row may still come out as the base's)
        assert any(mixed[r.key] != base[r.key] for r in reqs if r.adapter == a), a


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "phi3", "gemma3_text"])
def test_each_family_answers_each_row_as_its_adapter_alone(family, tmp_path, home):
    path, _ = make_family(family, tmp_path / family)
    check_rows_match_single_runs(resolve_model(str(path)), get_engine("torch-cpu", base_dtype="float32"))


@pytest.mark.parametrize("every_slot", [False, True])
def test_a_bfloat16_base_too(tmp_path, home, every_slot):
    path, _ = make_family("llama", tmp_path / "llama")
    check_rows_match_single_runs(resolve_model(str(path)), get_engine("torch-cpu", base_dtype="bfloat16"), every_slot=every_slot)


def test_mixed_batch_logits_equal_peft_mixed_batch(tmp_path, home):
    """PEFT's own mixed-adapter batch (adapter_names per row) is what each row's adapter means."""
    peft = pytest.importorskip("peft")
    path, hf = make_family("llama", tmp_path / "llama")
    model_dir = resolve_model(str(path))
    ads = [random_adapter(model_dir.config, t, r, i) for i, (t, r) in enumerate(SHAPES[:3])]
    for i, (t, s) in enumerate(ads):
        save_adapter(tmp_path / f"a{i}", t, s, str(path), model_dir.config["num_hidden_layers"])
    ours = get_engine("torch-cpu", base_dtype="float32").load_model(model_dir, ads)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 200, size=(4, 9)))
    which = [-1, 0, 1, 2]
    ours.adapter_rows.set(np.repeat(which, 9))
    with torch.no_grad():
        got = ours(ids)
        pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a0"), adapter_name="a0")
        pm.load_adapter(str(tmp_path / "a1"), adapter_name="a1")
        pm.load_adapter(str(tmp_path / "a2"), adapter_name="a2")
        want = pm.eval()(input_ids=ids, adapter_names=["__base__", "a0", "a1", "a2"]).logits
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_a_quantized_gguf_base(tmp_path, home, monkeypatch):
    from tests.support.real_model import smollm2_gguf

    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "quantized")
    model_dir = resolve_model(str(smollm2_gguf()))
    engine = get_engine("torch-cpu", base_dtype="float32")
    assert engine.keeps_quantized(model_dir)
    check_rows_match_single_runs(model_dir, engine, n=8)


# -- the row jobs ---------------------------------------------------------------------------


@pytest.fixture
def four(tmp_path, home):
    """Four adapters of tiny, as PEFT directories, and a batch file naming them, the base and an unknown model."""
    md = resolve_model("tiny")
    for i, (t, r) in enumerate(SHAPES):
        save_adapter(tmp_path / f"ad{i}", *random_adapter(md.config, t, r, i), "tiny", md.config["num_hidden_layers"])
    models = ["tiny", "a0", "a1", "a2", "a3", "base"]
    rows = [{"custom_id": f"r{j}", "body": {"model": models[j % 6], "max_tokens": 10,
                                           "messages": [{"role": "user", "content": f"tell me {j} things"}]}} for j in range(14)]
    rows.append({"custom_id": "unknown", "body": {"model": "a9", "messages": [{"role": "user", "content": "hi"}]}})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [x for i in range(4) for x in ("--adapter", f"a{i}={tmp_path / f'ad{i}'}")]
    return tmp_path, flags


def lines(path):
    return {x["custom_id"]: x for x in map(json.loads, path.read_text().splitlines())}


def answer(line):
    return line["response"]["body"]["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_run_many_adapters_equals_one_adapter_runs_and_resumes_after_sigterm(four):
    tmp, flags = four
    common = ["run", "tiny", str(tmp / "rows.jsonl"), "--batch", "4"]
    r = run_cli(common + flags + ["--state", str(tmp / "many"), "--out", str(tmp / "many.jsonl")])
    assert r.returncode == 0, r.stderr
    many = lines(tmp / "many.jsonl")
    assert "a9" in many["unknown"]["error"]["message"] and "a0, a1, a2, a3" in many["unknown"]["error"]["message"]
    ident = json.loads((tmp / "many" / "job.json").read_text())
    model_fp = ident["model"]
    fps = dict(ident["adapters"])
    assert sorted(fps) == ["a0", "a1", "a2", "a3"] and ident["adapter"] is None
    rows = [json.loads(x) for x in (tmp / "rows.jsonl").read_text().splitlines()]

    def rows_of(*models):  # a one-model batch file of those rows
        path = tmp / f"{models[0]}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in rows if x["body"]["model"] in models))
        return str(path)

    for i in range(4):  # each adapter's rows as a plain one-adapter run answers them
        one = run_cli(["run", "tiny", rows_of(f"a{i}"), "--adapter", str(tmp / f"ad{i}"), "--state", str(tmp / f"one{i}"),
                       "--out", str(tmp / f"one{i}.jsonl")])
        assert one.returncode == 0, one.stderr
        alone = lines(tmp / f"one{i}.jsonl")
        mine = [c for c, x in many.items() if x["response"] and x["response"]["body"]["model"] == f"a{i}"]
        assert len(mine) >= 2 and all(answer(many[c]) == answer(alone[c]) for c in mine)
        # The plain adapter's identity is its two files' hash, as before named adapters: its states resume.
        files = b"".join((tmp / f"ad{i}" / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors"))
        assert json.loads((tmp / f"one{i}" / "job.json").read_text())["adapter"] == hashlib.sha256(files).hexdigest()
        for c in mine:
            want = "fp_" + hashlib.sha256(repr((model_fp, fps[f"a{i}"])).encode()).hexdigest()[:12]
            assert many[c]["response"]["body"]["system_fingerprint"] == want
    base = run_cli(["run", "tiny", rows_of("tiny", "base"), "--state", str(tmp / "base"), "--out", str(tmp / "base.jsonl")])
    plain = lines(tmp / "base.jsonl")
    based = [c for c, x in many.items() if x["response"] and x["response"]["body"]["model"] == "tiny"]
    assert base.returncode == 0 and len(based) == 5
    assert all(answer(many[c]) == answer(plain[c]) and many[c]["response"]["body"]["system_fingerprint"] ==
               plain[c]["response"]["body"]["system_fingerprint"] for c in based)
    # SIGTERM mid-batch, then the same command: the same file as the uninterrupted run.
    args = common + flags + ["--commit-rows", "1", "--state", str(tmp / "cut"), "--out", str(tmp / "cut.jsonl")]
    rc, evs = kill_after_rows(args, signal.SIGTERM, 4)
    assert rc == 75 and evs[-1]["event"] == "preempted"
    again = run_cli(args)
    assert again.returncode == 0, again.stderr
    assert [e for e in events_of(again.stdout) if e["event"] == "restore"]
    assert (tmp / "cut.jsonl").read_bytes() == (tmp / "many.jsonl").read_bytes()


def test_eval_scores_every_adapter_and_the_base_in_one_pass(four):
    tmp, flags = four
    evals = tmp / "evals.jsonl"
    evals.write_text("".join(json.dumps({"custom_id": f"e{j}", "prompt": f"say {j}", "expected": "fir"}) + "\n" for j in range(6)))
    r = run_cli(["eval", "tiny", str(evals), "--metric", "contains", "--max-tokens", "8", "--state", str(tmp / "ev"),
                 "--out", str(tmp / "ev.jsonl")] + flags[:4])
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    scores = {s["model"]: s for s in done["scores"]}
    assert list(scores) == ["tiny", "a0", "a1"] and all(s["rows"] == 6 for s in scores.values())
    out = [json.loads(x) for x in (tmp / "ev.jsonl").read_text().splitlines()]
    assert len(out) == 18 and {x["custom_id"] for x in out} == {f"e{j}" for j in range(6)}
    for name, s in scores.items():
        mine = [x for x in out if x["model"] == name]
        assert s["correct"] == sum(x["correct"] for x in mine) and s["accuracy"] == round(s["correct"] / 6, 6)
        assert s["ci95"][0] <= s["accuracy"] <= s["ci95"][1]
    assert done["accuracy"] == scores["tiny"]["accuracy"]
    # The memory plan counts one base plus each adapter's tensors, float32 as the engine holds them.
    plan = next(e for e in events_of(r.stdout) if e["event"] == "start")["memory_plan"]
    held = sum(4 * v.size for i in (0, 1) for v in st_load((tmp / f"ad{i}" / "adapter_model.safetensors").read_bytes()).values())
    assert plan["adapters_gb"] == round(held / 2**30, 6) > 0
    parts = ("weights_gb", "adapters_gb", "kv_cache_gb", "activations_gb", "runtime_gb", "layer_gb")
    assert abs(plan["estimated_peak_gb"] - sum(plan[k] for k in parts)) < 0.004
    table = r.stderr.splitlines()
    assert any(line.startswith("tiny (base)") for line in table) and any(line.startswith("a1 ") for line in table)


# -- bad input: one line each, before any row runs; an unknown model is that row's error only ---


@pytest.mark.parametrize("value, said", [
    ("a=./x,a=./y", "--adapter a= is given twice"),
    ("9lives=./x", "'9lives' is not an adapter name"),
    ("my ad=./x", "'my ad' is not an adapter name"),
    ("./x,b=./y", "has no name, beside named adapters"),
])
def test_bad_adapter_names(value, said):
    with pytest.raises(SpillpackError, match=said.replace("(", r"\(")):
        adapters.parse(value)


def test_plain_paths_stay_one_adapter():
    assert adapters.parse("./a,b/c") == [(None, "./a,b/c")]
    assert adapters.parse("s3://bucket/x=1/adapter") == [(None, "s3://bucket/x=1/adapter")]
    assert adapters.parse("a=./x,b.2=s3://b/k") == [("a", "./x"), ("b.2", "s3://b/k")]


def rows_naming(*models):
    raw = "".join(json.dumps({"custom_id": f"c{i}", "body": {"model": m, "prompt": "hi"}}) + "\n" for i, m in enumerate(models))
    return parse_rows(raw.encode(), "rows.jsonl", 8, 0.0, 1.0, 0)


def test_rows_asking_for_models_without_named_adapters_are_refused():
    with pytest.raises(SpillpackError, match="rows name 2 models"):
        adapters.route(rows_naming("math", "code"), [], "tiny", {"tiny", "base"}, False)
    # One model named in every row is OpenAI's batch file convention: not read.
    routed = adapters.route(rows_naming("gpt-4o-mini", "gpt-4o-mini"), [], "tiny", {"tiny", "base"}, False)
    assert all(r.error is None and r.served == "tiny" for r in routed)


def test_an_unknown_model_is_that_rows_error_only():
    named = [adapters.Adapter("a", "./a", {}, None, "f")]
    routed = adapters.route(rows_naming("a", "tiny", "b", None), named, "tiny", {"tiny", "base"}, False)
    assert [r.adapter for r in routed] == [0, -1, -1, -1] and [r.error is None for r in routed] == [True, True, False, True]
    assert "'b' is not served by this job" in routed[2].error and routed[2].error_param == "model"


def test_an_adapter_for_another_base_is_one_line(tmp_path, home):
    path, _ = make_family("llama", tmp_path / "llama")
    md = resolve_model(str(path))
    save_adapter(tmp_path / "other", *random_adapter(md.config, ("q_proj",), 2, 0), str(path), md.config["num_hidden_layers"])
    (tmp_path / "rows.jsonl").write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    r = run_cli(["run", "tiny", str(tmp_path / "rows.jsonl"), "--adapter", f"x={tmp_path / 'other'}", "--state", str(tmp_path / "st")])
    line = one_line(r, "--adapter", "has shape", "the base model the adapter was trained on")
    assert "--init-adapter" not in line and not (tmp_path / "st" / "segments").exists()
    r = run_cli(["run", "tiny", str(tmp_path / "rows.jsonl"), "--adapter", f"tiny={tmp_path / 'other'}", "--state", str(tmp_path / "s2")])
    one_line(r, "is the base model's name")


def test_pack_carries_every_named_adapter(tmp_path):
    from spillpack.pack.inputs import plan

    for i in range(2):
        (tmp_path / "ads" / f"a{i}").mkdir(parents=True)
        (tmp_path / "ads" / f"a{i}" / "adapter_config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    value = f"a0={tmp_path / 'ads' / 'a0'},a1={tmp_path / 'ads' / 'a1'},far=s3://bucket/adapters/far"
    p = plan({"input": str(tmp_path / "rows.jsonl"), "adapter": value}, include_weights=False)
    assert p.rewrites["adapter"] == "a0=files/data/ads/a0,a1=files/data/ads/a1,far=s3://bucket/adapters/far"
    assert {"files/data/ads/a0/adapter_config.json", "files/data/ads/a1/adapter_config.json", "files/data/rows.jsonl"} <= set(p.files)


@pytest.mark.slow
def test_a_bundle_of_named_adapters_runs_elsewhere(four, phome, tiny_home):
    import shutil

    from tests.conftest import clean_env
    from tests.test_pack import new_home, run_bundle

    tmp, flags = four
    rows = [json.loads(x) for x in (tmp / "rows.jsonl").read_text().splitlines()][:6]
    (tmp / "few.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli(["pack", "run", "tiny", str(tmp / "few.jsonl"), "--name", "four", *flags, "-o", str(tmp / "out" / "b")])
    assert r.returncode == 0, r.stderr
    job = json.loads((tmp / "out/b/files/job.json").read_text())
    assert all(part.split("=", 1)[1].startswith("files/data/") for part in job["options"]["adapter"].split(","))
    bundle = tmp / "elsewhere" / "b"
    shutil.copytree(tmp / "out" / "b", bundle)
    for i in range(4):
        shutil.rmtree(tmp / f"ad{i}")  # the bundle's own copies only
    home = new_home(tmp, tiny_home, "node")
    done = run_bundle(bundle, env=clean_env(home))
    assert done.returncode == 0, done.stderr
    out = [json.loads(x) for x in (home / "jobs" / "four" / "results.jsonl").read_text().splitlines()]
    assert [x["response"]["body"]["model"] for x in out] == ["tiny", "a0", "a1", "a2", "a3", "tiny"]
