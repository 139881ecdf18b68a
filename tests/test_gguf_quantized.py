"""A quantized GGUF kept quantized in memory (torch-cpu inference): logits held to the same file
loaded dense (every tensor dequantized to float32 by gguf, the path a tune takes), greedy `run`
answers identical through the CLI, no dense float copy of the model, and the start event's
memory plan naming what stays quantized. SmolLM2-135M-Instruct's Q4_1 file (Q8_0 tied
embedding), and small random files of every quantized type written with gguf's own writer."""

import json
import math
import os

import pytest
import torch

from conftest import events_of, run_cli
from tests.support.gguf_files import real_model_path
from runtime.engines.torch.models import load_model
from runtime.engines.torch.models.quant_layout import kernels, resident_bytes
from runtime.engines.torch.models.quant_linear import QuantEmbedding
from runtime.models.ref import resolve_model
from runtime.models.weights import tensor_shapes, weight_files

TOL = 1e-4
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
# family -> the quantized types write_family gives its 2-D weights
TYPES = {"llama": {"Q8_0", "Q4_0"}, "qwen3": {"Q4_1", "Q4_K"}, "qwen3_moe": {"Q5_K", "Q6_K"}, "gemma3": {"Q6_K", "Q8_0"},
         "phi3": {"Q4_K", "Q5_K"}}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2")
    path = d / real_model_path().name
    os.symlink(real_model_path(), path)
    return path, resolve_model(str(path))


@pytest.fixture(scope="module")
def small(gguf_family):
    """family -> (path, ModelDir) of a random GGUF of that family, written once (conftest)."""
    return gguf_family


def dense_float_bytes(model) -> int:
    """The bytes of the model's float tensors that hold numbers (a quantized module's meta
    placeholder holds none)."""
    return sum(p.nbytes for p in [*model.parameters(), *model.buffers()] if p.is_floating_point() and not p.is_meta)


def test_smollm2_float32_logits_are_the_dense_loads_and_no_dense_copy_exists(smollm2):
    path, md = smollm2
    quant = load_model(md, torch.float32, cpu_inference=True, quantized=True)
    found = kernels(quant)
    # float32 takes the scratch (int4pack has no fast float32 path); per layer q/k/v and gate/up
    # joined, o and down: 4 products
    assert found == {"Q8_0 embedding and head on scratch": 1, "Q4_1 on scratch": 4 * 30}, found
    assert isinstance(quant.model.embed_tokens, QuantEmbedding)
    dense_bytes = 4 * sum(math.prod(s) for s in tensor_shapes(weight_files(md.path)).values())
    # No dense float copy: the float tensors that exist are the norms; the rest is blocks.
    assert dense_float_bytes(quant) < 0.001 * dense_bytes
    held = resident_bytes(quant)
    print(f"SmolLM2 Q4_1 in float32: {held / 1e6:.1f} MB resident quantized, {dense_bytes / 1e6:.1f} MB dense")
    assert held < 0.25 * dense_bytes
    # The dense load on the same kernel (MKL's F.linear; cpu_inference's oneDNN packing sums in
    # another order, measured 1.0e-4 away at logits of 25)
    dense = load_model(md, torch.float32)
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 4, 1359, 2, 77, 900], [28, 1842, 2830, 355, 2023, 30, 216, 216, 42, 9, 7]])
    with torch.no_grad():
        a, b = quant(ids), dense(ids)
    print(f"float32 logits: {float((a - b).abs().max()):.2e} from the dense load's")
    assert float((a - b).abs().max()) <= TOL, float((a - b).abs().max())


@pytest.mark.parametrize("name", sorted(TYPES))
def test_every_quantized_type_gives_the_dense_loads_logits(small, name):
    path, md = small(name)
    quant = load_model(md, torch.float32, quantized=True)
    assert {k.split()[0] for k in kernels(quant)} == TYPES[name]
    dense = load_model(md, torch.float32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 1, 250]])
    with torch.no_grad():
        a, b = quant(ids), dense(ids)
    assert float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max()))


def test_bfloat16_int4pack_runs_q4_0_near_the_dense_bfloat16_load(small):
    from runtime.engines.torch.models import quant_linear

    if not quant_linear.int4pack_available():
        pytest.skip("this torch has no int4pack kernel for the CPU")
    path, md = small("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_QUANT_GEMM", "int4pack")
        quant = load_model(md, torch.bfloat16, quantized=True)
    assert "Q4_0 on int4pack" in kernels(quant)
    dense = load_model(md, torch.float32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 1, 250]])
    with torch.no_grad():
        a, b = quant(ids).float(), dense(ids)
    assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max())


