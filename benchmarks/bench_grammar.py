"""Constrained-decoding libraries side by side, on the work `spillpack run` gives them.

    PYTHONPATH=. python benchmarks/bench_grammar.py --tokenizer /path/to/model [--rows 8]

For each library that fits a bundle (a wheel without torch: the MLX engine must not import
it) this compiles one JSON schema per row (a different schema each), then walks every row of
a continuous batch one token at a time through a valid answer: each step computes every
row's allowed-token mask (as the generator must before it samples) and advances the row by
the answer's next token. Prints compile seconds per schema and mask+advance microseconds per
row-token. xgrammar is not measured: its wheel requires torch, transformers and triton.
"""

import argparse
import json
import time

import numpy as np
from tokenizers import Tokenizer as HFTokenizer


def schemas(n):
    out = []
    for i in range(n):
        props = {"name": {"type": "string"}, "age": {"type": "integer"},
                 "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                 f"tag{i}": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                 "score": {"type": "number"}}
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return out


def answer(i):
    return json.dumps({"name": f"Ann Lee {i}", "age": 30 + i, "city": "Rome", f"tag{i}": ["a", "bc"], "score": 1.5},
                      separators=(", ", ": "))


def bench_llguidance(tok_json, tok, n):
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    matchers = [llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(s)) for s in schemas(n)]
    t_compile = (time.perf_counter() - t0) / n
    assert not any(m.is_error() for m in matchers), [m.get_error() for m in matchers]
    paths = [tok.encode(answer(i), add_special_tokens=False).ids for i in range(n)]
    ex = llguidance.LLExecutor()
    mask = lnp.allocate_token_bitmask(n, lt.vocab_size)
    steps = max(map(len, paths))
    t0, count = time.perf_counter(), 0
    for s in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if s < len(paths[i])]
        lnp.fill_next_token_bitmask_par(ex, live, mask)
        for m, i in live:
            t = paths[i][s]
            assert (mask[i, t // 32] >> (t % 32)) & 1, (i, s)
            m.consume_token(t)
            count += 1
    return t_tok, t_compile, (time.perf_counter() - t0) / count * 1e6


def bench_outlines(tok, n):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    from runtime.models.token_bytes import byte_table

    t0 = time.perf_counter()
    table = byte_table(tok)
    eos = tok.token_to_id("<|endoftext|>") or 0
    by_bytes = {}
    for i, b in enumerate(table):
        if b is not None and i != eos:
            by_bytes.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(eos, by_bytes)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    guides = [outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(s)), vocab)) for s in schemas(n)]
    t_compile = (time.perf_counter() - t0) / n
    paths = [tok.encode(answer(i), add_special_tokens=False).ids for i in range(n)]
    V = tok.get_vocab_size()
    mask = np.zeros((n, (V + 31) // 32), dtype=np.int32)
    steps = max(map(len, paths))
    t0, count = time.perf_counter(), 0
    for s in range(steps):
        for i, g in enumerate(guides):
            if s >= len(paths[i]):
                continue
            row = mask[i]
            g.write_mask_into(row.ctypes.data, row.size, 4)
            t = paths[i][s]
            assert (row[t // 32] >> (t % 32)) & 1, (i, s)
            g.advance(t)
            count += 1
    return t_tok, t_compile, (time.perf_counter() - t0) / count * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a model directory with tokenizer.json")
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args()
    tok_json = open(f"{a.tokenizer}/tokenizer.json").read()
    tok = HFTokenizer.from_str(tok_json)
    print(f"vocab {tok.get_vocab_size()}, {a.rows} rows, a schema each")
    for name, fn in (("llguidance", lambda: bench_llguidance(tok_json, tok, a.rows)), ("outlines-core", lambda: bench_outlines(tok, a.rows))):
        try:
            t_tok, t_compile, us = fn()
            print(f"{name:14s} tokenizer {t_tok:.3f} s, compile {t_compile * 1000:.1f} ms/schema, mask+advance {us:.1f} us/row-token")
        except Exception as e:
            print(f"{name:14s} failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
