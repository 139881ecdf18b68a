"""--dtype: the frozen base's dtype chosen by the user (runtime/engines/registry.py). bfloat16 on
a CPU trains within rounding of float32, halves the weights a row job plans for, and is recorded
per process, so status tells a resume that changed it."""

import json

import pytest

from conftest import REPO, events_of, run_cli

TUNE = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "6", "--batch", "2", "--lr", "1e-3", "--engine", "torch-cpu"]


def losses(stdout: str) -> list[float]:
    return [e["loss"] for e in events_of(stdout) if e["event"] == "step"]


def test_a_bfloat16_base_trains_within_rounding_of_float32(home, tmp_path):
    from safetensors.numpy import load_file
    import numpy as np

    runs = {}
    for dtype in ("float32", "bfloat16"):
        r = run_cli(TUNE + ["--dtype", dtype, "--state", str(tmp_path / dtype)])
        assert r.returncode == 0, r.stderr
        runs[dtype] = losses(r.stdout), load_file(str(tmp_path / dtype / "adapter" / "adapter_model.safetensors"))
    (l32, a32), (l16, a16) = runs["float32"], runs["bfloat16"]
    assert len(l32) == len(l16) == 6
    assert l32 != l16  # another base dtype: other arithmetic
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(l16, l32)), (l16, l32)
    for k in a32:
        cos = float((a16[k] * a32[k]).sum() / (np.linalg.norm(a16[k]) * np.linalg.norm(a32[k])))
        assert cos > 0.99, (k, cos)
    story = events_of(run_cli(["status", str(tmp_path / "bfloat16")]).stdout)
    assert [e["dtype"] for e in story if e["kind"] == "engine"] == ["bfloat16"]


def test_a_resume_on_another_dtype_is_told_within_tolerance(home, tmp_path):
    state = str(tmp_path / "s")
    r = run_cli(TUNE + ["--state", state, "--stop-after", "3"])
    assert r.returncode == 0, r.stderr
    r = run_cli(TUNE + ["--state", state, "--dtype", "bfloat16"])
    assert r.returncode == 0, r.stderr
    assert next(e for e in events_of(r.stdout) if e["event"] == "restore")["step"] == 3
    promise = next(e for e in events_of(run_cli(["status", state]).stdout) if e["kind"] == "resume_promise")
    assert promise["promise"] == "within tolerance" and "base dtype" in promise["why"], promise


def test_a_row_job_on_bfloat16_loads_and_plans_a_bfloat16_base(home, tmp_path):
    import torch

    from runtime.engines.registry import get_engine
    from runtime.jobs.sizing import dtype_bytes
    from runtime.models.ref import resolve_model

    md = resolve_model("tiny")
    engines = {d: get_engine("torch-cpu", d) for d in ("float32", "bfloat16")}
    assert {p.dtype for p in engines["bfloat16"].load_model(md).parameters()} == {torch.bfloat16}
    assert (dtype_bytes(engines["float32"]), dtype_bytes(engines["bfloat16"])) == (4, 2)  # what the memory plan counts
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(open("examples/data/prompts.jsonl").readlines()[:3]))
    r = run_cli(["run", "tiny", str(rows), "--max-tokens", "4", "--dtype", "bfloat16", "--engine", "torch-cpu",
                 "--state", str(tmp_path / "s"), "--out", str(tmp_path / "o.jsonl")])
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3


def test_mlx_takes_the_dtype_asked_for():
    mx = pytest.importorskip("mlx.core")
    from runtime.engines.registry import get_engine

    assert get_engine("mlx", "bfloat16").base_dtype == mx.bfloat16
    assert get_engine("mlx", "auto").describe()["dtype"] == ("bfloat16" if mx.default_device() == mx.gpu else "float32")


# -- --dtype auto: the CPU's policy, SPILLPACK_DTYPE, and a resume keeping its dtype ---------------

AUTO = {"SPILLPACK_DTYPE": ""}  # the suite pins float32 (conftest); these tests look at auto itself