def rows_file(path, prompts, max_tokens):
    path.write_text("".join(json.dumps({"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                         "max_tokens": max_tokens}}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def answers(model, rows, tmp_path, name, env=None):
    out = tmp_path / f"{name}.jsonl"
    r = run_cli(["run", str(model), str(rows), "--name", name, "--state", str(tmp_path / f"state-{name}"), "--out", str(out)],
                env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    return [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] for line in out.read_text().splitlines()], start


def test_run_answers_are_the_dense_runs_and_the_plan_names_what_stays_quantized(small, tmp_path, home):
    """Through the CLI, float32, greedy: a Q8_0/Q4_0 file's answers kept quantized are the
    answers of the same file dequantized at load (SPILLPACK_QUANT_GEMM=dense)."""
    path, _ = small("llama")
    rows = rows_file(tmp_path / "rows.jsonl", PROMPTS, 12)
    quant, start = answers(path, rows, tmp_path, "quant", {"SPILLPACK_QUANT_GEMM": "quantized"})
    dense, dense_start = answers(path, rows, tmp_path, "dense", {"SPILLPACK_QUANT_GEMM": "dense"})
    auto, auto_start = answers(path, rows, tmp_path, "auto")  # a small file: its dense copy fits, so dense
    assert quant == dense == auto and any(quant)
    plan, dense_plan = start["memory_plan"], dense_start["memory_plan"]
    assert plan["quantized"] == {"Q8_0": 8, "Q4_0": 7}  # 2 layers of 7 and the embedding; the head dequantized
    assert dense_plan["quantized"] == {} and auto_start["memory_plan"]["quantized"] == {}
    assert plan["weights_gb"] < 0.5 * dense_plan["weights_gb"]
    assert "kept quantized" in start["message"]
    assert start["weights_why"].startswith("kept quantized (SPILLPACK_QUANT_GEMM=quantized); the head dequantized"), start
    assert auto_start["weights_why"].startswith("dequantized at load, where it runs faster"), auto_start


def test_a_file_whose_dense_copy_would_not_fit_half_the_memory_stays_quantized(monkeypatch):
    from runtime.engines.torch.models.quant_linear import keeps_quantized

    monkeypatch.delenv("SPILLPACK_QUANT_GEMM", raising=False)
    kept, why = keeps_quantized(6 * 2**30, 10 * 2**30)
    assert kept and "dequantized it would take 6.00 GB, more than half the 10.0 GB" in why
    kept, why = keeps_quantized(4 * 2**30, 10 * 2**30)
    assert not kept and why.startswith("dequantized at load")
    kept, why = keeps_quantized(4 * 2**30, 10 * 2**30, "Q4_1 on int4pack in bfloat16")  # as fast as dense: kept
    assert kept and why.startswith("kept quantized: its layers multiply on Q4_1 on int4pack"), why
    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "dense")
    assert keeps_quantized(60 * 2**30, 10 * 2**30)[0] is False


def test_the_head_is_dequantized_where_the_weights_still_fit_half_the_memory():
    from runtime.engines.torch.models.quant_linear import dense_head

    assert dense_head(2 * 2**30, 10 * 2**30)[0] is True
    held, why = dense_head(6 * 2**30, 10 * 2**30)
    assert held is False and "more than half the 10.0 GB" in why


def test_a_dense_head_is_the_dense_loads_head_and_the_layers_stay_quantized(small):
    """quantized_modules(dense_head=True): the head's weight is an ordinary dense tensor equal to the
    dense load's, bit for bit; every layer stays in its blocks; logits as the dense load's."""
    from runtime.engines.torch.models.quant_layout import kernels

    path, md = small("llama")
    quant = load_model(md, torch.float32, quantized=True, dense_head=True)
    dense = load_model(md, torch.float32)
    assert torch.equal(quant.lm_head.weight, dense.lm_head.weight)
    assert not isinstance(quant.model.embed_tokens, torch.nn.Embedding)  # the embedding (not the head) in its blocks
    assert sum(kernels(quant).values()) == 15
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 1, 250]])
    with torch.no_grad():
        assert float((quant(ids) - dense(ids)).abs().max()) <= 1e-4


