"""Weights streamed from their file (read-only maps: runtime/models/mapped.py, the torch side in
runtime/engines/torch/models/streamed.py): logits equal to the resident load's for every quantized
type and the float types, with no dense copy of a layer; greedy `run` answers identical through
the CLI with SPILLPACK_WEIGHTS=stream; the choice between resident and streamed. The run under a
real memory limit is tests/test_memory_limit.py."""

import json

import pytest
import torch

from conftest import events_of, one_line, run_cli
from runtime.engines.torch.models import load_model
from runtime.engines.torch.models.quant_layout import weight_bytes
from runtime.models.gguf.model import open_gguf
from runtime.models.mapped import choice
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "phi3")  # all nine tensor types between them
IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 1, 250], [9, 8, 7, 6, 5, 4, 3, 2]])
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def small(gguf_family):
    return gguf_family


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_logits_are_the_resident_loads_with_no_layer_copied(small, name, monkeypatch):
    """float32: the same products over the same values, read from the map instead of a copy."""
    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "scratch")  # the kernel a streamed weight takes
    _, md = small(name)
    resident = load_model(md, torch.float32, quantized=True)
    streamed = load_model(md, torch.float32, streamed=True)
    with torch.inference_mode():
        a, b = streamed(IDS), resident(IDS)
    assert float((a - b).abs().max()) <= 1e-6 * max(1.0, float(b.abs().max())), float((a - b).abs().max())
    held, mapped = weight_bytes(streamed)
    two_d = sum(i.nbytes for i in open_gguf(md.path).tensors.values() if len(i.shape) >= 2)
    assert mapped == two_d, (mapped, two_d)  # every 2-D weight is the map's
    assert held < 0.02 * mapped, (held, mapped)  # resident: norms and the q/k row orders


def test_a_float_checkpoint_streams_its_tensors_as_they_lie_or_converted_by_chunks(home):
    """tiny's float32 safetensors: in float32 its mapped tensors are the weights themselves (the
    resident load's logits within 1e-6); in bfloat16 each is converted a chunk of rows at a time,
    rounded as the dense load rounds it (its q/k/v and gate/up run as separate bfloat16 products,
    the resident load's joined: a step of bfloat16 apart at most, from the summation order)."""
    md = resolve_model(str(ensure_tiny()))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)):
        resident = load_model(md, dtype)
        streamed = load_model(md, dtype, streamed=True)
        with torch.inference_mode():
            a, b = streamed(IDS).float(), resident(IDS).float()
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max())), (dtype, float((a - b).abs().max()))
        held, mapped = weight_bytes(streamed)
        assert mapped > 0 and held < 0.05 * mapped, (dtype, held, mapped)
        if dtype == torch.float32:
            w = streamed.model.layers[0].mlp.down_proj.weight
            assert w.untyped_storage().data_ptr() in streamed.streamed_weights  # the map, not a copy


