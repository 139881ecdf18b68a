"""`tune --shard-base` on this machine: each rank's resident base, its peak while loading, and its
peak over a few steps, measured from the process (RSS), with the base split across the ranks
against the whole base on each; and the planner's estimate of the step peak beside the measured.

    python benchmarks/bench_shard.py                          # SmolLM2-135M's shape, float32, 2 gloo ranks
    python benchmarks/bench_shard.py --shape qwen2.5-0.5b --ranks 2 --rows 2 --seq 256

Each case runs as `--ranks` processes under torchrun (one thread each), building the train
session a tune builds (TorchTrainSession, or ShardedTrainSession over the job's ProcessGroup)
on random weights of the shape (tests/support/memory_shapes.py), then running --steps steps of
--rows x --seq tokens through forward_backward, the gradient all-reduce and AdamW.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

WORKER = r'''
import json, math, resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np, psutil, torch
torch.set_num_threads(1)
from runtime.engines import OptimSpec
from runtime.engines.registry import get_engine, sharded_session
from runtime.engines.torch.distributed import ProcessGroup
from runtime.models.lora import LoraSpec, init_tensors
from runtime.models.memory import STEP_RUNTIME_GB, Batch, estimate
from runtime.models.ref import resolve_model
from runtime.models.weights import tensor_shapes, weight_files
model, shard, rows, seq, steps = sys.argv[2], sys.argv[3] == "on", int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rss = lambda: psutil.Process().memory_info().rss
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
md = resolve_model(model)
g = ProcessGroup("torch-cpu")
engine = get_engine("torch-cpu", "float32", width=md.config["hidden_size"], training=True)
spec = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"), dropout=0.0)
tensors = init_tensors(md.config, spec, 0)
import runtime.engines.torch.shard  # noqa: F401 (FSDP2's modules, imported in both cases: code, not the base)
held = rss()
before, peak_before = rss(), peak()
s = (sharded_session(engine, g, md, spec, tensors, OptimSpec(), 0) if shard else engine.train_session(md, spec, tensors, OptimSpec(), 0))
after, load_peak = rss(), peak()
rng = np.random.default_rng(g.rank)
for step in range(steps):
    ids = rng.integers(0, md.config["vocab_size"], size=(rows, seq)).astype(np.int64)
    labels = ids.copy(); labels[:, 0] = -100
    loss, tokens = s.forward_backward([(ids, labels, np.arange(rows))], rows * (seq - 1), step)
    g.sum_gradients(s, loss, tokens)
    s.apply(1e-4)
from runtime.base.heap import trim_heap
trim_heap()
between = rss()  # after the steps, the freed pages handed back: what a rank holds from one step to the next
params = sum(math.prod(x) for x in tensor_shapes(weight_files(md.path)).values())
plan = estimate(md.config, spec.targets, spec.rank, 4, Batch(rows, seq, rows * (seq - 1)), False, held / 2**30 + STEP_RUNTIME_GB,
                params, False, g.world if shard else 1)
print(json.dumps({"rank": g.rank, "resident_base": after - before, "between_steps": between - before, "before": before, "load_peak": max(0, load_peak - max(before, peak_before)),
                  "step_peak": peak(), "planned_peak": plan.peak_gb * 2**30, "planned_weights": plan.weights_gb * 2**30}), flush=True)
g.finish()
'''


def case(model: Path, shard: str, a) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks), f.name, str(REPO),
           str(model), shard, str(a.rows), str(a.seq), str(a.steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    os.unlink(f.name)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    return sorted((json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")), key=lambda x: x["rank"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    from tests.support.memory_shapes import make_shape

    model = make_shape(a.shape, Path(tempfile.gettempdir()) / "spillpack-bench-memory" / a.shape)
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    whole, split = case(model, "off", a), case(model, "on", a)
    print(f"{a.shape}, float32, {a.ranks} gloo ranks, {a.steps} steps of {a.rows} x {a.seq} tokens (file "
          f"{mib((model / 'model.safetensors').stat().st_size)})")
    for name, rows in (("whole base", whole), ("split base", split)):
        for r in rows:
            print(f"  {name}, rank {r['rank']}: resident base {mib(r['resident_base'])} (between steps {mib(r['between_steps'])}), "
                  f"load peak +{mib(r['load_peak'])}, process before the model {mib(r['before'])}, "
                  f"step peak RSS {mib(r['step_peak'])}, planned {mib(r['planned_peak'])} "
                  f"(planned/measured {r['planned_peak'] / r['step_peak']:.3f})")
    ratio = lambda key: max(s[key] for s in split) / min(w[key] for w in whole)
    print(f"split / whole, the worst rank: resident base {ratio('resident_base'):.3f}x (between steps "
          f"{ratio('between_steps'):.3f}x), load peak {ratio('load_peak'):.3f}x, "
          f"step peak {ratio('step_peak'):.3f}x")
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
