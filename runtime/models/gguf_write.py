"""Writing GGUF files: a merged model as llama.cpp and Ollama load it, and a LoRA as llama.cpp's
`--lora` adapter. Framework-neutral (numpy and the `gguf` package), so `spillpack export` runs
wherever a state can be read, a bundle included.

What llama.cpp expects, and how each part is made here:
- `general.architecture` and that architecture's hyper-parameters (`llama.block_count`, ...),
  from config.json;
- tensors under llama.cpp's names (gguf's own TensorNameMap turns the Hugging Face names into
  them); the `llama` architecture rotates pairs of adjacent dimensions where Hugging Face rotates
  the two halves of each head, so the query and key rows of each head are interleaved
  (`permute_qk`; the Qwen architectures rotate halves in llama.cpp too and are written as they are);
- the tokenizer as `tokenizer.ggml.*` (a byte-level BPE: model `gpt2`, every token with its type,
  the merges, the special ids) from tokenizer.json and tokenizer_config.json, and the chat
  template as `tokenizer.chat_template`.
Types: f32 writes every tensor as float32; f16 and q8_0 keep one-dimensional tensors (norms,
biases) in float32 as llama.cpp's converter does, and q8_0 falls back to f16 for a matrix whose
rows are not a multiple of its 32-value blocks.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path

import numpy as np

from runtime.base.errors import SpillpackError, UsageError
from runtime.base.fileio import unlink
from runtime.models.gguf.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

# spillpack model_type -> GGUF architecture. Mistral would be `llama` too, but llama.cpp's llama
# ignores a sliding window, so it is left out rather than written wrong.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TYPES = ("f32", "f16", "q8_0")
ADAPTER_TYPES = ("f32", "f16")
# llama.cpp's file types (general.file_type): all float32, mostly float16, mostly Q8_0
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}

# The pre-tokenizer llama.cpp must use (tokenizer.ggml.pre), told by the split tokenizer.json
# makes before its BPE: each regex (or structure) a family is known to use, and llama.cpp's name.
# (The regexes are the reader's: runtime/models/gguf/tokenizer.py maps llama.cpp's names back to them.)
PRE_TOKENIZERS = {("split", LLAMA3_SPLIT): "llama-bpe", ("split", QWEN2_SPLIT): "qwen2",
                  ("digits+bytelevel", None): "smollm", ("bytelevel", None): "gpt-2"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SpillpackError("writing GGUF needs the gguf package, which is not installed", "pip install gguf==0.19.0")
    return gguf


def check_type(kind: str, types=TYPES, flag: str = "--type") -> str:
    if kind not in types:
        raise UsageError(f"{flag} {kind!r} is not a GGUF type spillpack writes", f"{flag} {' or '.join(types)}")
    return kind


def gguf_arch(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise SpillpackError(f"GGUF export of model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
                             "tune --merge for a Hugging Face directory of the merged model instead")
    if config.get("use_sliding_window") or (model_type == "llama" and config.get("sliding_window")):
        raise SpillpackError(f"GGUF export of a {model_type} model with sliding-window layers is not supported "
                             "(llama.cpp's architecture has none)", "tune --merge for a Hugging Face directory instead")
    kind = rope_scaling(config).get("rope_type")
    if kind not in (None, "default", "linear"):
        raise SpillpackError(f"GGUF export of {kind!r} rope scaling is not supported (only none and linear)",
                             "tune --merge for a Hugging Face directory instead")
    return ARCHITECTURES[model_type]


def rope_scaling(config: dict) -> dict:
    """The rope scaling, from the older `rope_scaling` or transformers 5's `rope_parameters`."""
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling["type"]
    return scaling


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half layout of each head's rows (first halves, then second halves)
    -> the interleaved pairs llama.cpp's `llama` rotates: row (h, j, i) moves to (h, i, j)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str, arch: str, blocks: int) -> str:
    gguf = _gguf()
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name = gguf.get_tensor_name_map(arch_enum, blocks).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise SpillpackError(f"tensor {hf_name} has no GGUF name in llama.cpp's {arch} architecture", "spillpack export --help")
    return name


