"""A GGUF's tensors under the Hugging Face names spillpack's models keep, dequantized to float32,
or kept in their quantized blocks (QuantTensor) for an engine that multiplies them as they are.

Dequantization is the `gguf` package's (llama.cpp's own Python reference), imported only when a
GGUF is read. Two of llama.cpp's conversions are undone here, as transformers undoes them:
the q and k projections of llama-family files are permuted (llama.cpp interleaves each head's
rotary halves), and Gemma's norm weights are stored plus one. Qwen3-MoE's experts come stacked
in one tensor per projection and are split into the per-expert linears.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from runtime.base.errors import SpillpackError

# The tensor types spillpack reads, by ggml type id (gguf.GGMLQuantizationType).
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

# Tensors a file may carry that are not weights of the model (rotary factors are read into the
# config where spillpack can use them; see config.py).
IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
# Where a family's layer names differ from the table above.
_FAMILY_LAYER = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


# The quantized types an engine may keep as blocks instead of dequantizing (2-D weights only).
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class QuantTensor:
    """A 2-D weight in its GGUF blocks: `raw` is uint8 (rows, bytes per row), each row the blocks
    of one output row (a row is whole blocks, so rows can be permuted, split and joined as bytes)."""

    kind: str  # one of QUANTIZED
    shape: tuple[int, int]  # (out, in), numpy's order
    raw: np.ndarray
    order: np.ndarray | None = None  # mapped (runtime.models.mapped): row i is the stored row order[i]

    @property
    def mapped(self) -> bool:
        """`raw` is a read-only view of the file's map (a streamed load), not a copy."""
        return not self.raw.flags.writeable

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 (out, in), as the dense load makes it (gguf's own dequantization)."""
        import gguf

        out = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.kind])
        return np.ascontiguousarray(out, dtype=np.float32).reshape(self.shape)


def type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


