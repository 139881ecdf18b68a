"""Quantized linears (runtime/engines/torch/models/quant_linear.py): every kernel's product held
to the product by the weight dequantized with gguf's own reference, in float32; the embedding's
lookups and its head; joined groups; the kernel choice and its override."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli
from runtime.engines.torch.models import quant_blocks as qb
from runtime.engines.torch.models import quant_linear as ql
from runtime.engines.torch.models.quant_layout import join
from runtime.engines.torch.models.quant_linear import QuantEmbedding, QuantLinear
from runtime.models.gguf.tensors import QuantTensor
from tests.support.gguf_files import _random_block_bytes

TOL = 1e-4
ROWS, COLS = 96, 256  # rows a multiple of int4pack's 16, columns of Q4_K's 256-value super-blocks


def quantized(kind: str, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> QuantTensor:
    """A weight quantized by gguf's own quantizer (the K-quants, which it cannot quantize, as random blocks)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    if kind.endswith("_K"):
        raw = _random_block_bytes(rows, cols, qtype, rng)
    else:
        raw = gguf.quants.quantize(rng.normal(0, 0.5, (rows, cols)).astype(np.float32), qtype)
    return QuantTensor(kind, (rows, cols), np.ascontiguousarray(raw).reshape(rows, -1))


def reference(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """x @ W^T in float64, W gguf's float32 dequantization."""
    return x.double() @ torch.from_numpy(qt.dequantize()).double().t()


def close(got, want, tol=TOL):
    scale = max(1.0, float(want.abs().max()))
    return float((got.double() - want).abs().max()) <= tol * scale


CASES = [(k, "scratch") for k in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")] + [("Q4_0", "int4pack"), ("Q4_1", "int4pack")]


@pytest.mark.parametrize("kind,kernel", CASES)
def test_product_equals_the_dequantized_product_in_float32(kind, kernel):
    if kernel == "int4pack" and not ql.int4pack_available():
        pytest.skip("this torch has no int4pack kernel for the CPU")
    qt = quantized(kind)
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(ROWS)
    layer = QuantLinear(qt, bias, torch.float32, kernel)
    assert layer.kernel == kernel
    with torch.no_grad():
        got = layer(x.view(1, 5, COLS))
    assert got.shape == (1, 5, ROWS)
    assert close(got[0], reference(x, qt) + bias.double())
    # and it holds its blocks, not a float copy (Q8_0: 34 bytes a 32 values; the rest less)
    assert layer.nbytes() < ROWS * COLS * 1.25
    assert layer.weight.is_meta


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q6_K"])
def test_a_weight_larger_than_the_scratch_is_multiplied_by_chunks_of_rows(kind, monkeypatch):
    qt = quantized(kind, rows=80)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(2))
    whole = QuantLinear(qt, None, torch.float32, "scratch")(x)
    monkeypatch.setattr(qb, "SCRATCH_BYTES", 16 * COLS * 4 + 4)  # 16 rows a chunk: 5 chunks
    assert qb.chunk_rows(COLS, torch.float32) == 16
    chunked = QuantLinear(qt, None, torch.float32, "scratch")(x)
    assert torch.equal(whole, chunked)
    assert close(chunked, reference(x, qt))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_K"])
def test_bfloat16_scratch_product_is_the_dense_bfloat16_product_bit_for_bit(kind):
    """The dequantized rows rounded once to bfloat16, as the dense load rounds them."""
    qt = quantized(kind)
    x = torch.randn(4, COLS, generator=torch.Generator().manual_seed(3)).bfloat16()
    dense = torch.from_numpy(qt.dequantize()).bfloat16()
    got = QuantLinear(qt, None, torch.bfloat16, "scratch")(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x, dense))


def test_int4pack_in_bfloat16_is_near_the_dense_product():
    if not ql.int4pack_available():
        pytest.skip("this torch has no int4pack kernel for the CPU")
    qt = quantized("Q4_1")
    x = torch.randn(8, COLS, generator=torch.Generator().manual_seed(4))
    got = QuantLinear(qt, None, torch.bfloat16, "int4pack")(x.bfloat16()).double()
    want = reference(x, qt)
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q6_K"])
def test_embedding_lookups_and_its_head(kind):
    qt = quantized(kind, rows=64)
    emb = QuantEmbedding(qt, torch.float32)
    ids = torch.tensor([[3, 0, 63], [7, 7, 1]])
    table = torch.from_numpy(qt.dequantize())
    assert torch.equal(emb(ids), table[ids])
    hidden = torch.randn(2, 3, COLS)
    assert close(emb.head(hidden).view(-1, 64), reference(hidden.view(-1, COLS), qt))


def test_a_joined_group_is_its_parts_side_by_side():
    parts = [quantized("Q4_1", rows=r, seed=i) for i, r in enumerate((64, 32, 32))]
    biases = [torch.randn(p.shape[0]) for p in parts]
    x = torch.randn(5, COLS)
    for kernel in ("scratch", "int4pack") if ql.int4pack_available() else ("scratch",):
        joined = QuantLinear(QuantTensor("Q4_1", (128, COLS), np.concatenate([p.raw for p in parts])), torch.cat(biases), torch.float32, kernel)
        separate = torch.cat([QuantLinear(p, b, torch.float32, kernel)(x) for p, b in zip(parts, biases)], dim=-1)
        assert close(joined(x), separate.double())
    one = join(parts, biases, torch.float32)  # quant_layout's join: the rows end to end, the biases joined
    assert one.out_features == 128 and close(one(x), torch.cat([reference(x, p) + b.double() for p, b in zip(parts, biases)], -1))
    assert join([parts[0], quantized("Q8_0", rows=32)], [None, None], torch.float32) is None  # types differ


def test_the_kernel_choice_is_measured_once_and_can_be_forced(home, monkeypatch):
    from runtime.engines.hardware import _cached_rates

    if not ql.int4pack_available():
        pytest.skip("this torch has no int4pack kernel for the CPU")
    kernel = ql.choose_kernel("Q4_1", 32, 64, torch.bfloat16)
    cached = {k: v for k, v in _cached_rates().items() if "quant gemm 2" in k and "Q4_1 32x64 bfloat16" in k}
    assert len(cached) == 1 and set(next(iter(cached.values()))) == {"int4pack_s", "scratch_s"}
    m = next(iter(cached.values()))
    assert kernel == ("int4pack" if m["int4pack_s"] <= m["scratch_s"] else "scratch")
    assert ql.choose_kernel("Q8_0", 32, 64, torch.bfloat16) == "scratch"  # no kernel but the scratch
    assert ql.choose_kernel("Q4_1", 40, 64, torch.bfloat16) == "scratch"  # int4pack packs rows 16 at a time
    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "scratch")
    assert ql.choose_kernel("Q4_1", 32, 64, torch.bfloat16) == "scratch"
    assert ql.describe(torch.bfloat16) == "scratch (SPILLPACK_QUANT_GEMM)"
    monkeypatch.setenv("SPILLPACK_QUANT_GEMM", "fast")
    with pytest.raises(Exception, match="SPILLPACK_QUANT_GEMM='fast' is not int4pack or scratch or dense or quantized"):
        ql.choose_kernel("Q4_1", 32, 64, torch.bfloat16)


def test_doctor_says_which_kernel_and_why(home):
    r = run_cli(["doctor"])
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)["engines"]["torch-cpu"]["quant_gemm"]
    assert "Q4_0/Q4_1" in line and "Q8_0" in line and "scratch" in line, line
