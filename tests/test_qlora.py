"""A tune on a quantized GGUF base (QLoRA's shape): the frozen base kept in its blocks, the LoRA
tensors and AdamW's moments in float32. The input gradients through a quantized product are held
to the dense product's over the same dequantized weight, and whole tunes (dropout, gradient
checkpointing, a resume after SIGTERM) to the tune of the same file dequantized at load: the
adapters agree within 1e-6 in float32."""

import json
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

from conftest import events_of, run_cli
from tests.support.gguf_files import write_family
from runtime.engines.torch.models import quant_blocks
from runtime.engines.torch.models.quant_blocks import dequantized, random_tensor
from runtime.engines.torch.models.quant_linear import QuantEmbedding, QuantLinear
from runtime.models.tiny import ensure_tiny
from runtime.models.weights import tensor_shapes, weight_files

ADAPTER_TOL = 1e-6
TUNE = ["--steps", "4", "--batch", "2", "--lr", "1e-3", "--rank", "4", "--max-seq", "96", "--dtype", "float32",
        "--ckpt-every", "2"]


def k_quant(rows: int, cols: int):
    """A Q4_K QuantTensor of random blocks with sane scales (what the random GGUFs carry)."""
    import gguf

    from runtime.models.gguf.tensors import QuantTensor
    from tests.support.gguf_files import _random_block_bytes

    return QuantTensor("Q4_K", (rows, cols), _random_block_bytes(rows, cols, gguf.GGMLQuantizationType.Q4_K,
                                                                 np.random.default_rng(3)))


def quant_tensor(kind: str, rows: int, cols: int):
    return k_quant(rows, cols) if kind == "Q4_K" else random_tensor(kind, rows, cols, seed=1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_input_gradient_through_quantized_blocks_is_the_dense_weights(kind, monkeypatch):
    # chunks of 24 rows (cols 256, float32): the weight dequantized in several chunks, forward and backward
    monkeypatch.setattr(quant_blocks, "SCRATCH_BYTES", 24 * 256 * 4)
    qt = quant_tensor(kind, 96, 256)
    dense = dequantized(quant_blocks.blocks_of(qt), 0, 96, 256, torch.float32).clone()  # what the dense load holds
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 256, generator=g, dtype=torch.float64).float()
    up = torch.randn(2, 5, 96, generator=g)
    for layer, product in ((QuantLinear(qt, None, torch.float32, "scratch"), lambda h: F.linear(h, dense)),
                           (QuantEmbedding(qt, torch.float32), lambda h: F.linear(h, dense))):
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y = layer(a) if isinstance(layer, QuantLinear) else layer.head(a)
        want = product(b)
        assert torch.allclose(y, want, rtol=0, atol=1e-5), (y - want).abs().max()
        (y * up).sum().backward()
        (want * up).sum().backward()
        err = (a.grad - b.grad).abs().max().item()
        assert err < 1e-5 * b.grad.abs().max().item(), (kind, type(layer).__name__, err)
        assert a.grad.abs().max() > 0


def test_no_gradient_without_one_needed_and_nothing_kept_for_backward():
    qt = random_tensor("Q8_0", 64, 64)
    layer = QuantLinear(qt, None, torch.float32, "scratch")
    x = torch.randn(3, 64, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "QuantProductBackward"  # (under a view)
    # The scratch is overwritten by the next product; the gradient is still the first's.
    dense = dequantized(layer.blocks, 0, 64, 64, torch.float32).clone()
    layer(torch.randn(3, 64))
    y.sum().backward()
    assert torch.allclose(x.grad, torch.ones(3, 64) @ dense, atol=1e-5)
    with torch.no_grad():
        assert layer(x).grad_fn is None


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory, tiny_home):
    built = {}

    def get(name):
        if name not in built:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPILLPACK_HOME", str(tiny_home))
                built[name] = write_family(name, tmp_path_factory.mktemp("gguf") / f"{name}.gguf", ensure_tiny())
        return built[name]

    return get


def tune(path, state, home, kernel: str, *extra, env=None):
    r = run_cli(["tune", str(path), "examples/data/train.jsonl", "--name", "q", "--state", str(state), *TUNE, *extra],
                env={"SPILLPACK_HOME": str(home), "SPILLPACK_QUANT_GEMM": kernel, "SPILLPACK_THREADS": "1", **(env or {})})
    assert r.returncode == 0, r.stderr
    return events_of(r.stdout)