def type_sizes(path, name: str, ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported tensor type, or the one refusal."""
    if ggml_type not in SUPPORTED_TYPES:
        raise SpillpackError(
            f"{path}: tensor {name} has type {type_name(ggml_type)}, which spillpack does not read "
            f"(supported: {', '.join(SUPPORTED_TYPES.values())})",
            "a GGUF quantized as Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 or F16 (llama-quantize can convert one)",
        )
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def hf_name(family: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for the stacked experts, split elsewhere)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None:
        raise SpillpackError(f"tensor {gguf_name} is not one spillpack maps for a {family} GGUF",
                             "a GGUF converted by llama.cpp's convert_hf_to_gguf.py from a supported model")
    layer, part, kind = m.groups()
    if part in _EXPERTS:
        return None
    table = {**_LAYER, **_FAMILY_LAYER.get(family, {})}
    if part not in table:
        raise SpillpackError(f"tensor {gguf_name} is not one spillpack maps for a {family} GGUF",
                             "a GGUF converted by llama.cpp's convert_hf_to_gguf.py from a supported model")
    return f"model.layers.{layer}.{table[part]}.{kind}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf.py's LlamaModel.permute): within each
    head its rows were reordered from (half, pair) to (pair, half)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantize(gf, info) -> np.ndarray:
    """A tensor as float32 in numpy's shape (a fresh array, never a view of a file buffer)."""
    import gguf

    raw = gf.read_raw(info)
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(info.shape)


def model_tensors(gf, config: dict, quantized: bool = False, mapped: bool = False):
    """(HF name, float32 array) for each weight of the model, one tensor at a time, in file order;
    with `quantized`, a 2-D weight of a QUANTIZED type comes as a QuantTensor instead (its rows
    un-permuted as bytes, no float copy made). With `mapped` (a streamed load), every 2-D weight
    is a read-only view of the file's map (runtime.models.mapped): a QuantTensor, or a
    MappedFloat for a float type, q and k carrying their row order instead of being un-permuted;
    the 1-D ones are read and converted as ever."""
    family = gf.architecture
    permute = family == "llama"  # also Mistral, which GGUF carries as llama
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    whole = None
    if mapped:
        from runtime.models.mapped import open_map

        whole = open_map(gf.path)
    for info in sorted(gf.tensors.values(), key=lambda t: t.offset):
        if info.name in IGNORED:
            continue
        name = hf_name(family, info.name)
        kind = type_name(info.ggml_type)
        n_heads = None
        if permute and info.name.endswith(("attn_q.weight", "attn_q.bias")):
            n_heads = heads
        elif permute and info.name.endswith(("attn_k.weight", "attn_k.bias")):
            n_heads = kv_heads
        if whole is not None and len(info.shape) in (2, 3):
            yield from _mapped(gf, whole, info, name, kind, n_heads)
            continue
        blocks = quantized and kind in QUANTIZED and len(info.shape) in (2, 3)
        w = gf.read_raw(info) if blocks else dequantize(gf, info)
        if name is None:  # (experts, out, in): one linear per expert
            for expert, part in _experts(info, w):
                yield expert, (QuantTensor(kind, tuple(info.shape[1:]), np.ascontiguousarray(part)) if blocks
                               else np.ascontiguousarray(part))
            continue
        if n_heads is not None:
            w = unpermute(w, n_heads)
        if family == "gemma3" and info.name.endswith("norm.weight"):
            w = w - np.float32(1)
        yield name, (QuantTensor(kind, tuple(info.shape), np.ascontiguousarray(w)) if blocks else w)


def _experts(info, w):
    """(HF name, part) of each expert of a stacked (experts, out, in) tensor."""
    m = _BLOCK.match(info.name)
    proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[m.group(2)]
    for e in range(w.shape[0]):
        yield f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight", w[e]


def _mapped(gf, whole, info, name, kind, n_heads):
    """A 2-D (or stacked 3-D) tensor as views of the map: QuantTensor or MappedFloat."""
    from runtime.models.mapped import FLOAT_VIEWS, MappedFloat, view

    offset = gf.data_start + info.offset
    if kind in FLOAT_VIEWS:
        raw = view(whole, offset, info.nbytes, FLOAT_VIEWS[kind], info.shape)
        make = lambda shape, part, order: MappedFloat(kind, shape, part, order)
    else:
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = view(whole, offset, info.nbytes, np.uint8, (*info.shape[:-1], info.nbytes // rows))
        make = lambda shape, part, order: QuantTensor(kind, shape, part, order)
    if name is None:
        for expert, part in _experts(info, raw):
            yield expert, make(tuple(info.shape[1:]), part, None)
        return
    order = None if n_heads is None else unpermute(np.arange(info.shape[0]), n_heads)
    yield name, make(tuple(info.shape), raw, order)


def head_name(gf) -> str:
    """The file's tensor the logits multiply by: its own head, else the embedding it is tied to."""
    return "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"


def resident_bytes(gf, float_bytes: int, dense_head: bool = False) -> tuple[int, dict[str, int]]:
    """What the weights hold in memory when the QUANTIZED 2-D ones stay in their blocks (but the
    head, with `dense_head`) and the rest is dense at `float_bytes` a value: (bytes, quantized
    type -> tensor count)."""
    total, kinds = 0, {}
    head = head_name(gf) if dense_head else None
    for info in gf.tensors.values():
        if info.name in IGNORED:
            continue
        kind = type_name(info.ggml_type)
        if kind in QUANTIZED and len(info.shape) in (2, 3) and info.name != head:
            total += info.nbytes
            kinds[kind] = kinds.get(kind, 0) + 1
        else:
            total += int(np.prod(info.shape, dtype=np.int64)) * float_bytes
    return total, kinds


def model_shapes(gf) -> dict[str, tuple]:
    """HF name -> shape of every weight, from the header alone."""
    out = {}
    for info in gf.tensors.values():
        if info.name in IGNORED:
            continue
        name = hf_name(gf.architecture, info.name)
        if name is None:
            m = _BLOCK.match(info.name)
            proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[m.group(2)]
            for e in range(info.shape[0]):
                out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight"] = info.shape[1:]
        else:
            out[name] = info.shape
    return out
