"""Our pure-torch models against transformers' on the same random checkpoints."""

import os
from pathlib import Path

import pytest
import torch

from runtime.models.ref import resolve_model
from runtime.engines.torch.models import load_model
from tests.support.hf_fixtures import make_llama, make_qwen2

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def spillpack_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        yield


def ids_batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 10, (n,), generator=g).tolist() for n in lengths]


def max_diff(a, b):
    return (a - b).abs().max().item()


CASES = {
    "qwen2": lambda d: make_qwen2(d),
    "qwen2-tied": lambda d: make_qwen2(d, tied=True),
    "qwen2-sharded": lambda d: make_qwen2(d, max_shard_size="100KB"),
    "llama": lambda d: make_llama(d),
    "llama-tied-sharded": lambda d: make_llama(d, tied=True, max_shard_size="100KB"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    path, hf = CASES[case](tmp_path / case)
    if "sharded" in case:
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    if "tied" in case:
        from safetensors import safe_open

        keys = set().union(*(safe_open(f, "pt").keys() for f in path.glob("*.safetensors")))
        assert "lm_head.weight" not in keys
    ours = load_model(resolve_model(str(path)))
    assert (ours.lm_head is None) == ("tied" in case)
    ids = torch.tensor(ids_batch(hf.config.vocab_size, [17, 17], seed=1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert max_diff(got, expected) < TOL
    # hidden_states + logits is the same computation as forward, split for training
    with torch.no_grad():
        assert torch.equal(ours.logits(ours.hidden_states(ids)), got)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_padded_batch_matches_transformers(arch, side, tmp_path):
    path, hf = (make_qwen2 if arch == "qwen2" else make_llama)(tmp_path / arch)
    ours = load_model(resolve_model(str(path)))
    seqs = ids_batch(hf.config.vocab_size, [12, 5, 9], seed=2)
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = torch.tensor(s), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, positions=positions, attn_mask=mask)
        for b, s in enumerate(seqs):
            # The oracle: each sequence alone, unpadded.
            alone = hf(input_ids=torch.tensor([s])).logits[0]
            real = got[b][mask[b].bool()]
            assert not torch.isnan(got[b]).any()
            assert max_diff(real, alone) < TOL, f"row {b}"


def test_kv_cache_decode_matches_full_forward(tmp_path):
    path, hf = make_qwen2(tmp_path / "q")
    ours = load_model(resolve_model(str(path)))
    seq = torch.tensor(ids_batch(hf.config.vocab_size, [10], seed=3))
    with torch.no_grad():
        full = ours(seq)
        cache = ours.make_cache(1, 16)
        step = [ours(seq[:, :6], cache=cache)]
        for t in range(6, 10):
            step.append(ours(seq[:, t : t + 1], cache=cache))
    assert cache.lengths.tolist() == [10]
    assert max_diff(torch.cat(step, dim=1), full) < 1e-5


def test_bfloat16_load(tmp_path):
    path, hf = make_qwen2(tmp_path / "q")
    ours = load_model(resolve_model(str(path)), dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor(ids_batch(hf.config.vocab_size, [8]))
    with torch.no_grad():
        got = ours(ids).float()
        expected = hf(input_ids=ids).logits
    assert got.dtype == torch.float32 and max_diff(got, expected) < 0.1


def test_llama3_rope_scaling_is_applied(tmp_path):
    from runtime.models.args import ModelArgs, rope_inv_freq

    path, hf = make_llama(tmp_path / "l")
    args = ModelArgs.from_dict(resolve_model(str(path)).config)
    assert args.rope_scaling["rope_type"] == "llama3" and args.rope_theta == 500000.0
    ours = torch.from_numpy(rope_inv_freq(args))
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    plain = ModelArgs.from_dict({**resolve_model(str(path)).config, "rope_parameters": {"rope_theta": 500000.0}})
    assert not torch.allclose(torch.from_numpy(rope_inv_freq(plain)), ours)


def test_model_args_fill_derived_defaults():
    from runtime.models.families import Qwen2Args

    args = Qwen2Args.from_dict({
        "model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 8, "rope_theta": 1e6, "unknown_key": 1,
    })
    assert (args.head_dim, args.num_key_value_heads, args.attention_bias, args.rope_theta) == (8, 8, True, 1e6)
    assert args.tie_word_embeddings is False


def test_tiny_loads_and_runs():
    md = resolve_model("tiny")
    model = load_model(md)
    assert md.arch == "qwen2" and model.lm_head is None
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, md.config["vocab_size"]) and torch.isfinite(logits).all()


# --- bad input: each failure is one SpillpackError line naming what is wrong ---

import json  # noqa: E402
import shutil  # noqa: E402

from runtime.base.errors import SpillpackError  # noqa: E402


def copy_tiny(dst):
    shutil.copytree(resolve_model("tiny").path, dst)
    return dst


def error_line(excinfo):
    line = excinfo.value.line()
    assert "\n" not in line and line.startswith("spillpack: ") and ". Try: " in line
    return line


def test_missing_config_json(tmp_path):
    d = copy_tiny(tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(SpillpackError) as e:
        resolve_model(str(d))
    assert error_line(e) == f"spillpack: no config.json in {d}. Try: a Hugging Face model directory as the job's MODEL or --weights"


def test_corrupt_safetensors(tmp_path):
    d = copy_tiny(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    with pytest.raises(SpillpackError) as e:
        resolve_model(f"file://{d}")
    line = error_line(e)
    assert line.startswith(f"spillpack: {d / 'model.safetensors'} is not a readable safetensors file")


def test_truncated_safetensors_is_refused_before_load(tmp_path):
    """The header is checked against the file first: a cut file is refused when the
    model is resolved, before any tensor is read."""
    d = copy_tiny(tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # header intact, tensors cut
    with pytest.raises(SpillpackError) as e:
        resolve_model(str(d))
    assert f"{d / 'model.safetensors'} is not a readable safetensors file" in error_line(e) and "past the file's" in error_line(e)


def test_weights_not_matching_config(tmp_path):
    d = copy_tiny(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(SpillpackError) as e:  # refused from the headers, before any weight is read
        resolve_model(str(d))
    assert '"num_hidden_layers" must be the number of layers the weights hold (layers 0 to 3), not 5' in error_line(e)


def test_unknown_tag(tmp_path):
    with pytest.raises(SpillpackError) as e:
        resolve_model("mistral:70b")
    assert error_line(e).startswith("spillpack: unknown model tag 'mistral:70b' (known: tiny, qwen2.5:0.5b,")


def test_tag_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path))
    with pytest.raises(SpillpackError) as e:
        resolve_model("qwen2.5:0.5b")
    assert error_line(e) == (
        f"spillpack: no weights for qwen2.5:0.5b (looked in {tmp_path / 'models' / 'qwen2.5-0.5b'} and the Ollama store at "
        f"{os.environ.get('OLLAMA_MODELS') or Path.home() / '.ollama' / 'models'}); "
        "download Qwen/Qwen2.5-0.5B-Instruct first. Try: MODEL qwen2.5:0.5b with --weights /path/to/qwen2.5-0.5b"
    )
    with pytest.raises(SpillpackError) as e:
        resolve_model("qwen2.5:0.5b", weights=str(tmp_path / "nope"))
    assert f"looked in --weights {tmp_path / 'nope'}" in error_line(e)


def test_tag_with_weights(tmp_path):
    path, _ = make_qwen2(tmp_path / "w")
    md = resolve_model("qwen2.5:0.5b", weights=f"file://{path}")
    assert md.path == path.resolve() and md.arch == "qwen2"
    with pytest.raises(SpillpackError, match="the tag expects 'llama'"):
        resolve_model("llama3.2:1b", weights=str(path))


def test_unsupported_model_type(tmp_path):
    d = copy_tiny(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(SpillpackError) as e:
        resolve_model(str(d))
    assert error_line(e).startswith(f"spillpack: {d / 'config.json'}: model_type 'gpt2' is not supported "
                                    "(supported: gemma3, gemma3_text, llama, mistral, phi3, qwen2, qwen3, qwen3_moe)")


def test_missing_tokenizer_and_bad_json(tmp_path):
    d = copy_tiny(tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(SpillpackError, match="no tokenizer_config.json in"):
        resolve_model(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(SpillpackError, match="config.json is not valid JSON"):
        resolve_model(str(d))


def test_fingerprint_is_cheap_and_sensitive(tmp_path):
    a = copy_tiny(tmp_path / "a")
    b = copy_tiny(tmp_path / "b")
    assert resolve_model(str(a)).fingerprint() == resolve_model(str(b)).fingerprint()
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**cfg, "rope_theta": 5.0}))
    assert resolve_model(str(a)).fingerprint() != resolve_model(str(b)).fingerprint()
    c = copy_tiny(tmp_path / "c")
    (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes() + b" ")  # size changes
    assert resolve_model(str(a)).fingerprint() != resolve_model(str(c)).fingerprint()


def test_joined_projections_keep_the_checkpoint_and_equal_separate_linears(tmp_path):
    """q/k/v and gate/up run as one GEMM each (layout.joined_outputs), over weights that stay the
    checkpoint's tensors by name and value; a model moved to another dtype joins again."""
    from safetensors.torch import load_file

    from runtime.engines.torch.models.layout import joined_outputs

    path, hf = make_qwen2(tmp_path / "q")  # q/k/v biases too
    ours = load_model(resolve_model(str(path)))
    saved = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    state = ours.state_dict()
    assert sorted(state) == sorted(k for k in saved if k != "lm_head.weight" or not hf.config.tie_word_embeddings)
    for name, tensor in saved.items():
        if name in state:
            assert torch.equal(state[name], tensor), name
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    joined = attn.__dict__["joined_linears"][1][0]
    assert attn.q_proj.weight.data_ptr() == joined.data_ptr()  # a view into the joined tensor, not a copy
    x = torch.randn(2, 5, hf.config.hidden_size)
    with torch.no_grad():
        for module, names in ((attn, attn.joined[0]), (mlp, mlp.joined[0])):
            got = joined_outputs(module, names, x)
            for name, y in zip(names, got):
                lin = getattr(module, name)
                assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-6, rtol=0), name
    ids = torch.tensor(ids_batch(hf.config.vocab_size, [8]))
    ours.to(torch.bfloat16)  # the joined tensors are stale: the next forward joins the moved weights
    loaded = load_model(resolve_model(str(path)), dtype=torch.bfloat16)
    with torch.no_grad():
        got, expected = ours(ids), loaded(ids)
    assert attn.__dict__["joined_linears"][1][0].dtype == torch.bfloat16
    assert torch.equal(got, expected)


def _same_logits(plain, laid_out, vocab, tol=TOL):
    """Logits of two models of one checkpoint within `tol`, in a prefill and in decode steps through the KV cache."""
    ids = torch.tensor(ids_batch(vocab, [9, 9]))
    with torch.no_grad():
        assert max_diff(laid_out(ids), plain(ids)) < tol
        caches = plain.make_cache(2, 16), laid_out.make_cache(2, 16)
        first = [m(ids, cache=c)[:, -1] for m, c in zip((plain, laid_out), caches)]
        assert max_diff(first[1], first[0]) < tol
        step = first[0].argmax(-1)[:, None]
        nxt = [m(step, cache=c)[:, -1] for m, c in zip((plain, laid_out), caches)]
        assert max_diff(nxt[1], nxt[0]) < tol


def _random_lora(model_dir, *models, targets=("q_proj", "v_proj", "o_proj", "down_proj")):
    """The same random rank-4 adapter on `targets` (q/v/o/down) applied to each of `models`."""
    from runtime.engines.torch.engine import apply_lora
    from runtime.models.lora import LoraSpec, target_linears

    spec = LoraSpec(4, 8.0, targets)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, (fan_in, fan_out) in target_linears(model_dir.config, spec.targets).items():
        tensors[f"{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=g).numpy() * 0.1
        tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g).numpy() * 0.1
    for model in models:
        apply_lora(model, tensors, spec, "cpu")


@pytest.fixture
def small_gemm(monkeypatch):
    """Set SPILLPACK_SMALL_GEMM (which kernel a float32 CPU base's small products of inference run
    on) for one test, whatever this machine measures."""
    from runtime.engines.torch.models.small_gemm import blas_is_faster

    def choose(kernel: str):
        monkeypatch.setenv("SPILLPACK_SMALL_GEMM", kernel)
        blas_is_faster.cache_clear()

    yield choose
    monkeypatch.delenv("SPILLPACK_SMALL_GEMM", raising=False)
    blas_is_faster.cache_clear()


def test_cpu_inference_layout_stores_small_weights_transposed(tmp_path, small_gemm):
    """cpu_inference_layout (a float32 CPU base's generation): weights under the packing threshold
    (all of tiny's and of the small fixture's) are the checkpoint's tensors by value, lying as
    (in, out) in memory; the joined q/k/v and gate/up keep that layout; logits match the plain
    layout within float32 rounding; the engine's load_model picks it on a float32 CPU base.
    (Their products on MKL: SPILLPACK_SMALL_GEMM=mkl; numpy's BLAS is the next test's.)"""
    from runtime.engines.registry import get_engine

    from runtime.models.tiny import ensure_tiny

    small_gemm("mkl")
    tied = load_model(resolve_model(str(ensure_tiny())), cpu_inference=True)
    assert tied.lm_head is None and tied.model.embed_tokens.weight.t().is_contiguous() and tied.head_kernel == "linear"
    path, hf = make_qwen2(tmp_path / "q")  # q/k/v biases, a head of its own
    model_dir = resolve_model(str(path))
    plain, moved = load_model(model_dir), load_model(model_dir, cpu_inference=True)
    assert moved.lm_head.weight.t().is_contiguous() and moved.model.embed_tokens.weight.is_contiguous()
    for (name, a), (_, b) in zip(plain.state_dict().items(), moved.state_dict().items()):
        assert torch.equal(a, b), name
    attn = moved.model.layers[0].self_attn
    joined = attn.__dict__["joined_linears"][1][0]
    assert joined.t().is_contiguous() and attn.q_proj.weight.data_ptr() == joined.data_ptr()
    assert moved.model.layers[0].mlp.down_proj.weight.t().is_contiguous()
    _same_logits(plain, moved, hf.config.vocab_size, tol=1e-5)
    engine = get_engine("torch-cpu")
    if engine.base_dtype == torch.float32:
        assert engine.load_model(model_dir).model.layers[0].self_attn.o_proj.weight.t().is_contiguous()


@pytest.mark.parametrize("tied", [False, True])
def test_small_products_of_inference_on_numpys_blas(tmp_path, small_gemm, tied):
    """Where numpy's BLAS runs the small products (SPILLPACK_SMALL_GEMM=blas, as small_gemm's
    measurement chooses on an AMD EPYC): every small linear is a BlasLinear over its transposed
    weight's memory, q/k/v and gate/up multiply through one numpy view of their joined weight, which
    the separate weights are views into, a tied head takes the "blas" kernel, and the checkpoint's
    tensors are unchanged. Logits match the plain layout within float32 rounding in a prefill and
    in decode steps through the KV cache (decode_attention's products on numpy too), and again with
    a LoRA adapter wrapping BLAS linears."""
    import numpy as np

    from runtime.engines.torch.models import gemm, layout

    small_gemm("blas")
    path, hf = make_qwen2(tmp_path / "q", tied=tied)
    model_dir = resolve_model(str(path))
    plain, moved = load_model(model_dir), load_model(model_dir, cpu_inference=True)
    for (name, a), (_, b) in zip(plain.state_dict().items(), moved.state_dict().items()):
        assert torch.equal(a, b), name
    attn, mlp = moved.model.layers[0].self_attn, moved.model.layers[0].mlp
    for module, first in ((attn, attn.q_proj), (mlp, mlp.gate_proj)):
        assert module.__dict__["joined_kernel"] == layout.BLAS
        joined = module.__dict__["joined_linears"][1][0]
        assert isinstance(joined, np.ndarray) and joined.flags.c_contiguous
        assert joined.ctypes.data == first.weight.data_ptr() and type(first) is torch.nn.Linear
    for linear in (attn.o_proj, mlp.down_proj, *([] if tied else [moved.lm_head])):
        assert type(linear) is gemm.BlasLinear and linear.weight_t.ctypes.data == linear.weight.data_ptr()
    assert moved.head_kernel == ("blas" if tied else "linear")
    assert all(layer.self_attn.decode_blas for layer in moved.model.layers) and not plain.model.layers[0].self_attn.decode_blas
    _same_logits(plain, moved, hf.config.vocab_size, tol=1e-5)

    _random_lora(model_dir, plain, moved)
    _same_logits(plain, moved, hf.config.vocab_size, tol=1e-5)


def test_small_gemm_choice_is_measured_once_and_kept(monkeypatch):
    """small_gemm's choice comes from one measurement of both kernels on a decode step's shapes,
    kept in the rates cache: a second process (the cache cleared in memory) reads it instead of
    measuring again, and the margin decides."""
    from runtime.engines.torch.models import small_gemm

    monkeypatch.delenv("SPILLPACK_SMALL_GEMM", raising=False)
    measured = small_gemm.measure()
    assert measured["mkl_s"] > 0 and measured["blas_s"] > 0
    calls = []
    monkeypatch.setattr(small_gemm, "measure", lambda: calls.append(1) or {"mkl_s": 3.0, "blas_s": 2.0})
    monkeypatch.setattr(small_gemm.torch, "get_num_threads", lambda: 97)  # a cache key no other test has
    small_gemm.blas_is_faster.cache_clear()
    try:
        assert small_gemm.blas_is_faster() is True and calls == [1]  # 3.0 >= 1.2 * 2.0
        small_gemm.blas_is_faster.cache_clear()
        assert small_gemm.blas_is_faster() is True and calls == [1]  # read back, not measured again
        from runtime.engines.hardware import remember_rate

        remember_rate("torch-cpu", {"mkl_s": "fast"}, "small gemm 2, 97 threads")  # a damaged entry: measured again
        small_gemm.blas_is_faster.cache_clear()
        assert small_gemm.blas_is_faster() is True and calls == [1, 1]
        monkeypatch.setenv("SPILLPACK_SMALL_GEMM", "mkl")
        small_gemm.blas_is_faster.cache_clear()
        assert small_gemm.blas_is_faster() is False
    finally:
        small_gemm.blas_is_faster.cache_clear()


def test_a_mistyped_small_gemm_kernel_is_one_line_and_the_corrected_command_runs(home, tmp_path):
    """SPILLPACK_SMALL_GEMM names blas or mkl; anything else stops the job with one line saying
    so (not a measurement silently taken instead), and the same command with it corrected, on
    the same state, generates the row."""
    import json

    from conftest import run_cli

    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hello"}) + "\n")
    cmd = ["run", "tiny", str(rows), "--state", str(tmp_path / "s"), "--max-tokens", "2", "--engine", "torch-cpu",
           "--dtype", "float32"]
    r = run_cli(cmd, env={"SPILLPACK_SMALL_GEMM": "bls"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("spillpack: SPILLPACK_SMALL_GEMM='bls' is not blas or mkl. "
                                                 "Try: SPILLPACK_SMALL_GEMM=blas, or unset it")
    assert "Traceback" not in r.stderr
    r = run_cli(cmd, env={"SPILLPACK_SMALL_GEMM": "blas"})
    assert r.returncode == 0, r.stderr
    assert [json.loads(l)["custom_id"] for l in (tmp_path / "s" / "results.jsonl").read_text().splitlines()] == ["a"]


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_inference_layout_packs_large_weights_for_onednn(tmp_path, monkeypatch, tied):
    """Weights at or over the packing threshold (lowered here so the small fixture's are) run on
    oneDNN packed once at load: q/k/v and gate/up packed joined, every other linear a PackedLinear,
    the dense copies freed (the weights left on the meta device, shapes kept); a tied head
    multiplies by rows. Logits match the plain layout within float32 rounding, through the KV
    cache too, and with a LoRA adapter wrapping packed linears."""
    from runtime.engines.torch.models import gemm, layout

    if not gemm.onednn_linear():
        pytest.skip("this torch has no oneDNN weight packing (not an x86 build)")
    monkeypatch.setattr(layout, "PACK_MIN_WEIGHTS", 1)
    path, hf = make_qwen2(tmp_path / "q", tied=tied)
    model_dir = resolve_model(str(path))
    plain, packed = load_model(model_dir), load_model(model_dir, cpu_inference=True)
    attn, mlp = packed.model.layers[0].self_attn, packed.model.layers[0].mlp
    assert attn.__dict__["joined_linears"][0] == layout.LAID_OUT and mlp.__dict__["joined_linears"][0] == layout.LAID_OUT
    assert attn.q_proj.weight.is_meta and attn.q_proj.weight.shape == plain.model.layers[0].self_attn.q_proj.weight.shape
    for linear in (attn.o_proj, mlp.down_proj, *([] if tied else [packed.lm_head])):
        assert type(linear) is gemm.PackedLinear and linear.packed.layout == torch._mkldnn and linear.weight.is_meta
    assert packed.head_kernel == ("by_rows" if tied else "linear") and not packed.model.embed_tokens.weight.is_meta
    _same_logits(plain, packed, hf.config.vocab_size)

    _random_lora(model_dir, plain, packed)
    _same_logits(plain, packed, hf.config.vocab_size)


def test_cpu_training_layout_keeps_the_loss_and_the_lora_gradients(tmp_path, monkeypatch):
    """A tune on a float32 CPU base runs its large frozen linears and tied head forward on oneDNN
    (layout.cpu_training_layout; the threshold lowered here so the small fixture's are): the loss and
    every LoRA gradient of a step equal the default kernels' within float32 rounding, the modules
    are FrozenLinear, and no gradient reaches the base."""
    import numpy as np

    from runtime.engines import OptimSpec
    from runtime.engines.registry import get_engine
    from runtime.engines.torch.models import gemm, layout
    from runtime.models.lora import LoraSpec, target_linears

    if not gemm.onednn_linear():
        pytest.skip("this torch has no oneDNN linear (not an x86 build)")
    path, hf = make_qwen2(tmp_path / "q", tied=True)
    model_dir = resolve_model(str(path))
    engine = get_engine("torch-cpu", base_dtype="float32")
    spec = LoraSpec(4, 8.0, ("q_proj", "v_proj", "o_proj", "down_proj"))
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (fan_in, fan_out) in target_linears(model_dir.config, spec.targets).items():
        tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((4, fan_in)) * 0.1).astype(np.float32)
        tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((fan_out, 4)) * 0.1).astype(np.float32)
    ids = np.array(ids_batch(hf.config.vocab_size, [12, 12, 12]), dtype=np.int64)
    labels = ids.copy()
    labels[:, :4] = -100
    results = {}
    for threshold in (1, 1 << 60):
        monkeypatch.setattr(layout, "PACK_MIN_WEIGHTS", threshold)
        session = engine.train_session(model_dir, spec, tensors, OptimSpec())
        loss, _ = session.forward_backward([(ids, labels)], int((labels != -100).sum()))
        results[threshold] = loss, {n: p.grad.clone() for n, p in session.params.items()}
        frozen = session.model.model.layers[0].mlp.gate_proj
        assert (type(frozen) is gemm.FrozenLinear) == (threshold == 1)
        assert session.model.head_kernel == ("frozen" if threshold == 1 else "linear")
        assert all(p.grad is None for n, p in session.model.named_parameters() if "lora_" not in n)
    (loss, grads), (plain_loss, plain_grads) = results[1], results[1 << 60]
    assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss)
    for name, g in plain_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), name


def test_the_measured_matmul_rate_is_the_kernel_the_linears_run_on(monkeypatch):
    """doctor's rate (and the tune benchmark's share of it) on a float32 CPU base times oneDNN's
    packed linear where the engine's large linears run on it, not MKL's torch.mm."""
    from runtime.engines import hardware
    from runtime.engines.torch.models import gemm

    if not gemm.onednn_linear():
        pytest.skip("this torch has no oneDNN linear (not an x86 build)")
    calls = []
    real = gemm.gemm
    monkeypatch.setattr(gemm, "gemm", lambda x, w, b=None: calls.append(w.layout) or real(x, w, b))
    rate = hardware.measure("torch-cpu", seconds=0.05, dtype="float32")
    assert rate["matmul_dtype"] == "float32" and rate["matmul_gflops"] > 0
    assert calls and set(calls) == {torch._mkldnn}
