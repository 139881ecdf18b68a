"""A GGUF file as spillpack's model interfaces see it: a config dict, (name, dtype, array)
tensors, name -> shape, the tokenizer's pieces, and the Hugging Face files a merged model needs."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from runtime.base.errors import SpillpackError
from runtime.models.gguf import SUFFIX, is_gguf_file
from runtime.models.gguf.config import model_config
from runtime.models.gguf.reader import GGUFFile, read_gguf


def is_gguf(path) -> bool:
    return is_gguf_file(path)


def find_gguf(path: Path) -> Path | None:
    """The GGUF a MODEL or --weights names: the file itself, or the one .gguf in a directory
    without a config.json (a Hugging Face directory wins over a GGUF beside it)."""
    if is_gguf(path):
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        raise SpillpackError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}...), so which is the model is unclear",
                             f"the file itself as the job's MODEL or --weights, such as {found[0]}")
    return found[0] if found else None


@lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return read_gguf(path)


def open_gguf(path) -> GGUFFile:
    """The parsed header, read once per file version in a process (tokens and merges are large)."""
    st = Path(path).stat()
    return _open(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _config(path: str, size: int, mtime_ns: int) -> dict:
    return model_config(_open(path, size, mtime_ns))


def config(path) -> dict:
    """The config.json equivalent (a fresh dict each call)."""
    st = Path(path).stat()
    return json.loads(json.dumps(_config(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)))


def check(path) -> dict:
    """Everything a job needs from the file, checked before any state is touched: the header,
    the config, every tensor's name and type, the tokenizer keys. Returns the config."""
    from runtime.models.gguf.tensors import model_shapes
    from runtime.models.gguf.tokenizer import tokenizer_json

    gf = open_gguf(path)
    cfg = config(path)
    model_shapes(gf)
    tokenizer_json(gf)
    return cfg


def read_tensors(path, quantized: bool = False, mapped: bool = False):
    """(HF name, "F32", float32 array) per weight, dequantized one tensor at a time; with
    `quantized`, (HF name, its type, QuantTensor) for each weight kept in its blocks; with
    `mapped`, every 2-D weight as a view of the file's map (tensors.model_tensors)."""
    from runtime.models.gguf.tensors import model_tensors

    gf = open_gguf(path)
    for name, array in model_tensors(gf, config(path), quantized, mapped):
        yield name, getattr(array, "kind", "F32"), array
    # The weights are the last thing a job reads from the header: its parsed metadata (a tokens
    # and a merges list of about 49k strings each for SmolLM2, 7 MB) would otherwise stay
    # resident beside the model for the whole job. A later call parses the file again (0.1 s).
    del gf
    _open.cache_clear()
    _config.cache_clear()


def quantized_types(path, dense_head: bool = False) -> dict[str, int]:
    """Quantized type -> count of the 2-D weights that a quantized load keeps in their blocks."""
    from runtime.models.gguf.tensors import resident_bytes

    return resident_bytes(open_gguf(path), 4, dense_head)[1]


def float_types(path) -> dict[str, int]:
    """Float type (F32, F16, BF16) -> count of the 2-D weights stored so: what no load keeps in blocks."""
    from runtime.models.gguf.tensors import IGNORED, QUANTIZED, type_name

    out: dict[str, int] = {}
    for info in open_gguf(path).tensors.values():
        kind = type_name(info.ggml_type)
        if info.name not in IGNORED and len(info.shape) >= 2 and kind not in QUANTIZED:
            out[kind] = out.get(kind, 0) + 1
    return out


def resident_bytes(path, float_bytes: int, dense_head: bool = False) -> int:
    """The weights' bytes in memory under a quantized load (the rest, and the head with
    `dense_head`, dense at `float_bytes`)."""
    from runtime.models.gguf.tensors import resident_bytes as count

    return count(open_gguf(path), float_bytes, dense_head)[0]


def tensor_shapes(path) -> dict[str, tuple]:
    from runtime.models.gguf.tensors import model_shapes

    return model_shapes(open_gguf(path))


def fingerprint(path) -> str:
    """sha256 of the header (metadata and tensor directory) and the file's size: cheap, and
    another file (other weights, other quantization) tells itself apart."""
    return open_gguf(path).header_sha256


def tokenizer_parts(path):
    """(tokenizers.Tokenizer, tokenizer_config, config) for runtime.models.tokenizer.Tokenizer."""
    from runtime.models.gguf.tokenizer import build_tokenizer

    tok, tokenizer_config = build_tokenizer(open_gguf(path))
    return tok, tokenizer_config, config(path)


def hf_files(path) -> dict[str, bytes]:
    """config.json, tokenizer.json and tokenizer_config.json of the model, for a merged
    Hugging Face directory written from a GGUF base (`tune --merge`)."""
    from runtime.models.gguf.tokenizer import tokenizer_json

    data, tokenizer_config = tokenizer_json(open_gguf(path))
    tc = {k: v for k, v in tokenizer_config.items() if v is not None}
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    return {"config.json": (json.dumps(config(path), indent=2) + "\n").encode(),
            "tokenizer.json": json.dumps(data, ensure_ascii=False).encode("utf-8"),
            "tokenizer_config.json": (json.dumps(tc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")}
