"""The bytes each token id stands for, from a `tokenizers` tokenizer (no transformers).

OpenAI's logprobs give every token as text and as its UTF-8 `bytes`; a byte-level BPE token
can be part of one character, so the bytes cannot come from decoding it alone. Byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM) spells bytes with GPT-2's printable alphabet; SentencePiece-
style vocabularies spell a space as "▁" and a raw byte as "<0xAB>". Added (special) tokens
are their own UTF-8 text.
"""

from __future__ import annotations

import json


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet): printable bytes stand
    for themselves, the rest are shifted to code points from 256 on."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _gpt2_byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(spec: dict) -> bool:
    def has(node) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(x) for x in node.get("decoders") or node.get("pretokenizers") or [])
    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))


def byte_table(tokenizer) -> list[bytes | None]:
    """bytes for each id below the vocabulary size (None where an id has no token)."""
    spec = json.loads(tokenizer.to_str())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = {t["id"]: t["content"].encode() for t in spec.get("added_tokens", [])}
    table: list[bytes | None] = [None] * size
    byte_level = _is_byte_level(spec)
    decoder = _gpt2_byte_decoder()
    for i in range(size):
        if i in added:
            table[i] = added[i]
            continue
        piece = tokenizer.id_to_token(i)
        if piece is None:
            continue
        if byte_level and all(ch in decoder for ch in piece):
            table[i] = bytes(decoder[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table[i] = bytes([int(piece[3:5], 16)])
        else:
            table[i] = piece.replace("▁", " ").encode()
    return table
