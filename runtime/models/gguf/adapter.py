"""A LoRA adapter GGUF, as llama.cpp's convert_lora_to_gguf.py (and `spillpack export
--gguf-adapter`) write it: general.type `adapter`, adapter.type `lora`, adapter.lora.alpha, and
for each adapted linear `blk.N.<name>.weight.lora_a` (rank, in) and `.lora_b` (out, rank) in
numpy's order. Read back into spillpack's canonical LoRA names, float32.

On the `llama` architecture the query and key weights are stored with each head's rotary
halves interleaved, and so are their updates B @ A: B's rows are un-permuted here as the
weights are (tensors.unpermute). Framework-neutral (numpy and the `gguf` package).
"""

from __future__ import annotations

import numpy as np

from runtime.base.errors import SpillpackError
from runtime.models.gguf.config import FAMILIES
from runtime.models.gguf.reader import read_gguf
from runtime.models.gguf.tensors import dequantize, hf_name, type_name, unpermute

# The float types an adapter GGUF holds (llama.cpp's converter writes F32, F16, BF16 or Q8_0).
ADAPTER_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0"}
SUFFIXES = (".lora_a", ".lora_b")


def read_lora(path, config: dict, flag: str = "--adapter") -> tuple[dict[str, np.ndarray], float, str]:
    """(canonical LoRA tensors, alpha, the file's architecture) of the adapter GGUF at `path`,
    for the base whose config is `config`. Every refusal is one line naming the file."""
    gf = read_gguf(path)
    md = gf.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        what = f"general.type is {md.get('general.type')!r}" if md.get("general.type") != "adapter" \
            else f"adapter.type is {md.get('adapter.type')!r}"
        raise SpillpackError(f"{flag} {path} is a GGUF but not a LoRA adapter ({what}; a model GGUF is the job's MODEL, "
                             "not an adapter)", "a LoRA adapter GGUF (spillpack export --gguf-adapter, or llama.cpp's "
                             "convert_lora_to_gguf.py)")
    alpha = md.get("adapter.lora.alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise SpillpackError(f"{flag} {path}: adapter.lora.alpha must be a positive number, not {repr(alpha)[:40]}",
                             "an adapter GGUF written with its alpha (convert_lora_to_gguf.py records it)")
    arch = gf.architecture
    family = FAMILIES.get(arch)
    base = config.get("model_type")
    if family != base and not (arch == "llama" and base == "mistral"):  # llama.cpp carries Mistral as llama
        raise SpillpackError(f"{flag} {path} was trained on a different base: its architecture is {arch!r} and the base is "
                             f"{base!r}", "the base model the adapter was trained on")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    tensors = {}
    for info in sorted(gf.tensors.values(), key=lambda t: t.offset):
        if not info.name.endswith(SUFFIXES) or len(info.shape) != 2:
            raise SpillpackError(f"{flag} {path}: tensor {info.name} is not a 2-D LoRA lora_a or lora_b", "a LoRA adapter GGUF")
        if info.ggml_type not in ADAPTER_TYPES:
            raise SpillpackError(f"{flag} {path}: tensor {info.name} has type {type_name(info.ggml_type)}, which spillpack does "
                                 f"not read in an adapter (supported: {', '.join(ADAPTER_TYPES.values())})",
                                 "the adapter written as F32 or F16 (spillpack export --gguf-adapter, or convert_lora_to_gguf.py with outtype f16)")
        weight, half = info.name[: -len(".lora_a")], info.name[-1]
        try:
            module = hf_name(arch, weight)
        except SpillpackError:
            module = None
        if module is None or not module.endswith(".weight"):
            raise SpillpackError(f"{flag} {path}: tensor {info.name} adapts {weight}, which is not a linear spillpack maps "
                                 f"for a {arch} model", "an adapter of the attention and MLP projections")
        w = dequantize(gf, info)
        if half == "b" and arch == "llama" and weight.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if weight.endswith("attn_q.weight") else kv_heads
            if w.shape[0] % (2 * n):
                raise SpillpackError(f"{flag} {path}: tensor {info.name} has {w.shape[0]} rows, not whole heads of this base's "
                                     f"{n}", "the base model the adapter was trained on")
            w = unpermute(w, n)
        tensors[module[: -len(".weight")] + (".lora_A.weight" if half == "a" else ".lora_B.weight")] = w
    if not tensors:
        raise SpillpackError(f"{flag} {path} holds no LoRA tensor", f"gguf-dump {path}")
    return tensors, float(alpha), arch
