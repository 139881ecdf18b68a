#!/usr/bin/env bash
# The 2-GPU step of the GPU check (benchmarks/gpu_check.sh calls it): a data-parallel tune on
# 2 GPUs (NCCL) against one GPU, SIGTERM to the group and a resume on one GPU, and the NCCL
# all-reduce of a Qwen2.5-0.5B-shape LoRA per step. Skipped, saying so, with fewer than 2 GPUs.
# ENGINE=torch-cpu runs the same steps on gloo (a dry run on a machine without GPUs).
# SHARD=on runs the 2-rank tunes with --shard-base on (the base split across the ranks, FSDP2),
# still held to the one-process run, and the cut one resumed unsharded; no all-reduce timing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ENGINE=${ENGINE:-torch-cuda}
SHARD=${SHARD:-off}
export PYTHONPATH=$PWD SPILLPACK_HEADLESS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export SPILLPACK_HOME=${SPILLPACK_HOME:-$(mktemp -d)/home}
mkdir -p "$SPILLPACK_HOME"
if [ "$ENGINE" = torch-cuda ]; then
  n=$($PY -c 'import torch; print(torch.cuda.device_count())')
  if [ "$n" -lt 2 ]; then echo "== 2-GPU data-parallel tune: skipped ($n CUDA device(s) here, needs 2)"; exit 0; fi
fi
echo "== data-parallel tune on $ENGINE, --shard-base $SHARD: 1 process against --nproc 2, then SIGTERM to the group and a resume as 1"
W=$SPILLPACK_HOME/dist-shard-$SHARD
ARGS=(tune tiny examples/data/train.jsonl --steps 30 --batch 4 --grad-accum 2 --lr 2e-3 --warmup 5
      --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --ckpt-every 5 --engine "$ENGINE")
timeout 120 $PY -m spillpack "${ARGS[@]}" --state "$W/one" > "$W-one.jsonl"
timeout 180 $PY -m spillpack "${ARGS[@]}" --state "$W/two" --nproc 2 --shard-base "$SHARD" > "$W-two.jsonl"
# SIGTERM to the launcher once step 10 is out: every rank stops at one step, exit 75.
set +e
timeout 180 $PY - "$W" "${ARGS[@]}" --shard-base "$SHARD" <<'PYEOF'
import json, signal, subprocess, sys
w, args = sys.argv[1], sys.argv[2:]
p = subprocess.Popen([sys.executable, "-m", "spillpack", *args, "--state", f"{w}/cut", "--nproc", "2"], stdout=subprocess.PIPE, text=True)
for line in p.stdout:
    e = json.loads(line)
    if e["event"] == "step" and e["step"] == 10:
        p.send_signal(signal.SIGTERM)
rc = p.wait()
print(f"  SIGTERM to the 2-rank group at step 10: exit {rc}")
sys.exit(0 if rc == 75 else 1)
PYEOF
rc=$?
set -e
[ "$rc" = 0 ] || { echo "gpu_check_dist: FAILED: the group did not exit 75"; exit 1; }
timeout 120 $PY -m spillpack "${ARGS[@]}" --state "$W/cut" > "$W-cut.jsonl"
$PY - "$W" <<'PYEOF'
import json, sys
import numpy as np
from safetensors.numpy import load_file
w = sys.argv[1]
def losses(s): return [json.loads(l)["loss"] for l in open(f"{w}/{s}/adapter/train_log.jsonl")]
def adapter(s): return load_file(f"{w}/{s}/adapter/adapter_model.safetensors")
one = losses("one")
for s, what in (("two", "2 ranks"), ("cut", "2 ranks, SIGTERM, resumed as 1")):
    d = max(abs(a - b) for a, b in zip(one, losses(s)))
    t = max(float(np.abs(adapter(s)[k] - adapter("one")[k]).max()) for k in adapter("one"))
    # float32 on CPU: the order of additions only (1e-5); a bf16 base on CUDA adds its rounding.
    print(f"  {what}: max |loss - one process| {d:.3g}, max |adapter - one process| {t:.3g}")
    if d > 5e-3:
        sys.exit(f"gpu_check_dist: FAILED: {what} drifted {d:.3g} from one process")
steps = {s: [json.loads(l) for l in open(f"{w}-{s}.jsonl") if '"step"' in l] for s in ("one", "two")}
for s, what in (("one", "1 process"), ("two", "2 ranks")):
    st = [e for e in steps[s] if e["event"] == "step"][1:]
    print(f"  {what}: {sum(e['tokens_per_s'] * e['step_s'] for e in st) / sum(e['step_s'] for e in st):.0f} tokens/s")
PYEOF
if [ "$SHARD" = on ]; then
  grep -q '"shard_base":true' "$W-two.jsonl" || { echo "gpu_check_dist: FAILED: the --shard-base on run did not split the base"; exit 1; }
  exit 0
fi
echo "== all-reduce of a Qwen2.5-0.5B-shape LoRA (rank 16, q/k/v/o) on 2 ranks ($ENGINE)"
timeout 120 $PY benchmarks/bench_dist.py --allreduce-only --engine "$ENGINE"
