"""config.json held to what the engines read from it: every field of the architecture's
arguments (runtime.models.args and families) by its declared type and range, the token ids,
and the rules across fields (heads dividing the width, kv heads dividing heads, one layer type
per layer), so a wrong value is one line naming the file and the field, not an error deep in
a framework. Framework-neutral: numpy only, through runtime.models.args."""

from __future__ import annotations

import math
import re
from dataclasses import fields

from runtime.base.errors import SpillpackError

DIM_MAX = 2**31 - 1  # a tensor dimension the engines index with int32
# Whole-number fields that count something and so are at least 1 (the others are at least 0).
POSITIVE = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "original_max_position_embeddings", "sliding_window", "num_experts_per_tok",
            "decoder_sparse_step", "sliding_window_pattern"}
# Number fields that must be more than 0 (the others may be any finite number).
ABOVE_ZERO = {"rms_norm_eps", "rope_theta", "partial_rotary_factor", "query_pre_attn_scalar", "rope_local_base_freq",
              "final_logit_softcapping", "attn_logit_softcapping"}
TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def check_model_config(config: dict, args_cls, where: str, shapes: dict | None = None, names: dict | None = None):
    """The model's arguments built from `config`, or one line naming `where` and the field.

    `shapes` (tensor name -> shape, from the weights' headers) hold every size the config states
    to the tensors actually present, before anything of that size is built: a config claiming a
    billion layers over a file of two is refused, not allocated. `names`: how the file spells a
    field (a GGUF's own keys), for the message."""
    def bad(key: str, rule: str):
        shown = repr(config[key])
        spelled = (names or {}).get(key, key)
        return SpillpackError(f"{where}: \"{spelled}\" must be {rule}, not {shown[:60]}",
                              f"fix \"{spelled}\" in {where}, or download the model again")

    for f in fields(args_cls):
        value = config.get(f.name)
        if value is None:
            continue  # absent or null: the field's default (a required one is named below)
        kind = str(f.type).split("|")[0].strip()
        if kind == "int":
            low = 1 if f.name in POSITIVE else 0
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(f.name, "a whole number")
            if not low <= value <= DIM_MAX:
                raise bad(f.name, f"a whole number from {low} to {DIM_MAX}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f.name, "a finite number")
            if f.name in ABOVE_ZERO and value <= 0:
                raise bad(f.name, "more than 0")
            if f.name == "partial_rotary_factor" and value > 1:
                raise bad(f.name, "at most 1")
        elif kind == "bool" and not isinstance(value, bool):
            raise bad(f.name, "true or false")
        elif kind == "str" and not isinstance(value, str):
            raise bad(f.name, "text")
        elif kind == "dict" and not isinstance(value, dict):
            raise bad(f.name, "an object")
        elif kind.startswith("list") and not isinstance(value, list):
            raise bad(f.name, "a list")
    for key in TOKEN_IDS:
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= DIM_MAX for i in ids):
            raise bad(key, "a token id (a whole number 0 or more) or a list of them")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if config.get(key) is None:
            raise SpillpackError(f"{where} has no \"{key}\"", f"download the model again (its config.json is incomplete)")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise bad("num_attention_heads", f"a divisor of hidden_size {config['hidden_size']} (there is no head_dim)")
    if heads % kv:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads {heads}")
    if config.get("num_experts") and config.get("num_experts_per_tok", 1) > config["num_experts"]:
        raise bad("num_experts_per_tok", f"at most num_experts {config['num_experts']}")
    if shapes is not None:
        _check_against_tensors(config, shapes, bad)
    types = config.get("layer_types")
    if isinstance(types, list):
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise bad("layer_types", "a list of \"full_attention\" and \"sliding_attention\"")
        if len(types) != config["num_hidden_layers"]:
            raise bad("layer_types", f"one entry per layer ({config['num_hidden_layers']})")
    from runtime.models.args import rope

    try:  # what is left is read when the model is built: its arguments and its rotary embedding per layer type
        args = args_cls.from_dict(config)
        for layer_type in sorted(set(args.layer_types)):
            rope(args, layer_type)
    except SpillpackError:
        raise
    except (TypeError, ValueError, KeyError, AssertionError, ZeroDivisionError, OverflowError, AttributeError) as e:
        raise SpillpackError(f"{where} does not describe a model spillpack can build ({type(e).__name__}: {str(e)[:100]})",
                             f"check {where} against the model's original, or download the model again")
    return args


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _one(shapes: dict, suffix: str):
    """The shape of the first tensor whose name ends with `suffix` (layer 0's, for a layer's part)."""
    for name, shape in shapes.items():
        if name.endswith(suffix) and (".layers." not in name or ".layers.0." in name or name.startswith("layers.0.")):
            return tuple(shape)
    return None


def _check_against_tensors(config: dict, shapes: dict, bad) -> None:
    """Each size the config states, against the tensors that carry it."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.search(name))}
    n = config["num_hidden_layers"]
    if len(layers) != n or layers != set(range(n)):  # the length first: n may be what the file lies about
        held = f"layers 0 to {max(layers)}" if layers and layers == set(range(max(layers) + 1)) else (
            f"{len(layers)} layers numbered {min(layers)} to {max(layers)}" if layers else "no layers")
        raise bad("num_hidden_layers", f"the number of layers the weights hold ({held})")
    embed = _one(shapes, "embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        if config["hidden_size"] != embed[1]:
            raise bad("hidden_size", f"the embedding's width {embed[1]}")
        if config["vocab_size"] != embed[0]:
            raise bad("vocab_size", f"the embedding's {embed[0]} rows")
        for key in TOKEN_IDS:
            value = config.get(key)
            if any(i >= embed[0] for i in (value if isinstance(value, list) else [value] if value is not None else [])):
                raise bad(key, f"a token id below the vocabulary's {embed[0]}")
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q, k = _one(shapes, "self_attn.q_proj.weight"), _one(shapes, "self_attn.k_proj.weight")
    if q is not None and q[0] != heads * head_dim:
        raise bad("num_attention_heads", f"{q[0]} // head_dim {head_dim}, as the query projection's {q[0]} rows say")
    if k is not None and k[0] != kv * head_dim:
        raise bad("num_key_value_heads" if "num_key_value_heads" in config else "num_attention_heads",
                  f"{k[0]} // head_dim {head_dim}, as the key projection's {k[0]} rows say")
    qkv = _one(shapes, "self_attn.qkv_proj.weight")
    if qkv is not None and qkv[0] != (heads + 2 * kv) * head_dim:
        raise bad("num_attention_heads", f"what the joined qkv projection's {qkv[0]} rows hold")
    up, gate_up = _one(shapes, "mlp.up_proj.weight"), _one(shapes, "mlp.gate_up_proj.weight")
    if up is not None and up[0] != config["intermediate_size"]:
        raise bad("intermediate_size", f"the up projection's {up[0]} rows")
    if gate_up is not None and gate_up[0] != 2 * config["intermediate_size"]:
        raise bad("intermediate_size", f"half the joined gate_up projection's {gate_up[0]} rows")
    experts = {int(m.group(1)) for name in shapes if (m := re.search(r"\.experts\.(\d+)\.", name))}
    key = "num_experts" if config.get("num_experts") else "num_local_experts"
    if experts and config.get(key) and (len(experts) != config[key] or experts != set(range(config[key]))):
        raise bad(key, f"the number of experts the weights hold ({len(experts)})")
