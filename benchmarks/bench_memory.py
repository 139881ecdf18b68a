"""Memory: activation checkpointing off vs on for a tune of the Qwen2.5-0.5B shape, the peak
while loading weights, the planner's prediction beside each measured peak, and the planner's
table of what fits where.

    python benchmarks/bench_memory.py --shape qwen2.5-0.5b --rows 4 --words 420 --steps 2
    python benchmarks/bench_memory.py --table          # planned, not measured: what fits where

Each tune runs in its own process (peak RSS is the process's ru_maxrss, what the step events
report as peak_mem_gb), torch pinned to --threads threads, one after the other.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

# Qwen2.5's published architectures (config.json of each size), for the planned table.
QWEN25 = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                 vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                 vocab_size=151936, tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
               vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
               vocab_size=152064, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, intermediate_size=13824,
                vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, intermediate_size=27648,
                vocab_size=152064, tie_word_embeddings=False),
}


def table(batch: int, targets: str) -> str:
    """Planned on torch-cuda (bfloat16 base, CUDA context counted): the plan auto picks at each
    size, or what the job needs at micro-batch 1 with checkpointing."""
    from runtime.models.memory import CUDA_CONTEXT_GB, Batch, NoFit, fit

    lines = ["| model | tokens | 24 GB | 40 GB | 80 GB |", "|---|---:|---|---|---|"]
    tg = tuple(targets.split(","))
    for name, arch in QWEN25.items():
        config = {**arch, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6}
        for seq in (1024, 2048, 4096):
            cells = []
            for gb in (24, 40, 80):
                def at(m):  # a step of `batch` full rows, half of each a target
                    return [Batch(m, seq, m * seq // 2)]
                try:
                    p = fit(config, tg, 16, 2, at, batch, 1, "auto", gb, "--max-mem-gb", CUDA_CONTEXT_GB)
                    cells.append(f"{p.micro_batch} x {p.accum}{', ckpt' if p.grad_checkpoint else ''}: {p.estimate.peak_gb:.1f}")
                except NoFit as e:
                    cells.append(f"no ({e.what.split('about ')[1].split(' GB')[0]} GB at 1, ckpt)")
            lines.append(f"| Qwen2.5-{name} | {batch} x {seq} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tune(model, data, extra, a) -> dict:
    state = tempfile.mkdtemp(prefix="bench-memory-")
    cmd = [sys.executable, "-m", "spillpack", "tune", str(model), str(data), "--steps", str(a.steps), "--batch", str(a.rows),
           "--max-seq", "4096", "--state", state, "--ckpt-every", "1000000", "--headless", *extra]
    env = {**os.environ, "SPILLPACK_HEADLESS": "1", "OMP_NUM_THREADS": str(a.threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(r.stderr)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    start = next(e for e in events if e["event"] == "start")
    steps = [e for e in events if e["event"] == "step"]
    timed = steps[1:] or steps  # the first step warms up, when there is a second
    return {"planned_gb": start["estimated_peak_gb"], "peak_rss_gb": max(e["peak_mem_gb"] for e in steps),
            "tokens_per_s": sum(e["tokens_per_s"] * e["step_s"] for e in timed) / sum(e["step_s"] for e in timed),
            "step_s": [e["step_s"] for e in steps], "message": start["message"],
            # CPU seconds of the whole process (loading included): what a loaded machine moves
            # far less than wall time, so the cost of recomputation shows in it
            "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


LOAD = r'''
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from runtime.engines.registry import get_engine
from runtime.models.ref import resolve_model
md = resolve_model(sys.argv[2])
import psutil
before = psutil.Process().memory_info().rss
engine = get_engine("torch-cpu")
model = engine.load_model(md)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cpu = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"before_gb": before / 2**30, "peak_gb": peak / 2**30, "after_gb": psutil.Process().memory_info().rss / 2**30,
                  "cpu_s": cpu.ru_utime + cpu.ru_stime}))
'''


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--words", type=int, default=420, help="words a side of each chat row (~1024 tokens at 420)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--table", action="store_true")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    a = p.parse_args()
    if a.table:
        print(table(4, a.targets))
        return
    from tests.support.memory_shapes import make_data, make_shape

    work = Path(tempfile.gettempdir()) / "spillpack-bench-memory"
    model = make_shape(a.shape, work / a.shape)
    data = make_data(work / f"rows-{a.words}.jsonl", a.rows * a.steps, a.words)
    weights_gb = (model / "model.safetensors").stat().st_size / 2**30
    load = json.loads(subprocess.run([sys.executable, "-c", LOAD, str(REPO), str(model)], capture_output=True, text=True,
                                     check=True).stdout)
    print(f"loading {a.shape}: weights {weights_gb:.2f} GB (float32 file, float32 target); process before "
          f"{load['before_gb']:.2f} GB, peak {load['peak_gb']:.2f} GB (+{load['peak_gb'] - load['before_gb']:.2f} GB)")
    for mode in ("off", "on"):
        t0 = time.perf_counter()
        r = tune(model, data, ["--grad-checkpoint", mode, "--targets", a.targets], a)
        print(f"checkpointing {mode}: planned {r['planned_gb']:.2f} GB, measured peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"{r['tokens_per_s']:.1f} tokens/s, steps {r['step_s']} s, wall {time.perf_counter() - t0:.0f} s, "
              f"process CPU {r['cpu_s']:.0f} s (loading the weights alone: {load['cpu_s']:.0f} s)")
        print("   ", r["message"])
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
