"""config.json held to what the engines read from it: every field of the architecture's
arguments (runtime.models.args and families) by its declared type and range, the token ids,
and the rules across fields (heads dividing the width, kv heads dividing heads, one layer type
per layer), so a wrong value is one line naming the file and the field, not an error deep in
a framework. Framework-neutral: numpy only, through runtime.models.args."""

from __future__ import annotations

import math
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


def check_model_config(config: dict, args_cls, where: str):
    """The model's arguments built from `config`, or one line naming `where` and the field."""
    def bad(key: str, rule: str):
        shown = repr(config[key])
        return SpillpackError(f"{where}: \"{key}\" must be {rule}, not {shown[:60]}",
                              f"fix \"{key}\" in {where}, or download the model again")

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
