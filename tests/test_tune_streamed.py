"""`tune` with its frozen base streamed from the file's map (runtime/models/mapped.py, the torch side
in runtime/engines/torch/models/streamed.py; decided by the tune's plan, sizing.plan_tune): the
adapter equals the resident tune's, on SmolLM2's real Q4_1 GGUF (bit for bit, float32) and on float
safetensors directories (a float32 one read as mapped tensors, a bfloat16 one converted a chunk of
rows at a time); a SIGTERM exits 75 and the resumed tune ends with the same adapter; --max-mem-gb
below the resident plan streams, and below even the streamed one is one line and no state. The tune
under a real cgroup memory limit is tests/test_memory_limit.py."""

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import REPO, events_of, one_line, run_cli
from tests.support.jobproc import run_until
from tests.support.real_model import smollm2_gguf

DATA = str(REPO / "examples/data/train.jsonl")
ARGS = ["--steps", "12", "--batch", "2", "--max-seq", "64", "--dtype", "float32", "--ckpt-every", "4"]
ENV = {"SPILLPACK_THREADS": "1"}  # one thread on both sides: the same products in the same order


def tune(model, tmp_path, name, env=None, extra=()):
    state = tmp_path / name
    r = run_cli(["tune", str(model), DATA, "--name", name, "--state", str(state), *ARGS, *extra],
                env={**ENV, **(env or {})}, timeout=600)
    assert r.returncode == 0, r.stderr
    return state / "adapter", start_of(r.stdout)


def start_of(stdout):
    return next(e for e in events_of(stdout) if e["event"] == "start")


def adapter_of(path):
    return load_file(str(path / "adapter_model.safetensors"))