def test_the_cpu_policy_follows_native_bfloat16_and_the_models_width():
    import torch

    from runtime.engines.torch.precision import BF16_MIN_WIDTH, precision_for

    assert precision_for("cpu", width=896, bf16_native="AMX").base == torch.bfloat16
    assert precision_for("cpu", width=BF16_MIN_WIDTH, bf16_native="AVX512-BF16").base == torch.bfloat16
    narrow = precision_for("cpu", width=64, bf16_native="AMX")
    assert narrow.base == torch.float32 and "64 wide" in narrow.why
    emulated = precision_for("cpu", width=896, bf16_native=None)
    assert emulated.base == torch.float32 and "no native bfloat16" in emulated.why
    assert precision_for("cpu", width=None, bf16_native="AMX").base == torch.float32  # no model: the safe choice


def test_native_bfloat16_is_read_from_the_cpu_and_a_cap_on_its_instructions():
    import torch

    from runtime.engines.torch.precision import cpu_bf16_native

    here = cpu_bf16_native({})
    flags = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
    assert here == ("AMX" if flags[0] else "AVX512-BF16" if flags[1] else None)
    assert cpu_bf16_native({"ONEDNN_MAX_CPU_ISA": "AVX2"}) is None  # oneDNN capped: bfloat16 emulated
    if flags[0]:
        assert cpu_bf16_native({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ("AVX512-BF16" if flags[1] else None)


def test_spillpack_dtype_stands_in_for_auto_and_a_bad_one_is_one_line(home, tmp_path):
    from conftest import one_line
    from runtime.engines.registry import base_dtype

    assert base_dtype("auto", environ={"SPILLPACK_DTYPE": "bfloat16"})[0] == "bfloat16"
    assert base_dtype("float32", environ={"SPILLPACK_DTYPE": "bfloat16"})[0] == "float32"  # --dtype wins
    assert base_dtype("auto", "bfloat16", environ={})[0] == "bfloat16"  # kept from earlier starts
    assert base_dtype("auto", "bfloat16", environ={"SPILLPACK_DTYPE": "float32"})[0] == "float32"
    assert base_dtype(None, None, environ={}) == (None, None)  # the engine's policy
    r = run_cli(TUNE + ["--state", str(tmp_path / "s")], env={"SPILLPACK_DTYPE": "float16"})
    one_line(r, "SPILLPACK_DTYPE='float16'", "Try: SPILLPACK_DTYPE=float32")
    assert not (tmp_path / "s").exists()
    r = run_cli(TUNE + ["--state", str(tmp_path / "s")], env={"SPILLPACK_DTYPE": "bfloat16"})
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert (start["dtype"], start["dtype_why"]) == ("bfloat16", "bfloat16: SPILLPACK_DTYPE=bfloat16")


def test_auto_keeps_the_dtype_a_job_began_with_and_its_resume_is_bit_identical(home, tmp_path):
    """Begun on bfloat16, resumed with --dtype auto (which alone would pick float32 for tiny):
    the resume keeps bfloat16 and ends byte-identical to an uninterrupted bfloat16 run."""
    env = {**AUTO, "OMP_NUM_THREADS": "1"}
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert run_cli(TUNE + ["--dtype", "bfloat16", "--state", whole], env=env).returncode == 0
    r = run_cli(TUNE + ["--dtype", "bfloat16", "--state", part, "--stop-after", "3"], env=env)
    assert r.returncode == 0, r.stderr
    r = run_cli(TUNE + ["--state", part], env=env)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["dtype"] == "bfloat16" and "kept from this job's earlier starts" in start["dtype_why"], start
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "part" / adapter).read_bytes() == (tmp_path / "whole" / adapter).read_bytes()
    story = events_of(run_cli(["status", part]).stdout)
    assert [e["dtype"] for e in story if e["kind"] == "engine"] == ["bfloat16", "bfloat16"]
    promise = next(e for e in story if e["kind"] == "resume_promise")
    assert promise["promise"] == "bit-identical", promise
    # A fresh job with auto on tiny (64 wide): float32, whatever the CPU.
    r = run_cli(TUNE + ["--state", str(tmp_path / "fresh"), "--steps", "1"], env=env)
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["dtype"] == "float32" and "float32" in start["dtype_why"], start


def test_a_tune_on_a_cpu_without_amx_takes_bfloat16_only_where_it_measures_faster():
    """Generation takes bfloat16 wherever the CPU has it natively; a tune on AVX512-BF16 without
    AMX only where its bfloat16 matmul was measured at least TRAIN_BF16_MIN_SPEEDUP faster."""
    import torch

    from runtime.engines.torch.precision import TRAIN_BF16_MIN_SPEEDUP, cpu_bf16_speedup, precision_for

    slow = precision_for("cpu", width=896, bf16_native="AVX512-BF16", train_speedup=0.68)
    assert slow.base == torch.float32 and "0.68x" in slow.why, slow
    assert precision_for("cpu", width=896, bf16_native="AVX512-BF16", train_speedup=TRAIN_BF16_MIN_SPEEDUP).base == torch.bfloat16
    assert precision_for("cpu", width=896, bf16_native="AVX512-BF16").base == torch.bfloat16  # generation: not measured
    speedup = cpu_bf16_speedup()
    # Emulated bfloat16 (an AVX2-only CPU) measured 0.005x on a 2-core AMD EPYC: any positive rate is sane.
    assert 0 < speedup < 100 and cpu_bf16_speedup() == speedup  # measured once per process


# -- generation on a native-bfloat16 CPU: the dtype its own decode step measures faster -------------------


def test_generation_takes_the_dtype_its_decode_step_measures_faster(monkeypatch):
    import torch

    from runtime.engines.torch import decode_dtype
    from runtime.engines.torch.precision import Precision

    config = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30}
    bf16 = Precision(torch.bfloat16, False, "bfloat16: the width policy")
    for f32_layer, want in ((0.0025, "float32"), (0.0040, "bfloat16")):
        m = {"float32_layer_s": f32_layer, "float32_rest_s": 0.010, "bfloat16_layer_s": 0.0030, "bfloat16_rest_s": 0.010}
        monkeypatch.setattr(decode_dtype, "measured", lambda c, m=m, **kw: m)
        got = decode_dtype.generation_precision(bf16, config)
        assert got.name == want and "a decode step of this model's shapes measured" in got.why, got
    f32 = Precision(torch.float32, False, "float32: no native bfloat16")
    assert decode_dtype.generation_precision(f32, config) is f32  # nothing measured where the policy says float32