def rows_file(path, prompts, max_tokens=10):
    path.write_text("".join(json.dumps({"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                         "max_tokens": max_tokens}}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def answers(model, rows, tmp_path, name, env):
    out = tmp_path / f"{name}.jsonl"
    r = run_cli(["run", str(model), str(rows), "--name", name, "--state", str(tmp_path / f"state-{name}"), "--out", str(out),
                 "--dtype", "float32"], env={"SPILLPACK_THREADS": "1", **env})
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    return [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] for line in out.read_text().splitlines()], start


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # Q8_0 and Q4_0; Q4_1 and Q4_K
def test_run_with_stream_forced_answers_as_the_resident_run(small, tmp_path, home, name):
    path, _ = small(name)
    rows = rows_file(tmp_path / "rows.jsonl", PROMPTS)
    streamed, start = answers(path, rows, tmp_path, "stream", {"SPILLPACK_WEIGHTS": "stream"})
    resident, rstart = answers(path, rows, tmp_path, "resident", {"SPILLPACK_WEIGHTS": "resident", "SPILLPACK_QUANT_GEMM": "scratch"})
    assert streamed == resident and any(streamed)
    plan = start["memory_plan"]
    assert plan["weights"] == "streamed" and plan["weights_why"] == "streamed from the file (SPILLPACK_WEIGHTS=stream)"
    assert plan["streamed_gb"] > 0 and plan["resident_gb"] < 0.1 * plan["streamed_gb"], plan
    assert "streamed from the file" in start["message"] and start["weights_why"] == plan["weights_why"]
    assert rstart["memory_plan"]["weights"] == "resident" and rstart["memory_plan"]["streamed_gb"] == 0


def test_a_bad_weights_mode_is_one_line_before_any_state(tmp_path, home):
    rows = rows_file(tmp_path / "rows.jsonl", PROMPTS[:1])
    r = run_cli(["run", "tiny", str(rows), "--name", "bad", "--state", str(tmp_path / "s")], env={"SPILLPACK_WEIGHTS": "maybe"})
    one_line(r, "SPILLPACK_WEIGHTS='maybe' is not resident or stream")
    assert not (tmp_path / "s").exists()


def test_resident_where_the_plan_fits_else_streamed_and_the_override(monkeypatch):
    monkeypatch.delenv("SPILLPACK_WEIGHTS", raising=False)
    streamed, why = choice(0.37, 0.33, "cgroup memory limit", True, "torch-cpu")
    assert streamed and why == ("streamed from the file: resident, it would take about 0.37 GB at the peak, more than "
                                "the 0.33 GB this job may use (cgroup memory limit)")
    streamed, why = choice(0.37, 8.0, "available memory", True, "torch-cpu")
    assert not streamed and why.startswith("resident: about 0.37 GB at the peak, within the 8.00 GB")
    assert not choice(9.0, 8.0, "free GPU memory", False, "torch-cuda")[0]  # only a CPU streams
    monkeypatch.setenv("SPILLPACK_WEIGHTS", "stream")
    assert choice(0.1, 8.0, "available memory", True, "torch-cpu") == (True, "streamed from the file (SPILLPACK_WEIGHTS=stream)")
    monkeypatch.setenv("SPILLPACK_WEIGHTS", "resident")
    assert choice(9.0, 8.0, "available memory", True, "torch-cpu") == (False, "resident (SPILLPACK_WEIGHTS=resident)")


def test_smollm2_streamed_logits_are_the_resident_loads_bit_for_bit(monkeypatch):
    """The real Q4_1 file (Q8_0 tied embedding, llama q/k permuted): float32, the same kernel."""
    from tests.support.real_model import smollm2_gguf

    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "scratch")
    md = resolve_model(str(smollm2_gguf()))
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 4, 1359, 2, 77, 900], [28, 1842, 2830, 355, 2023, 30, 216, 216, 42, 9, 7]])
    with torch.inference_mode():
        a = load_model(md, torch.float32, streamed=True)(ids)
        b = load_model(md, torch.float32, quantized=True)(ids)
    assert torch.equal(a, b), float((a - b).abs().max())


def test_max_mem_gb_below_the_resident_plan_streams_and_too_small_is_one_line(tmp_path, home):
    """--max-mem-gb decides as a limit of that size would: SmolLM2's Q4_1 GGUF resident without it,
    streamed with the same answers under a cap between the streamed and the resident plan, and a
    cap below even the streamed one is the one line naming the minimum, with no state written."""
    from tests.support.real_model import smollm2_gguf

    model = smollm2_gguf()
    rows = rows_file(tmp_path / "rows.jsonl", PROMPTS[:3], max_tokens=8)
    def capped(name, cap):
        out = tmp_path / f"{name}.jsonl"
        r = run_cli(["run", str(model), str(rows), "--name", name, "--state", str(tmp_path / f"state-{name}"), "--out", str(out),
                     "--dtype", "float32", "--max-mem-gb", str(cap)], env={"SPILLPACK_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        start = next(e for e in events_of(r.stdout) if e["event"] == "start")
        return [json.loads(x)["response"]["body"]["choices"][0]["message"]["content"] for x in out.read_text().splitlines()], start

    # 0.6 GB: the float32 copy (0.54 GB) is over half of it, so the blocks stay quantized, resident.
    resident, start = capped("resident", 0.6)
    plan = start["memory_plan"]
    assert plan["weights"] == "resident" and 0.05 < plan["resident_gb"] < 0.2 and "quantized" in start["weights_why"], start
    cap = round(start["estimated_peak_gb"] - plan["resident_gb"] / 2, 3)  # the resident plan does not fit, a streamed one does
    streamed, start = capped("streamed", cap)
    plan = start["memory_plan"]
    assert plan["weights"] == "streamed" and f"{cap:.2f} GB this job may use (--max-mem-gb)" in plan["weights_why"], plan
    assert streamed == resident and any(resident)
    r = run_cli(["run", str(model), str(rows), "--name", "small", "--state", str(tmp_path / "state-small"), "--max-mem-gb", "0.05"])
    line = one_line(r, "run needs at least", "even with its weights streamed from the file", "--max-mem-gb allows 0.05 GB",
                    "Try: the same command with --max-mem-gb")
    assert not (tmp_path / "state-small").exists(), line
