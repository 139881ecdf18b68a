"""--dtype: the frozen base's dtype chosen by the user (runtime/engines/registry.py). bfloat16 on
a CPU trains within rounding of float32, halves the weights a row job plans for, and is recorded
per process, so status tells a resume that changed it."""

import pytest

from conftest import events_of, run_cli

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