def test_a_file_whose_layers_bfloat16_keeps_quantized_takes_bfloat16_unless_float32_is_clearly_faster(monkeypatch):
    """A quantized GGUF whose layers multiply in their blocks in bfloat16 (int4pack) would be held
    dequantized in float32, several times the file: the margin turns, bfloat16 unless float32's
    step is 1.1x the faster. Layers without such a kernel (Q8_0: the scratch) keep the plain rule."""
    import torch

    from runtime.engines.torch import decode_dtype
    from runtime.engines.torch.models import quant_linear
    from runtime.engines.torch.precision import Precision

    config = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30}
    bf16 = Precision(torch.bfloat16, False, "bfloat16: the width policy")
    monkeypatch.delenv("SPILLPACK_QUANT_GEMM", raising=False)
    monkeypatch.setattr(quant_linear, "choose_kernel", lambda kind, rows, cols, dtype: "int4pack")
    for f32_layer, want in ((0.0029, "bfloat16"), (0.0025, "float32")):  # bfloat16's layer 0.0030
        m = {"float32_layer_s": f32_layer, "float32_rest_s": 0.010, "bfloat16_layer_s": 0.0030, "bfloat16_rest_s": 0.010}
        monkeypatch.setattr(decode_dtype, "measured", lambda c, m=m, **kw: m)
        got = decode_dtype.generation_precision(bf16, config, layer_types={"Q4_1": 210})
        assert got.name == want, got
        assert "its layers stay in their blocks in bfloat16 (Q4_1 on int4pack in bfloat16)" in got.why, got
        plain = decode_dtype.generation_precision(bf16, config, layer_types={"Q8_0": 210})
        assert plain.name == "float32" and "its layers stay" not in plain.why, plain  # 1.1x is not reached either way
    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "dense")  # dequantized at load whatever the dtype: the plain rule
    assert "its layers stay" not in decode_dtype.generation_precision(bf16, config, layer_types={"Q4_1": 210}).why


