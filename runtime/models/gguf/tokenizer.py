"""The tokenizer a GGUF's metadata describes (tokenizer.ggml.*), built with `tokenizers` alone.

It is the tokenizer transformers 5 builds from the same keys (integrations/gguf/
gguf_tokenizer_mapping.py), written out as the `tokenizers` JSON its classes produce, so a
prompt gets the same ids on both sides (tests/test_gguf_tokenizer.py compares the two
serializations and the encodings):

- `gpt2`: byte-level BPE (Llama 3, Qwen2/3, SmolLM2): the vocabulary respelled into the byte
  alphabet where the file writes raw text, the file's merges, a ByteLevel pre-tokenizer, or the
  split regex of the `tokenizer.ggml.pre` it names;
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): byte fallback, a Metaspace
  pre-tokenizer (Phi-3: a normalizer), merges from the file or recovered from the scores.

Tokens the file marks as control (type 3) are special added tokens, user-defined ones (type 4)
plain added tokens, so `<|im_end|>` stays one token wherever it appears.
"""

from __future__ import annotations

import json

from runtime.base.errors import SpillpackError
from runtime.models.token_bytes import bytes_to_unicode

CONTROL, USER_DEFINED = 3, 4
MODELS = ("gpt2", "llama")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split its merges were learned with (others: GPT-2's own regex).
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT, "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def _need(gf, key: str):
    if key not in gf.metadata:
        raise SpillpackError(f"{gf.path}: the GGUF has no {key} key, so its tokenizer cannot be built",
                             f"a GGUF that carries its tokenizer (gguf-dump {gf.path.name} lists its keys)")
    return gf.metadata[key]


def _check_lengths(gf, tokens: list, types: list) -> None:
    """The token list against what names its entries: one type (and one score) per token, and a
    token for every row of the embedding and every special id."""
    md = gf.metadata
    for key, values in (("tokenizer.ggml.token_type", types), ("tokenizer.ggml.scores", md.get("tokenizer.ggml.scores"))):
        if values and len(values) != len(tokens):
            raise SpillpackError(f"{gf.path}: {key} has {len(values)} entries for {len(tokens)} tokens",
                                 f"re-download {gf.path.name} (gguf-dump lists its keys)")
    embed = gf.tensors.get("token_embd.weight")
    if embed is not None and len(embed.dims) == 2 and len(tokens) < embed.dims[1]:
        raise SpillpackError(f"{gf.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but the embedding has {embed.dims[1]} rows",
                             f"re-download {gf.path.name} (gguf-dump lists its keys)")
    for key in _SPECIAL_IDS.values():
        i = md.get(f"tokenizer.ggml.{key}")
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tokens)):
            raise SpillpackError(f"{gf.path}: tokenizer.ggml.{key} is {i!r}, not the id of one of its {len(tokens)} tokens",
                                 f"re-download {gf.path.name} (gguf-dump lists its keys)")