def _permuted(hf_name: str, w: np.ndarray, arch: str, config: dict) -> np.ndarray:
    if arch != "llama":
        return w
    if ".self_attn.q_proj." in hf_name:
        return permute_qk(w, config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return permute_qk(w, config.get("num_key_value_heads") or config["num_attention_heads"])
    return w


def tensor_type(name: str, w: np.ndarray, kind: str):
    """(the gguf quantization type, the array to write) for one tensor."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if kind == "f32" or w.ndim < 2:
        return Q.F32, np.ascontiguousarray(w, dtype=np.float32)
    if kind == "q8_0" and w.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return Q.Q8_0, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), Q.Q8_0)
    return Q.F16, np.ascontiguousarray(w, dtype=np.float16)


def rounded(w: np.ndarray, kind: str) -> np.ndarray:
    """What a tensor reads back as after `tensor_type` (float32): the type's own rounding."""
    gguf = _gguf()
    qtype, data = tensor_type("", w, kind)
    return gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def _add_hyperparameters(writer, arch: str, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config["hidden_size"] // heads:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_vocab_size(config["vocab_size"])
    scaling = rope_scaling(config)
    if scaling.get("rope_type") == "linear":
        gguf = _gguf()
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def pre_tokenizer(tokenizer_json: dict) -> str:
    """llama.cpp's name for the split this tokenizer.json makes before BPE."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds and kinds[0] == "Split":
        key = ("split", (parts[0].get("pattern") or {}).get("Regex"))
    elif kinds == ["Digits", "ByteLevel"]:
        key = ("digits+bytelevel", None)
    elif kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        key = ("bytelevel", None)
    else:
        key = None
    name = PRE_TOKENIZERS.get(key)
    if name is None:
        raise SpillpackError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) is not one llama.cpp "
                             "is known to name", "tune --merge for a Hugging Face directory instead")
    return name


def _add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    gguf = _gguf()
    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise SpillpackError(f"{model_dir / 'tokenizer.json'} is not a byte-level BPE tokenizer, the only kind spillpack "
                             "writes into GGUF", "tune --merge for a Hugging Face directory instead")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if by_id and max(by_id) >= vocab_size:
        raise SpillpackError(f"the tokenizer has token id {max(by_id)}, past the model's vocab_size {vocab_size}",
                             f"check the tokenizer files in {model_dir}")
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(vocab_size):  # the embedding's rows: an id the tokenizer never produces is padding
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(T.CONTROL if added[i].get("special") else T.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(T.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tj))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    if special.chat_template is None and (model_dir / "chat_template.jinja").is_file():
        special.chat_template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    special.add_to_gguf(writer, quiet=True)


def _copy_tokenizer(writer, source: Path) -> None:
    """A GGUF base's own tokenizer.* keys (model, pre, tokens, types, merges, special ids, chat
    template), copied as they are: the merged model tokenizes exactly as its base did."""
    gguf = _gguf()
    V = gguf.GGUFValueType
    for name, f in gguf.GGUFReader(source).fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == V.ARRAY:
            writer.add_key_value(name, f.contents(), V.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, f.contents(), kind)


def _write(path: Path, arch: str, fill) -> None:
    """A GGUF file written whole or not at all: into a temporary file beside `path`, renamed over it."""
    gguf = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's private 0600 is not what a model file others read should have
        os.replace(tmp, path)
    finally:
        unlink(tmp)


def write_model(path: Path, weights: dict[str, np.ndarray], config: dict, model_dir: Path, kind: str = "f16",
                name: str | None = None) -> dict:
    """The merged model (Hugging Face names, float32) as one GGUF file; returns what was written
    (architecture, type, tensor count). `model_dir`: the base's Hugging Face directory (its
    tokenizer.json and tokenizer_config.json), or the base GGUF itself (its tokenizer keys are copied)."""
    check_type(kind)
    gguf = _gguf()
    arch = gguf_arch(config)
    blocks = config["num_hidden_layers"]
    tied = bool(config.get("tie_word_embeddings"))
    tensors = []
    for hf_name in sorted(weights):
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when output.weight is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        w = _permuted(hf_name, weights[hf_name], arch, config)
        tensors.append((gguf_tensor_name(hf_name, arch, blocks), w))

    def fill(writer):
        writer.add_type(gguf.GGUFType.MODEL)
        if name:
            writer.add_name(name)
        writer.add_file_type(FILE_TYPE[kind])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hyperparameters(writer, arch, config)
        if Path(model_dir).is_file():  # a GGUF base (a .gguf, an Ollama blob)
            _copy_tokenizer(writer, Path(model_dir))
        else:
            _add_tokenizer(writer, Path(model_dir), config["vocab_size"])
        for gguf_name, w in tensors:
            qtype, data = tensor_type(gguf_name, w, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)

    _write(path, arch, fill)
    return {"architecture": arch, "type": kind, "tensors": len(tensors)}


def adapter_tensors(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """A LoRA's canonical tensors (`model.layers.0.self_attn.q_proj.lora_A.weight`) under llama.cpp's
    adapter names (`blk.0.attn_q.weight.lora_a`), A as (rank, in) and B as (out, rank), as
    llama.cpp's convert_lora_to_gguf names them. On `llama` the query and key updates B @ A are
    permuted as the weights are: B's rows, since the permutation acts on the output rows."""
    arch = gguf_arch(config)
    blocks = config["num_hidden_layers"]
    out = {}
    for name, w in tensors.items():
        module, which = name.rsplit(".lora_", 1)
        base = gguf_tensor_name(module + ".weight", arch, blocks)
        if which == "A.weight":
            out[base + ".lora_a"] = w
        elif which == "B.weight":
            out[base + ".lora_b"] = _permuted(module + ".weight", w, arch, config)
        else:
            raise SpillpackError(f"adapter tensor {name} is neither lora_A nor lora_B", "a spillpack or PEFT LoRA adapter")
    return out