def test_a_quantized_gguf_run_on_a_native_bfloat16_cpu_keeps_its_layers_quantized_by_default(home, tmp_path):
    """SmolLM2's Q4_1 GGUF, --dtype auto, through the CLI: the start event names the dtype rule for a
    file whose layers stay quantized, and where bfloat16 is chosen the weights are kept in their
    blocks (no dense copy: the plan's weights are about the file's, not float32's 0.5 GB)."""
    from runtime.engines.torch.precision import cpu_bf16_native
    from tests.support.gguf_files import real_model_path

    if not cpu_bf16_native():
        pytest.skip("this CPU has no native bfloat16: generation is float32 without measuring")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "The capital of France is"}) + "\n")
    r = run_cli(["run", str(real_model_path()), str(rows), "--max-tokens", "2", "--state", str(tmp_path / "s")], env=AUTO)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    if "on int4pack" not in start["dtype_why"]:
        pytest.skip(f"int4pack is not the faster kernel for these layers here: {start['dtype_why']}")
    assert "its layers stay in their blocks in bfloat16" in start["dtype_why"], start
    if start["dtype"] == "bfloat16":
        assert start["memory_plan"]["quantized"] == {"Q4_1": 210} and start["memory_plan"]["weights_gb"] < 0.2, start


def test_a_run_on_a_native_bfloat16_cpu_measures_its_decode_step_once_and_keeps_it(home, tmp_path):
    from runtime.engines.torch.precision import cpu_bf16_native
    from tests.support.memory_shapes import make_shape

    if not cpu_bf16_native():
        pytest.skip("this CPU has no native bfloat16: generation is float32 without measuring")
    model = make_shape("narrow-512", tmp_path / "narrow")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "the a of"}) + "\n")
    whys = []
    for i in range(2):
        r = run_cli(["run", str(model), str(rows), "--max-tokens", "2", "--state", str(tmp_path / f"s{i}")], env=AUTO)
        assert r.returncode == 0, r.stderr
        start = next(e for e in events_of(r.stdout) if e["event"] == "start")
        assert "a decode step of this model's shapes measured" in start["dtype_why"], start
        whys.append((start["dtype"], start["dtype_why"]))
        if i == 0:
            cache = (home / "cache" / "rates.json").read_bytes()
    assert whys[0] == whys[1]  # the second job read the first one's measurement
    assert (home / "cache" / "rates.json").read_bytes() == cache
    assert b"decode dtype 1" in cache and b"hidden_size=512" in cache


SHAPE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 12, "vocab_size": 32000, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False}


def test_the_decode_step_measurement_holds_what_it_plans(tmp_path):
    """The measurement's four models (their embedding and head at the real vocabulary) raise the
    process's high water mark by about what measure_bytes counts: what the memory guard reads."""
    import subprocess
    import sys

    code = ("import json, sys; from tests.support.peak import vm_hwm_kb; import torch; torch.set_num_threads(1)\n"
            "from runtime.engines.torch import decode_dtype\n"
            f"config = json.loads({json.dumps(json.dumps(SHAPE))})\n"
            "torch.zeros(1) @ torch.zeros(1); before = vm_hwm_kb() * 1024; decode_dtype.measure(config)\n"
            "print(json.dumps([vm_hwm_kb() * 1024 - before, decode_dtype.measure_bytes(config)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    grew, planned = json.loads(r.stdout.splitlines()[-1])
    assert planned > 2**26 and 0.7 * planned <= grew <= 1.3 * planned, (grew, planned)


def test_a_measurement_that_would_not_fit_the_jobs_memory_is_not_made(home, monkeypatch):
    """Under a memory cap too small for the four models, bfloat16 is kept without measuring (the
    least memory), the start's why says so, and nothing is cached; with room it is measured."""
    import torch

    from runtime.engines.torch import decode_dtype
    from runtime.engines.torch.precision import Precision

    calls = []
    monkeypatch.setattr(decode_dtype, "measure", lambda c: calls.append(c) or
                        {"float32_layer_s": 1e-3, "float32_rest_s": 1e-3, "bfloat16_layer_s": 2e-3, "bfloat16_rest_s": 2e-3})
    bf16 = Precision(torch.bfloat16, False, "bfloat16: the width policy")
    need = decode_dtype.measure_bytes(SHAPE) / 2**30
    import psutil

    held = psutil.Process().memory_info().rss / 2**30
    got = decode_dtype.generation_precision(bf16, SHAPE, max_mem_gb=held + 2 * need)
    assert got.name == "bfloat16" and "not measured: measuring its decode step would hold" in got.why and "--max-mem-gb" in got.why
    assert not calls and not (home / "cache" / "rates.json").exists()
    got = decode_dtype.generation_precision(bf16, SHAPE, max_mem_gb=held + 8 * need)
    assert got.name == "float32" and "measured" in got.why and len(calls) == 1
