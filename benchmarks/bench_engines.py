"""Tune and generation tokens/s for each engine usable on this machine, side by side.

    python benchmarks/bench_engines.py                 # tiny and a 23M-parameter random Qwen2
    python benchmarks/bench_engines.py --model DIR     # any HF directory (e.g. Qwen2.5-0.5B)

Every engine runs the same work through the engine interface the jobs use: LoRA (rank 16 on
all seven projections) forward+backward+AdamW on batches of random tokens, then greedy
continuous-batching generation. Warm-up steps are excluded. Figures go to stdout as a
table (and --json FILE); on Apple silicon or a CUDA machine the same script gives the
figures that matter.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.models.lora import LoraSpec, init_tensors  # noqa: E402
from runtime.engines import OptimSpec  # noqa: E402
from runtime.engines.registry import get_engine  # noqa: E402
from runtime.engines.generation import Request  # noqa: E402
from runtime.engines.hardware import ENGINE_NAMES, probe  # noqa: E402
from runtime.models.ref import resolve_model  # noqa: E402
from runtime.models.tiny import ensure_tiny  # noqa: E402
from runtime.models.tokenizer import Tokenizer  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_small(out: Path) -> Path:
    """A random Qwen2 of ~23M parameters with tiny's tokenizer: big enough that compute, not
    Python overhead, sets the rate."""
    from safetensors.numpy import save_file

    tiny = ensure_tiny()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    rng = np.random.default_rng(0)
    h, i, L, v, kv = 512, 1408, 8, cfg["vocab_size"], 2 * 64
    w = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for l in range(L):
        p = f"model.layers.{l}."
        w.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                  p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                  p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                  p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                  p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    tensors = {k: (np.ones(s) if k.endswith("norm.weight") else rng.normal(0, 0.02, s)).astype(np.float32) for k, s in w.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def bench_tune(engine, md, steps: int, batch: int, seq: int) -> float:
    spec = LoraSpec(16, 32.0, TARGETS)
    session = engine.train_session(md, spec, init_tensors(md.config, spec, 0), OptimSpec())
    rng = np.random.default_rng(0)
    V = md.config["vocab_size"]
    mbs = [(ids, ids.copy()) for ids in [rng.integers(0, V, size=(batch, seq))]]
    for _ in range(2):  # warm-up
        session.forward_backward(mbs, batch * seq)
        session.apply(1e-4)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += session.forward_backward(mbs, batch * seq)[1]
        session.apply(1e-4)
    return tokens / (time.perf_counter() - t0)


def bench_generate(engine, md, tok, slots: int, requests: int, prompt_len: int, max_tokens: int) -> float:
    tok.eos_token_ids = frozenset()  # random weights: every request runs to max_tokens
    rng = np.random.default_rng(1)
    V = md.config["vocab_size"]

    def run(n):
        gen = engine.generator(md, tok, slots=slots, max_len=prompt_len + max_tokens)
        for r in range(n):
            gen.add(Request(str(r), rng.integers(0, V - 10, size=prompt_len).tolist(), max_tokens))
        t0, done = time.perf_counter(), 0
        while gen.active:
            done += sum(r.completion_tokens for r in gen.step())
        return done / (time.perf_counter() - t0)

    run(slots)  # warm-up
    return run(requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="HF model directory (repeatable); default: tiny and small")
    ap.add_argument("--engines", default=",".join(ENGINE_NAMES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    models = args.model or [str(ensure_tiny()), str(make_small(tmp / "small"))]
    rows = []
    for name in args.engines.split(","):
        p = probe(name)
        if not p.usable:
            print(f"{name}: not usable here ({p.detail})", file=sys.stderr)
            continue
        engine = get_engine(name)
        for m in models:
            md = resolve_model(m)
            label = "small (23M, random)" if Path(m).name == "small" else Path(m).name
            tune = bench_tune(engine, md, args.steps, args.batch, args.seq)
            gen = bench_generate(engine, md, Tokenizer.from_dir(md.path), args.slots, args.requests, 32, args.max_tokens)
            rows.append({"engine": name, "model": label, "tune_tokens_per_s": round(tune, 1),
                         "generate_tokens_per_s": round(gen, 1), "peak_mem_gb": round(engine.peak_mem_gb(), 3)})
            print(f"{name:<10} {label:<20} tune {tune:9.1f} tok/s   generate {gen:8.1f} tok/s", file=sys.stderr, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ntune: LoRA r16 on all projections, batch {args.batch} x {args.seq} tokens; "
          f"generate: {args.requests} requests, 32-token prompts, {args.max_tokens} new tokens, {args.slots} slots, greedy\n")
    print("| engine | model | tune tokens/s | generate tokens/s |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['model']} | {r['tune_tokens_per_s']} | {r['generate_tokens_per_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