def assert_same(a, b, atol=0.0):
    ta, tb = adapter_of(a), adapter_of(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        diff = float(np.abs(ta[k] - tb[k]).max())
        assert diff <= atol, (k, diff)
    assert (a / "train_log.jsonl").read_text() == (b / "train_log.jsonl").read_text() or atol > 0


@pytest.fixture(scope="module")
def gguf_reference(tmp_path_factory, tiny_home):
    """The resident tune of the real GGUF (float32: its blocks dequantized at load)."""
    d = tmp_path_factory.mktemp("tune-resident")
    adapter, start = tune(smollm2_gguf(), d, "resident", {"SPILLPACK_HOME": str(tiny_home)})
    assert start["memory_plan"]["weights"] == "resident" and start["memory_plan"]["streamed_gb"] == 0, start
    return adapter


def test_a_streamed_gguf_base_tunes_the_resident_tunes_adapter_bit_for_bit(gguf_reference, tmp_path, home):
    adapter, start = tune(smollm2_gguf(), tmp_path, "stream", {"SPILLPACK_WEIGHTS": "stream"})
    assert_same(adapter, gguf_reference)
    plan = start["memory_plan"]
    assert plan["weights"] == "streamed" and plan["weights_why"] == "streamed from the file (SPILLPACK_WEIGHTS=stream)"
    assert plan["streamed_gb"] > 0.08 and plan["resident_gb"] < 0.01 and 0 < plan["layer_gb"] < 0.05, plan
    assert start["weights_why"] == plan["weights_why"] and start["base_quantized"] is False
    assert "streamed from the file (one layer and its scratch" in start["message"]


def test_a_streamed_tune_holds_no_copy_of_its_base(monkeypatch):
    """In the session: every 2-D weight of the GGUF is the map's, the LoRA tensors float32 in memory."""
    from runtime.engines import OptimSpec
    from runtime.engines.registry import get_engine
    from runtime.engines.torch.models.quant_layout import weight_bytes
    from runtime.models.gguf.model import open_gguf
    from runtime.models.lora import LoraSpec, init_tensors
    from runtime.models.ref import resolve_model

    monkeypatch.setenv("SPILLPACK_WEIGHTS", "stream")
    md = resolve_model(str(smollm2_gguf()))
    spec = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    engine = get_engine("torch-cpu", "float32", width=md.config["hidden_size"], training=True)
    session = engine.train_session(md, spec, init_tensors(md.config, spec, 0), OptimSpec())
    held, mapped = weight_bytes(session.model)
    two_d = sum(i.nbytes for i in open_gguf(md.path).tensors.values() if len(i.shape) >= 2)
    lora = sum(p.nbytes for p in session.params.values())  # held: the LoRA tensors, the norms, q/k's row orders
    assert mapped == two_d and held - lora < 0.02 * mapped, (held, lora, mapped, two_d)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in session.params.values())
    assert not any(p.requires_grad for n, p in session.model.named_parameters() if ".lora_" not in n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_streamed_float_checkpoint_tunes_the_resident_tunes_adapter(tmp_path, home, dtype):
    """A random Qwen2 (q/k/v biases) saved as float32 safetensors (its weights the map's own tensors)
    or as bfloat16 (each converted to float32 a chunk of rows at a time): within 1e-6 of the resident
    tune (the resident base runs q/k/v joined where no gradient flows, the streamed one apart)."""
    from tests.support.hf_fixtures import make_qwen2

    model_dir, model = make_qwen2(tmp_path / "qwen2")
    if dtype == "bfloat16":
        model.to(torch.bfloat16).save_pretrained(str(model_dir))
    longer = ("--max-seq", "160")  # tiny's chat template: longer rows than SmolLM2's
    resident, rstart = tune(model_dir, tmp_path, "resident", {"SPILLPACK_WEIGHTS": "resident"}, longer)
    streamed, start = tune(model_dir, tmp_path, "stream", {"SPILLPACK_WEIGHTS": "stream"}, longer)
    assert rstart["memory_plan"]["weights"] == "resident" and start["memory_plan"]["weights"] == "streamed"
    assert_same(streamed, resident, atol=1e-6)


@pytest.mark.slow
def test_a_sigterm_with_a_streamed_base_exits_75_and_resumes_to_the_same_adapter(gguf_reference, tmp_path, home):
    state = tmp_path / "sig"
    args = ["tune", str(smollm2_gguf()), DATA, "--name", "sig", "--state", str(state), *ARGS]
    env = {**ENV, "SPILLPACK_WEIGHTS": "stream"}
    rc, events, err = run_until(args, lambda e: e["event"] == "checkpoint" and e["step"] >= 4, env=env, timeout=600)
    assert rc == 75, err
    assert any(e["event"] == "preempted" for e in events), events
    r = run_cli(args, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    resumed = events_of(r.stdout)
    assert any(e["event"] == "restore" and e["step"] >= 4 for e in resumed), resumed
    assert start_of(r.stdout)["memory_plan"]["weights"] == "streamed"
    assert_same(state / "adapter", gguf_reference)


@pytest.mark.slow
def test_max_mem_gb_below_the_resident_plan_streams_and_below_the_streamed_one_is_one_line(gguf_reference, tmp_path, home):
    r = run_cli(["tune", str(smollm2_gguf()), DATA, "--name", "p", "--state", str(tmp_path / "p"), *ARGS, "--plan",
                 "--max-mem-gb", "1.0"], env=ENV)
    assert r.returncode == 0, r.stderr
    resident = events_of(r.stdout)[-1]
    assert resident["weights"] == "resident" and resident["base_quantized"] is True, resident  # its blocks, in memory
    least = min(c["estimated_peak_gb"] for c in resident["candidates"])  # the least a resident base needs
    cap = round(least - 0.05, 2)
    adapter, start = tune(smollm2_gguf(), tmp_path, "capped", extra=("--max-mem-gb", str(cap)))
    plan = start["memory_plan"]
    assert plan["weights"] == "streamed" and plan["estimated_peak_gb"] <= cap, plan
    why = plan["weights_why"]
    assert why.startswith("streamed from the file: resident, it would take about "), plan
    # Each figure counts what its own process held as it planned (--plan's and the job's): tens of MB apart.
    assert abs(float(why.split("about ")[1].split(" GB")[0]) - least) <= 0.04, (why, least)
    assert f"{cap:.2f} GB this job may use (--max-mem-gb)" in plan["weights_why"]
    assert_same(adapter, gguf_reference)
    r = run_cli(["tune", str(smollm2_gguf()), DATA, "--name", "small", "--state", str(tmp_path / "small"), *ARGS,
                 "--max-mem-gb", "0.1"], env=ENV)
    line = one_line(r, "tune needs about", "even with its base streamed from the file; --max-mem-gb allows 0.1 GB",
                    "Try: a machine with at least")
    assert not (tmp_path / "small").exists(), line
