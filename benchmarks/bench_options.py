"""What OpenAI's per-row options cost `spillpack run`'s generator, measured side by side in one process.

    PYTHONPATH=. python benchmarks/bench_options.py --model tiny --rows 32 --max-tokens 48 --against /work/main
    PYTHONPATH=. python benchmarks/bench_options.py --model /path/to/SmolLM2 --rows 16 --max-tokens 48

Two comparisons, each on the same model, decoder, prompts and slots (--batch), greedy:

- `plain`: rows without options through this tree's Generator and through the Generator of
  another checkout (--against: its runtime/engines/generation.py, loaded beside this one), so a plain
  batch can be held to the code before these options existed;
- `schema`: the same rows with a JSON schema each (response_format json_schema, llguidance
  masks every step) against the same rows unconstrained.

Runs alternate (A B, B A, A B, ...; --repeats pairs) so a machine whose load changes affects both;
the best run of each is reported, as tokens generated per second (a constrained row may end
earlier, when its JSON is complete) and the ratio B/A. Print `uptime` beside the figures.
"""

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

from runtime.data.grammars import grammar_for
from runtime.engines.registry import get_engine
from runtime.engines.generation import Generator, Request
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


def load_generator_class(checkout: Path):
    path = next(p for p in (checkout / "runtime/engines/generation.py", checkout / "runtime/generation.py") if p.exists())
    spec = importlib.util.spec_from_file_location("other_generation", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["other_generation"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.Generator, mod.Request


def prompts_for(tok, n, seed=0):
    people = ["Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana"]
    cities = ["Lisbon", "Oslo", "Taipei", "Dublin", "Lima", "Accra"]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"Extract the person as JSON: {rng.choice(people)} is {rng.randint(18, 90)} and lives in {rng.choice(cities)}. " * (1 + i % 3)
        out.append(tok.encode_prompt([{"role": "user", "content": text}]) if tok.chat_template else tok.encode(text))
    return out


def timed(gen_cls, req_cls, model, tok, prompts, max_tokens, batch, **opts):
    gen = gen_cls(model.make_decoder(min(batch, len(prompts)), max(map(len, prompts)) + max_tokens), tok)
    for i, p in enumerate(prompts):
        gen.add(req_cls(str(i), p, max_tokens, **opts))
    t0, tokens = time.perf_counter(), 0
    while gen.active:
        for r in gen.step():
            tokens += r.completion_tokens
    return tokens, time.perf_counter() - t0


def side_by_side(name, a, b, repeats):
    best = {}
    for n in range(repeats):
        # A B, then B A: the one that runs second in a pair is not always the same
        for label, fn in ((("A", a), ("B", b)) if n % 2 == 0 else (("B", b), ("A", a))):
            tokens, seconds = fn()
            rate = tokens / seconds
            if rate > best.get(label, (0, 0, 0))[0]:
                best[label] = (rate, tokens, seconds)
    (ra, ta, sa), (rb, tb, sb) = best["A"], best["B"]
    print(f"{name}: A {ra:.1f} tok/s ({ta} tokens, {sa:.2f} s), B {rb:.1f} tok/s ({tb} tokens, {sb:.2f} s), B/A {rb / ra:.3f}")
    return rb / ra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", type=Path, help="another checkout whose Generator runs the plain rows as A")
    ap.add_argument("--only", choices=["plain", "schema"])
    a = ap.parse_args()
    model_dir = resolve_model(a.model)
    tok = Tokenizer.from_dir(model_dir.path)
    engine = get_engine(os.environ.get("SPILLPACK_ENGINE", "torch-cpu"))
    model = engine.load_model(model_dir)
    prompts = prompts_for(tok, a.rows)
    print(f"{a.model}: {a.rows} rows, max_tokens {a.max_tokens}, batch {a.batch}, engine {engine.name}, load {os.getloadavg()}")
    if a.against and a.only != "schema":
        other_gen, other_req = load_generator_class(a.against)
        side_by_side(f"plain rows, A = {a.against}, B = this tree",
                     lambda: timed(other_gen, other_req, model, tok, prompts, a.max_tokens, a.batch),
                     lambda: timed(Generator, Request, model, tok, prompts, a.max_tokens, a.batch), a.repeats)
    if a.only != "plain":
        grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        timed(Generator, Request, model, tok, prompts[:1], 4, 1, grammar=grammar)  # llguidance's tokenizer, built once
        side_by_side("every row a JSON schema: A = unconstrained, B = constrained",
                     lambda: timed(Generator, Request, model, tok, prompts, a.max_tokens, a.batch),
                     lambda: timed(Generator, Request, model, tok, prompts, a.max_tokens, a.batch, grammar=grammar), a.repeats)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