def _merges(gf, tokens: list[str], vocab: dict[str, int]) -> list[list[str]]:
    md = gf.metadata
    if "tokenizer.ggml.merges" in md:
        return [m.split(" ") for m in md["tokenizer.ggml.merges"]]
    scores = md.get("tokenizer.ggml.scores")
    if gf.architecture in ("gemma", "gemma2", "gemma3"):
        scores = [-i for i in range(len(tokens))]  # Gemma's merge order is the vocabulary's, not its scores
    if scores is None:
        _need(gf, "tokenizer.ggml.merges")
    return generate_merges(vocab, dict(zip(tokens, scores)))


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[list[str]]:
    """SentencePiece BPE merges recovered from the vocabulary and its scores, best first
    (transformers' tokenization_utils_base.generate_merges with scores)."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [[a, b] for a, b, _ in merges]


def _added(content: str, i: int, special: bool) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": special}


def tokenizer_json(gf) -> tuple[dict, dict]:
    """(the `tokenizers` JSON, the tokenizer_config: special tokens, add_bos/eos, chat template)."""
    md = gf.metadata
    model = _need(gf, "tokenizer.ggml.model")
    tokens = _need(gf, "tokenizer.ggml.tokens")
    if model not in MODELS:
        raise SpillpackError(f"{gf.path}: tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(MODELS)})",
                             "a GGUF with a BPE tokenizer (gpt2 or llama), as the supported families have")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise SpillpackError(f"{gf.path}: tokenizer.ggml.tokens is not a list of strings", f"re-download {gf.path.name}")
    types = md.get("tokenizer.ggml.token_type") or []
    _check_lengths(gf, tokens, types)
    config = {"add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", model == "llama")),
              "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in _SPECIAL_IDS.items():
        i = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None
    if isinstance(md.get("tokenizer.chat_template"), str):
        config["chat_template"] = md["tokenizer.chat_template"]

    if model == "gpt2":
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
               "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab,
               "merges": _merges(gf, tokens, vocab)}
        split = SPLITS.get(md.get("tokenizer.ggml.pre"))
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split is None}
        pre = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
        normalizer = None
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        # GPT2Tokenizer's own default special token, added when the vocabulary has it.
        implicit = ["<|endoftext|>"] if "<|endoftext|>" in vocab else []
        controls = [i for i, t in enumerate(types) if t == CONTROL and set(spelled[i]) <= alphabet]
    else:
        vocab = {t: i for i, t in enumerate(tokens)}
        if gf.architecture in ("gemma", "gemma2", "gemma3"):
            # A token of spaces is stored as spaces; SentencePiece looks it up as "▁"s.
            tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
            vocab = {t: i for i, t in enumerate(tokens)}
        spelled = tokens
        bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
               "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
               "vocab": vocab, "merges": _merges(gf, tokens, vocab)}
        strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]
        implicit = [t for t in ("<unk>", "<s>", "</s>") if t in vocab]  # LlamaTokenizer's defaults
        if gf.architecture == "phi3":  # the prefix space from a normalizer, not Metaspace
            normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                              {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
            pre, decoders = None, decoders + [strip]
        elif gf.architecture in ("gemma", "gemma2", "gemma3"):  # GemmaTokenizer: spaces kept as "▁", no prefix space
            normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            pre = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
            bpe["unk_token"] = "<unk>"
            implicit = [t for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>") if t in vocab]
        else:
            normalizer = None
            pre = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
            decoders = decoders + [strip]
        decoder = {"type": "Sequence", "decoders": decoders}
        controls = [i for i, t in enumerate(types) if t == CONTROL]
    special = set(controls) | {vocab[t] for t in implicit}
    special |= {vocab[config[n]] for n in _SPECIAL_IDS if config.get(n) in vocab}
    user = {i for i, t in enumerate(types) if t == USER_DEFINED} - special
    added = [_added(spelled[i], i, i in special) for i in sorted(special | user)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
            "pre_tokenizer": pre, "post_processor": post_processor(config, vocab), "decoder": decoder, "model": bpe}, config


def post_processor(config: dict, vocab: dict) -> dict:
    """transformers' TemplateProcessing for add_bos_token / add_eos_token."""
    bos = config.get("bos_token") if config["add_bos_token"] else None
    eos = config.get("eos_token") if config["add_eos_token"] else None

    def seq(s, type_id):
        return {"Sequence": {"id": s, "type_id": type_id}}

    def tok(t, type_id):
        return {"SpecialToken": {"id": t, "type_id": type_id}}

    single = ([tok(bos, 0)] if bos else []) + [seq("A", 0)] + ([tok(eos, 0)] if eos else [])
    pair = single + ([tok(bos, 1)] if bos else []) + [seq("B", 1)] + ([tok(eos, 1)] if eos else [])
    specials = {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in (bos, eos) if t}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def build_tokenizer(gf):
    """(tokenizers.Tokenizer, tokenizer_config) of a GGUF."""
    from tokenizers import Tokenizer

    data, config = tokenizer_json(gf)
    try:
        return Tokenizer.from_str(json.dumps(data, ensure_ascii=False)), config
    except Exception as e:  # the Rust side raises a bare Exception
        raise SpillpackError(f"{gf.path}: its tokenizer metadata does not make a tokenizer ({e})", f"re-download {gf.path.name}")