@pytest.mark.slow
def test_smollm2_run_answers_are_the_dense_runs(smollm2, tmp_path, home):
    """SmolLM2's Q4_1 GGUF through the CLI, float32, greedy: kept quantized, the dense run's answers."""
    path, _ = smollm2
    rows = rows_file(tmp_path / "rows.jsonl", PROMPTS, 24)
    quant, start = answers(path, rows, tmp_path, "quant", {"SPILLPACK_QUANT_GEMM": "quantized"})
    dense, _ = answers(path, rows, tmp_path, "dense", {"SPILLPACK_QUANT_GEMM": "dense"})
    assert quant == dense
    assert "Paris" in quant[0]
    assert start["memory_plan"]["quantized"] == {"Q4_1": 210}  # the Q8_0 tied embedding dequantized: it is the head


def test_only_layers_on_int4pack_in_bfloat16_count_as_fast(home, monkeypatch):
    """fast_kernel: a file kept quantized by default (not for memory) only where every layer type is
    Q4_0/Q4_1, the dtype bfloat16, and int4pack the kernel measured faster here for the model's shape."""
    from runtime.engines.torch.models.quant_linear import choose_kernel, fast_kernel

    monkeypatch.delenv("SPILLPACK_QUANT_GEMM", raising=False)
    on_int4 = choose_kernel("Q4_1", 1536, 576, torch.bfloat16) == "int4pack"
    assert (fast_kernel({"Q4_1": 210}, 1536, 576, torch.bfloat16) is not None) == on_int4
    assert fast_kernel({"Q4_1": 210, "Q8_0": 1}, 1536, 576, torch.bfloat16) is None  # a layer on the scratch
    assert fast_kernel({"Q4_1": 210}, 1536, 576, torch.float32) is None
    assert fast_kernel({}, 1536, 576, torch.bfloat16) is None


LOAD_PEAK = r"""
import json, sys
from runtime.base.threads import quiet_openmp
quiet_openmp()
import torch
torch.set_num_threads(1)
from runtime.engines.registry import get_engine
from runtime.engines.torch.models.quant_layout import resident_bytes
from runtime.models.ref import resolve_model
from tests.support.peak import vm_hwm_kb
md = resolve_model(sys.argv[1])
engine = get_engine("torch-cpu", width=md.config["hidden_size"], shape=md.config)
before = vm_hwm_kb() * 1024
model = engine.load_model(md)
print(json.dumps({"rise": vm_hwm_kb() * 1024 - before, "resident": resident_bytes(model), "dtype": str(engine.describe()["dtype"])}))
"""


def test_a_quantized_load_peaks_near_the_weights_it_keeps(home):
    """SmolLM2's Q4_1 file in bfloat16 on int4pack, its head dequantized: the load's high-water mark
    rises by the weights it keeps and little more, since each weight is laid out as it is read and
    what its layout frees is handed back at once (measured rise over the kept weights: 29 MiB; 55
    while every block was read before the first layout, 78 while they were kept to the end of the
    load). A fresh interpreter, so its high-water mark is the load's own."""
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "SPILLPACK_DTYPE": "bfloat16", "SPILLPACK_QUANT_GEMM": "int4pack", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(real_model_path())], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dtype"] == "bfloat16", got
    over = (got["rise"] - got["resident"]) / 2**20
    print(f"load: high-water mark rose {got['rise'] / 2**20:.1f} MiB for {got['resident'] / 2**20:.1f} MiB of weights ({over:.1f} over)")
    assert over <= 42, got


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4pack_packs_a_weight_a_few_rows_at_a_time_as_it_packs_the_whole(kind, monkeypatch):
    """int4pack converts a weight's nibbles a tile of rows at a time (int32 values are 8 times their
    packed bytes); the layout and the product are those of packing every row at once, a last tile
    of 16 rows included."""
    from runtime.engines.torch.models import quant_blocks
    from runtime.engines.torch.models.quant_linear import int4pack_available

    if not int4pack_available():
        pytest.skip("this torch has no int4pack kernel for the CPU")
    rows, cols = 272, 256  # 4 tiles of 64 and one of 16
    blocks = quant_blocks.blocks_of(quant_blocks.random_tensor(kind, rows, cols, seed=3))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.nibbles().reshape(rows, cols).to(torch.int32), 1)
    monkeypatch.setattr(quant_blocks, "PACK_ROWS_VALUES", 64 * cols)
    packed, scales = quant_blocks.int4pack(blocks, rows, cols, torch.bfloat16)
    assert torch.equal(packed, whole)
    x = torch.randn(8, cols).to(torch.bfloat16)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, quant_blocks.GROUP, scales)
    want = x.float() @ quant_blocks.dense_copy(blocks, rows, cols, torch.float32).T
    assert float((got.float() - want).abs().max()) <= 0.05 * float(want.abs().max())