def write_adapter(path: Path, tensors: dict[str, np.ndarray], alpha: float, config: dict, kind: str = "f32") -> dict:
    """A LoRA as llama.cpp's `--lora` adapter: general.type adapter, adapter.type lora,
    adapter.lora.alpha, and the A and B tensors of each adapted linear."""
    check_type(kind, ADAPTER_TYPES, "--adapter-type")
    gguf = _gguf()
    arch = gguf_arch(config)
    named = adapter_tensors(tensors, config)

    def fill(writer):
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_file_type(FILE_TYPE[kind])
        for n in sorted(named):
            dtype = np.float32 if kind == "f32" else np.float16
            writer.add_tensor(n, np.ascontiguousarray(named[n], dtype=dtype))

    _write(path, arch, fill)
    return {"architecture": arch, "type": kind, "tensors": len(named)}


def check_gguf_output(uri: str, flag: str, replace: bool = False) -> None:
    """Before any work: FILE can be written and, unless `replace` (a tune's own output, written
    again when the finished job is run again), is not there yet."""
    from runtime.state.uri import check_output, uri_exists

    check_output(uri, directory=False, flag=flag)
    if replace:
        return
    if uri_exists(uri):  # its size, not its bytes (an s3:// GGUF is gigabytes)
        raise UsageError(f"{flag} {uri} already exists", f"{flag} a new file, or rm {uri}")


def deliver(uri: str, write) -> None:
    """`write(path)` into FILE: a local path directly (atomically), an s3:// URI through a
    temporary file put whole."""
    from runtime.state.store import local_file
    from runtime.state.uri import open_store

    path = local_file(uri)
    if path is not None:
        write(Path(path))
        return
    with tempfile.TemporaryDirectory(prefix="spillpack-gguf-") as tmp:
        local = Path(tmp) / uri.rstrip("/").rpartition("/")[2]
        write(local)
        parent, _, key = uri.rstrip("/").rpartition("/")
        open_store(parent).put_file(key, local)


def ollama_lines(uri: str, name: str) -> list[str]:
    """The two commands that make a GGUF an Ollama model: a Modelfile FROM it, and ollama create.
    Ollama takes the chat template from the GGUF's tokenizer.chat_template."""
    from runtime.state.store import local_file

    path = local_file(uri)
    where = str(Path(path).absolute()) if path is not None else f"/path/to/{uri.rpartition('/')[2]} (copied from {uri})"
    model = "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("-._") or "spillpack"
    return [f"printf 'FROM %s\\n' {shlex.quote(where)} > Modelfile", f"ollama create {model} -f Modelfile"]