def adapter(state) -> dict:
    return load_file(str(state / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    moved = max(float(np.abs(a[k]).max()) for k in a if "lora_B" in k)
    print(f"adapters differ by at most {worst:.2e} (lora_B up to {moved:.2e})")
    assert moved > 1e-4  # the tune moved the adapter
    assert worst <= ADAPTER_TOL, worst


# llama: Q8_0 and Q4_0 weights (dropout on); qwen3: Q4_1 and Q4_K (checkpointing on)
@pytest.mark.parametrize("family,extra", [("llama", ["--dropout", "0.1"]), ("qwen3", ["--grad-checkpoint", "on"])])
def test_tune_on_a_quantized_base_is_the_dense_tunes(small_gguf, family, extra, tmp_path, tiny_home):
    path = small_gguf(family)
    dense_events = tune(path, tmp_path / "dense", tiny_home, "dense", *extra)
    quant_events = tune(path, tmp_path / "quant", tiny_home, "quantized", *extra)
    start = next(e for e in quant_events if e["event"] == "start")
    assert start["base_quantized"] is True and "kept quantized" in start["weights_why"], start
    assert "; the base kept quantized" in start["message"]
    assert next(e for e in dense_events if e["event"] == "start")["base_quantized"] is False
    assert_same_adapter(adapter(tmp_path / "quant"), adapter(tmp_path / "dense"))


# ---- SmolLM2 under a real memory limit (tests/support/cgroup.py)

SMOL_TUNE = ["--steps", "20", "--batch", "2", "--lr", "1e-3", "--rank", "4", "--max-seq", "96", "--dtype", "float32",
             "--ckpt-every", "5"]


def torch_import_bytes() -> int:
    """The resident size of an interpreter that has imported torch, measured."""
    import subprocess
    import sys

    code = "import psutil, torch; print(psutil.Process().memory_info().rss)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="module")
def smol_reference(tmp_path_factory, tiny_home):
    """The unlimited tune of SmolLM2's GGUF: on this machine the rule loads it dense."""
    from tests.support.real_model import smollm2_gguf

    d = tmp_path_factory.mktemp("smol")
    env = {"SPILLPACK_HOME": str(d / "home"), "SPILLPACK_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = ["tune", str(smollm2_gguf()), "examples/data/train.jsonl", "--name", "smol", *SMOL_TUNE]
    r = run_cli([*args, "--state", str(d / "unlimited")], env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["base_quantized"] is False, start  # the reference is the dense base's tune
    dense = 4 * sum(int(np.prod(s)) for s in tensor_shapes(weight_files(smollm2_gguf())).values())
    return {"args": args, "env": env, "adapter": adapter(d / "unlimited"), "dense_bytes": dense, "dir": d}


@pytest.fixture
def memory_limit(smol_reference):
    """A cgroup whose limit is below torch's import plus SmolLM2's float32 weights."""
    from tests.support.cgroup import MemoryLimit, limit_unavailable

    if (why := limit_unavailable()) is not None:
        pytest.skip(why)
    below = torch_import_bytes() + smol_reference["dense_bytes"]
    limit = MemoryLimit.make(below - 72 * 2**20)
    print(f"limit {limit.limit / 2**20:.0f} MiB, below torch's import + the float32 weights {below / 2**20:.0f} MiB")
    yield limit
    limit.close()


@pytest.mark.slow
def test_tune_inside_a_memory_limit_is_the_unlimited_tune(smol_reference, memory_limit, tmp_path):
    r = memory_limit.run([*smol_reference["args"], "--state", str(tmp_path / "limited")], env=smol_reference["env"], timeout=900)
    assert r.returncode == 0 and memory_limit.oom_kills() == 0, (r.returncode, memory_limit.oom_kills(), r.stderr[-2000:])
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["base_quantized"] is True and "cgroup memory limit" in start["message"], start
    print(f"peak {memory_limit.peak_bytes() / 2**20:.0f} MiB of {memory_limit.limit / 2**20:.0f}")
    assert_same_adapter(adapter(tmp_path / "limited"), smol_reference["adapter"])


@pytest.mark.slow
def test_sigterm_inside_a_memory_limit_exits_75_and_resumes_exactly(smol_reference, memory_limit, tmp_path):
    args = [*smol_reference["args"], "--state", str(tmp_path / "limited")]
    p = memory_limit.popen(args, env=smol_reference["env"])
    stopped_at = None
    for line in p.stdout:
        e = json.loads(line)
        if stopped_at is None and e["event"] == "checkpoint" and e["step"] >= 5:
            p.send_signal(signal.SIGTERM)
            stopped_at = e["step"]
    assert p.wait(timeout=300) == 75, p.stderr.read()[-2000:]
    r = memory_limit.run(args, env=smol_reference["env"], timeout=900)
    assert r.returncode == 0 and memory_limit.oom_kills() == 0, (r.returncode, r.stderr[-2000:])
    restore = next(e for e in events_of(r.stdout) if e["event"] == "restore")
    assert stopped_at <= restore["step"] < 20
    assert_same_adapter(adapter(tmp_path / "limited"), smol_reference["adapter"])


@pytest.fixture(scope="module")
def dense_llama(small_gguf, tmp_path_factory, tiny_home):
    state = tmp_path_factory.mktemp("dense-llama")
    tune(small_gguf("llama"), state, tiny_home, "dense")
    return adapter(state)


def test_a_resumed_tune_on_a_quantized_base_is_the_dense_tunes(small_gguf, dense_llama, tmp_path, tiny_home):
    state = tmp_path / "quant"
    events = tune(small_gguf("llama"), state, tiny_home, "quantized", "--stop-after", "2")
    assert [e["event"] for e in events].count("step") == 2
    events = tune(small_gguf("llama"), state, tiny_home, "quantized")
    assert next(e for e in events if e["event"] == "restore")["step"] == 2
    assert_same_adapter(adapter(state), dense_llama)


def test_data_parallel_ranks_on_a_quantized_base_are_the_dense_ranks(small_gguf, tmp_path, tiny_home):
    # Two ranks sum their gradients in another order than one process: held to two dense ranks.
    for kernel in ("dense", "quantized"):
        events = tune(small_gguf("llama"), tmp_path / kernel, tiny_home, kernel, "--nproc", "2")
        assert next(e for e in events if e["event"] == "start")["base_quantized"] is (kernel == "quantized")
    assert_same_adapter(adapter(tmp_path / "quantized"), adapter(tmp_path / "dense"))
