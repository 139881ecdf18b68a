"""A data-parallel tune on this machine: tokens/s of 1 process against N ranks (gloo on CPU,
each rank with one thread), and the gradient all-reduce of one step for a LoRA of the
Qwen2.5-0.5B shape, through the code a tune runs (ProcessGroup.sum_gradients).

    python benchmarks/bench_dist.py                    # tiny, 1 vs 2 ranks; all-reduce on 2 ranks
    python benchmarks/bench_dist.py --ranks 2 --steps 40 --batch 4 --grad-accum 2

The tune side runs `spillpack tune ... --nproc N` as a user would (torchrun's agent, N
processes) and reads the step events: tokens/s over every step but the first.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Qwen2.5-0.5B's shape (benchmarks/bench_tune.py): its LoRA is what the all-reduce moves.
QWEN05 = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
              vocab_size=151936, tie_word_embeddings=True)


def tune_side(nproc: int, a) -> dict:
    state = Path(tempfile.mkdtemp(prefix="bench-dist-")) / "s"
    cmd = [sys.executable, "-m", "spillpack", "tune", "tiny", str(REPO / "examples/data/train.jsonl"), "--steps", str(a.steps),
           "--batch", str(a.batch), "--grad-accum", str(a.grad_accum), "--rank", "16", "--targets", a.targets,
           "--state", str(state), "--ckpt-every", "1000000", "--nproc", str(nproc)]
    env = {**os.environ, "SPILLPACK_HEADLESS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    steps = [e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "step"][1:]
    tokens = sum(e["tokens_per_s"] * e["step_s"] for e in steps)
    seconds = sum(e["step_s"] for e in steps)
    return {"ranks": nproc, "tokens_per_s": tokens / seconds, "median_step_s": statistics.median(e["step_s"] for e in steps),
            "final_loss": steps[-1]["loss"]}


WORKER = r'''
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from runtime.engines.torch.distributed import ProcessGroup
from runtime.models.lora import LoraSpec, init_tensors
config, repeat, engine = json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dev = "cuda" if engine == "torch-cuda" else "cpu"
spec = LoraSpec(rank=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"), dropout=0.0)
class Session:  # what sum_gradients reads of a TorchTrainSession: its LoRA parameters by name
    def __init__(self):
        self.params = {n: torch.nn.Parameter(torch.from_numpy(t).to(dev)) for n, t in init_tensors(config, spec, 0).items()}
        self.names = sorted(self.params)
g = ProcessGroup(engine)
s = Session()  # after the group: on CUDA each rank's tensors go to its own GPU
times = []
for i in range(repeat + 2):
    for p in s.params.values():
        p.grad = torch.randn_like(p)
    t0 = time.perf_counter()
    g.sum_gradients(s, 1.0, 1)
    if dev == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
if g.rank == 0:
    n = sum(p.numel() for p in s.params.values())
    print(json.dumps({"params": n, "mb": n * 4 / 1e6, "median_s": sorted(times[2:])[len(times[2:]) // 2], "min_s": min(times[2:])}))
g.finish()
'''


def allreduce_side(world: int, repeat: int, engine: str = "torch-cpu") -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(REPO), json.dumps(QWEN05), str(repeat), engine], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(world),
                                              "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("all-reduce workers failed")
    return json.loads(outs[0].splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--engine", default="torch-cpu", help="torch-cpu (gloo) or torch-cuda (NCCL) for the all-reduce")
    ap.add_argument("--allreduce-only", action="store_true")
    a = ap.parse_args()
    if a.allreduce_only:
        return report_allreduce(a)
    print(f"load average before: {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    one = tune_side(1, a)
    many = tune_side(a.ranks, a)
    for r in (one, many):
        print(f"tiny tune, {r['ranks']} rank(s): {r['tokens_per_s']:.0f} tokens/s, median step {r['median_step_s'] * 1000:.1f} ms, "
              f"final loss {r['final_loss']:.6f}")
    print(f"speed-up with {a.ranks} ranks: {many['tokens_per_s'] / one['tokens_per_s']:.2f}x")
    report_allreduce(a)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def report_allreduce(a) -> None:
    ar = allreduce_side(a.ranks, a.repeat, a.engine)
    backend = "NCCL" if a.engine == "torch-cuda" else "gloo"
    print(f"all-reduce of the Qwen2.5-0.5B-shape LoRA (rank 16, q/k/v/o: {ar['params'] / 1e6:.2f}M params, {ar['mb']:.1f} MB float32) "
          f"on {a.ranks} {backend} ranks: median {ar['median_s'] * 1000:.1f} ms a step (min {ar['min_s'] * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
