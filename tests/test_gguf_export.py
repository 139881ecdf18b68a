"""GGUF out: the merged model as llama.cpp and Ollama load it, and the LoRA as llama.cpp's adapter.

The oracles are peers: transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`) must
read the exported file back with the merged model's logits, and the `gguf` package's reader must
find the PEFT adapter's tensors in the adapter file. For f16 and q8_0 the reference is the merged
model with each tensor rounded as the type rounds it (the gguf package's own dequantize), held at
1e-4; the difference to the unrounded model is printed (pytest -rP) as the cost of the type.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import events_of, run_cli
from tests.support.hf_fixtures import make_family
from tests.support.real_model import smollm2_hf_dir
from runtime.engines import OptimSpec
from runtime.engines.registry import get_engine
from runtime.models import gguf_write
from runtime.models.lora import LoraSpec, init_tensors
from runtime.models.ref import resolve_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TEXTS = ["Hello world, 123 4567 and  two  spaces\n\nnew lines", "<|im_start|>user\nWhat is the capital of France?<|im_end|>",
         "héllo ☃ 日本語 🤖 naïve café", "def f(x):\n\treturn x**2  # tab", "<|endoftext|>tokens <think>around</think>"]


def random_lora(config, spec, seed=3):
    """Non-zero B, so the merge really changes the weights."""
    tensors = init_tensors(config, spec, seed)
    rng = np.random.default_rng(seed)
    return {k: (v if "lora_A" in k else rng.normal(0, 0.05, v.shape).astype(np.float32)) for k, v in tensors.items()}


def merged_dir(model_dir, tensors, spec, out):
    """The merged safetensors model, as `tune --merge` writes it, and its weights."""
    from runtime.jobs.tune import write_merged

    session = get_engine("torch-cpu").train_session(model_dir, spec, tensors, OptimSpec(), 0)
    weights = session.merged_weights()
    write_merged(out, session, model_dir, weights)
    return weights


def ids_for(vocab):
    rng = np.random.default_rng(1)
    return torch.tensor(rng.integers(0, vocab, size=(2, 13)))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def load_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def check_roundtrip(merged, weights, tmp_path, kinds=gguf_write.TYPES, label=""):
    """Each type: written, read back by transformers; logits equal the type-rounded merged model's
    within 1e-4; returns the measured differences."""
    model_dir = resolve_model(str(merged))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    ids = ids_for(model_dir.config["vocab_size"])
    exact = hf_logits(ref, ids)
    measured = {}
    for kind in kinds:
        out = tmp_path / f"gguf-{kind}" / "model.gguf"
        info = gguf_write.write_model(out, weights, model_dir.config, model_dir.path, kind)
        got = hf_logits(load_gguf(out), ids)
        rounded = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        state = {k: torch.from_numpy(gguf_write.rounded(v.detach().numpy(), kind)) for k, v in rounded.state_dict().items()}
        rounded.load_state_dict(state)
        to_rounded = (got - hf_logits(rounded, ids)).abs().max().item()
        to_exact = (got - exact).abs().max().item()
        measured[kind] = (to_rounded, to_exact)
        print(f"{label} {info['architecture']} {kind}: max |logit diff| to the type-rounded merged model {to_rounded:.2e}, "
              f"to the float32 merged model {to_exact:.2e} (logits up to {exact.abs().max().item():.1f})")
        assert to_rounded < 1e-4, (kind, to_rounded)
        if kind == "f32":
            assert to_exact < 1e-4
        else:
            assert to_exact > 0  # the type really rounds: a file silently written in f32 would not
    return measured


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_merged_gguf_reads_back_in_transformers(family, tmp_path, home):
    # llama without llama3 rope scaling: GGUF carries that as a rope_freqs tensor, which is refused below.
    # qwen3 with head_dim 128 (as every Qwen3 has): transformers' GGUF loader reads no head_dim for qwen3
    # and takes Qwen3Config's 128; the file says it in qwen3.attention.key_length, which llama.cpp reads.
    overrides = {"llama": {"rope_scaling": None}, "qwen3": {"head_dim": 128}}.get(family, {})
    path, _ = make_family(family, tmp_path / family, **overrides)
    model_dir = resolve_model(str(path))
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    weights = merged_dir(model_dir, random_lora(model_dir.config, spec), spec, tmp_path / "merged")
    check_roundtrip(tmp_path / "merged", weights, tmp_path, label=family)


def test_llama_queries_and_keys_are_permuted_as_llama_cpp_rotates_them(tmp_path, home):
    """The one reordering GGUF's llama needs: transformers undoes it on load, so a file written without
    it (or with it on Qwen) reads back with other logits; here its effect on the file is pinned too."""
    path, _ = make_family("llama", tmp_path / "llama", rope_scaling=None)
    model_dir = resolve_model(str(path))
    from safetensors.numpy import load_file

    weights = load_file(str(path / "model.safetensors"))
    out = tmp_path / "l.gguf"
    gguf_write.write_model(out, weights, model_dir.config, model_dir.path, "f32")
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    heads, half = 4, q.shape[0] // 4 // 2
    got = tensors["blk.0.attn_q.weight"]
    # row 2i of a head in the file is row i of that head's first half, row 2i+1 is row i of its second half
    assert np.array_equal(got[0], q[0]) and np.array_equal(got[1], q[half]) and np.array_equal(got[2], q[1])
    assert not np.array_equal(got, q)
    assert np.array_equal(tensors["blk.0.attn_v.weight"], weights["model.layers.0.self_attn.v_proj.weight"])
    assert heads * 2 * half == q.shape[0]


def test_metadata_llama_cpp_reads(tmp_path, home):
    """The keys llama.cpp looks up for a model, and the tokenizer as tokenizer.json has it."""
    from runtime.models.tiny import ensure_tiny
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    d = ensure_tiny()
    cfg = json.loads((d / "config.json").read_text())
    out = tmp_path / "tiny.gguf"
    gguf_write.write_model(out, load_file(str(d / "model.safetensors")), cfg, d, "f16", name="tiny")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "qwen2" and f["general.type"] == "model" and f["general.file_type"] == 1
    for key, want in {"block_count": 4, "embedding_length": 128, "feed_forward_length": 352, "attention.head_count": 4,
                      "attention.head_count_kv": 2, "context_length": 2048, "vocab_size": 1003, "rope.dimension_count": 32}.items():
        assert f[f"qwen2.{key}"] == want, key
    assert f["qwen2.rope.freq_base"] == 10000.0
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == 1003 and all(tokens[i] == tok.id_to_token(i) for i in range(tok.get_vocab_size()))
    tj = json.loads((d / "tokenizer.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert f["tokenizer.ggml.merges"] == merges
    specials = {a["id"] for a in tj["added_tokens"] if a["special"]}
    types = f["tokenizer.ggml.token_type"]
    assert {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL} == specials
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert f["tokenizer.chat_template"] == tcfg["chat_template"]
    assert f["tokenizer.ggml.eos_token_id"] == cfg["eos_token_id"] or tokens[f["tokenizer.ggml.eos_token_id"]] == tcfg["eos_token"]
    # f16: matrices in float16, norms in float32, as llama.cpp's converter writes them
    kinds = {t.name: t.tensor_type for t in r.tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert kinds["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert kinds["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in kinds  # tied: llama.cpp reuses token_embd
    # transformers' tokenizer built from the GGUF's metadata splits text as tokenizer.json does
    from_gguf = transformers.AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    for text in TEXTS:
        assert from_gguf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids, text


def test_chat_template_from_chat_template_jinja(tmp_path, home):
    """A model whose template is chat_template.jinja (as transformers 5 saves it) keeps it in the GGUF."""
    from runtime.models.tiny import ensure_tiny
    from safetensors.numpy import load_file

    d = tmp_path / "m"
    shutil.copytree(ensure_tiny(), d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(tcfg.pop("chat_template"))
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    out = tmp_path / "t.gguf"
    gguf_write.write_model(out, load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text()), d, "f32")
    fields = {k: v.contents() for k, v in gguf.GGUFReader(out).fields.items()}
    assert fields["tokenizer.chat_template"] == (d / "chat_template.jinja").read_text()


def test_unsupported_models_are_one_line(tmp_path, home):
    path, _ = make_family("phi3", tmp_path / "phi3")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(gguf_write.SpillpackError, match="GGUF export of model_type 'phi3' is not supported"):
        gguf_write.write_model(tmp_path / "x.gguf", {}, cfg, path)
    llama3 = make_family("llama", tmp_path / "llama")[0]
    with pytest.raises(gguf_write.SpillpackError, match="'llama3' rope scaling"):
        gguf_write.gguf_arch(json.loads((llama3 / "config.json").read_text()))
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))


def adapter_check(adapter_dir, gguf_file, config, kind="f32"):
    """The adapter GGUF read back with the gguf package: llama.cpp's metadata, and every PEFT tensor
    under llama.cpp's name with its shape and values (B of llama's q/k permuted as the weights are)."""
    from safetensors.numpy import load_file

    peft_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    peft = load_file(str(adapter_dir / "adapter_model.safetensors"))
    r = gguf.GGUFReader(gguf_file)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.type"] == "adapter" and f["adapter.type"] == "lora"
    assert f["adapter.lora.alpha"] == pytest.approx(peft_cfg["lora_alpha"])
    assert f["general.architecture"] == gguf_write.gguf_arch(config)
    got = {t.name: np.array(t.data) for t in r.tensors}
    assert len(got) == len(peft)
    permuted = 0
    for name, value in peft.items():
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        layer, rest = module.removeprefix("model.layers.").split(".", 1)
        short = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}[rest]
        which = "lora_a" if ".lora_A." in name else "lora_b"
        tensor = got[f"blk.{layer}.{short}.weight.{which}"]
        assert tensor.shape == value.shape, name
        if config["model_type"] == "llama" and which == "lora_b" and short in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if short == "attn_q" else config["num_key_value_heads"]
            value = gguf_write.permute_qk(value, heads)
            permuted += 1
        want = value if kind == "f32" else value.astype(np.float16)
        assert tensor.dtype == want.dtype and np.array_equal(tensor, want), name
    return permuted


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_adapter_gguf_holds_the_peft_adapter(family, tmp_path, home):
    from runtime.models.lora import save_adapter

    path, _ = make_family(family, tmp_path / family, **({"rope_scaling": None} if family == "llama" else {}))
    model_dir = resolve_model(str(path))
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    tensors = random_lora(model_dir.config, spec)
    save_adapter(tmp_path / "adapter", tensors, spec, str(path), model_dir.config["num_hidden_layers"])
    for kind in gguf_write.ADAPTER_TYPES:
        out = tmp_path / f"adapter-{kind}.gguf"
        gguf_write.write_adapter(out, tensors, spec.alpha, model_dir.config, kind)
        permuted = adapter_check(tmp_path / "adapter", out, model_dir.config, kind)
        assert permuted == (4 if family == "llama" else 0)


@pytest.mark.slow
def test_export_and_tune_gguf_through_the_cli(tmp_path, home):
    """A real tune of tiny (qwen2) with --merge --gguf, then `spillpack export` of its state: both
    files read back by transformers with the merged safetensors model's logits."""
    state, tuned = tmp_path / "state", tmp_path / "tuned.gguf"
    p = run_cli(["tune", "tiny", "examples/data/train.jsonl", "--steps", "3", "--lr", "1e-2", "--state", str(state), "--merge",
                 "--gguf", str(tuned), "--name", "My_Tiny"])
    assert p.returncode == 0, p.stderr
    done = events_of(p.stdout)[-1]
    assert done["gguf"] == str(tuned) and tuned.is_file()
    assert f"printf 'FROM %s\\n' {tuned} > Modelfile" in p.stderr and "ollama create my_tiny -f Modelfile" in p.stderr
    merged = state / "adapter" / "merged"
    out, adapter = tmp_path / "export" / "model.gguf", tmp_path / "export" / "adapter.gguf"
    p = run_cli(["export", str(state), "--gguf", str(out), "--type", "f32", "--gguf-adapter", str(adapter)])
    assert p.returncode == 0, p.stderr
    ev = {e["event"]: e for e in events_of(p.stdout)}
    assert ev["gguf"]["file"] == str(out) and ev["gguf"]["type"] == "f32" and ev["gguf"]["architecture"] == "qwen2"
    assert ev["gguf"]["ollama"] == [f"printf 'FROM %s\\n' {out} > Modelfile", "ollama create my_tiny -f Modelfile"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    ids = ids_for(1003)
    exact = hf_logits(ref, ids)
    base = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny").path), dtype=torch.float32).eval(), ids)
    assert (exact - base).abs().max().item() > 1e-3  # the tune moved the model: the export carries the adapter
    exported = (hf_logits(load_gguf(out), ids) - exact).abs().max().item()
    from_tune = (hf_logits(load_gguf(tuned), ids) - exact).abs().max().item()
    print(f"export --type f32: {exported:.2e}; tune --gguf (f16): {from_tune:.2e}")
    assert exported < 1e-4 and from_tune < 5e-2
    adapter_check(state / "adapter", adapter, json.loads((merged / "config.json").read_text()))

    # bad input: one line each, nothing written
    again = run_cli(["export", str(state), "--gguf", str(out)])
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0 and "already exists" in again.stderr
    assert run_cli(["export", str(state)]).returncode == 2
    none = run_cli(["export", str(tmp_path / "nowhere"), "--gguf", str(tmp_path / "n.gguf")])
    assert none.returncode == 1 and "holds no job state" in none.stderr and not (tmp_path / "n.gguf").exists()
    assert "Traceback" not in none.stderr + again.stderr


@pytest.mark.slow
def test_real_smollm2_merged_and_adapter_gguf(tmp_path, home):
    """The real pretrained model (Llama architecture, tied embeddings, 30 layers): merged with a LoRA,
    written as GGUF in every type, read back by transformers; its adapter GGUF holds PEFT's tensors;
    and the tokenizer from the written metadata splits text as the model's tokenizer.json does."""
    from runtime.models.lora import save_adapter
    from tokenizers import Tokenizer

    hf = smollm2_hf_dir(tmp_path / "smollm2")
    model_dir = resolve_model(str(hf))
    spec = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    tensors = random_lora(model_dir.config, spec)
    weights = merged_dir(model_dir, tensors, spec, tmp_path / "merged")
    check_roundtrip(tmp_path / "merged", weights, tmp_path, kinds=("f32", "q8_0"), label="SmolLM2-135M")  # f16: on the random models
    save_adapter(tmp_path / "adapter", tensors, spec, str(hf), model_dir.config["num_hidden_layers"])
    gguf_write.write_adapter(tmp_path / "adapter.gguf", tensors, spec.alpha, model_dir.config)
    assert adapter_check(tmp_path / "adapter", tmp_path / "adapter.gguf", model_dir.config) == 60
    out = tmp_path / "gguf-f32" / "model.gguf"
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    from_gguf = transformers.AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    for text in TEXTS:
        assert from_gguf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids, text
    fields = {k: v.contents() for k, v in gguf.GGUFReader(out).fields.items()}
    assert fields["tokenizer.chat_template"] == (hf / "chat_template.jinja").read_text()


def test_tune_refuses_a_gguf_it_could_not_write_before_training(tmp_path, home):
    path, _ = make_family("phi3", tmp_path / "phi3")
    state = tmp_path / "state"
    p = run_cli(["tune", str(path), "examples/data/train.jsonl", "--steps", "2", "--state", str(state), "--gguf", str(tmp_path / "p.gguf")])
    assert p.returncode == 1 and "GGUF export of model_type 'phi3' is not supported" in p.stderr
    assert p.stderr.strip().count("\n") == 0 and not state.exists() and not (tmp_path / "p.gguf").exists()


@pytest.mark.slow
def test_export_of_an_unfinished_tune_takes_its_newest_checkpoint(tmp_path, home):
    from safetensors.numpy import load as st_load

    from runtime.state.jobstate import JobState
    from runtime.state.uri import open_store

    state = tmp_path / "state"
    p = run_cli(["tune", "tiny", "examples/data/train.jsonl", "--steps", "6", "--lr", "1e-2", "--ckpt-every", "2",
                 "--stop-after", "3", "--state", str(state)])
    assert p.returncode == 0, p.stderr
    out = tmp_path / "a.gguf"
    p = run_cli(["export", str(state), "--gguf-adapter", str(out)], env={"SPILLPACK_HEADLESS": "0"})
    assert p.returncode == 0, p.stderr
    js = JobState(open_store(str(state)), {})
    step = js.checkpoints.latest().step
    assert step in (2, 3) and f"(step {step}: the tune has not finished)" in p.stderr and "llama-server -m BASE.gguf --lora" in p.stdout
    ckpt = {k.removeprefix("adapter."): v for k, v in st_load(js.read_file(js.checkpoints.latest(), "state.safetensors")).items()
            if k.startswith("adapter.")}
    got = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    a = ckpt["model.layers.1.self_attn.v_proj.lora_A.weight"]
    assert np.array_equal(got["blk.1.attn_v.weight.lora_a"], a) and np.abs(ckpt["model.layers.1.self_attn.v_proj.lora_B.weight"]).max() > 0
