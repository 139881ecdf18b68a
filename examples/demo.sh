#!/usr/bin/env bash
# The README's demo, the whole story: write a tune job for the built-in tiny model, pack it into
# one directory, run that directory elsewhere, take the machine away with SIGTERM, run it again,
# and see that it finished where it stopped and that the model learned the task.
set -euo pipefail
cd "$(dirname "$0")/.."
export SPILLPACK_HOME="${SPILLPACK_HOME:-$PWD/out/demo-home}"
rm -rf out/demo && mkdir -p out/demo
repo=$PWD

human=(env SPILLPACK_HEADLESS=0)  # what a person reads, even when this script's output is piped
"${human[@]}" spillpack doctor --no-measure
echo
echo "== 1. write the job down: LoRA on tiny, 8 epochs of the example task (200 reviews, positive/negative)"
"${human[@]}" spillpack tune tiny examples/data/train.jsonl --name demo --epochs 8 --lr 2e-3 --warmup 20 --ckpt-every 50 \
    --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --emit-config out/demo/tune.json

echo
echo "== 2. pack it into one directory, and copy that to a 'node'"
"${human[@]}" spillpack pack out/demo/tune.json -o out/demo/bundle
node="$repo/out/demo/node"
mkdir -p "$node" && cp -r out/demo/bundle "$node/bundle"
# A clean environment, as on another machine: PATH (with a python3 that has torch), HOME and
# SPILLPACK_HOME only, started from / to show the bundle does not care where it starts.
node_env="PATH=$PATH HOME=$node SPILLPACK_HOME=$node/home"

echo
echo "== 3. run it there; the scheduler takes the machine away (SIGTERM) after the first checkpoint"
cd /
env -i $node_env "$node/bundle/run.sh" > "$node/run1.jsonl" 2> "$node/run1.err" &
pid=$!
cd "$repo"
until grep -q '"event":"checkpoint"' "$node/run1.jsonl" 2>/dev/null; do
  kill -0 "$pid" 2>/dev/null || { cat "$node/run1.err"; exit 1; }
  sleep 0.2
done
kill -TERM "$pid"
set +e; wait "$pid"; code=$?; set -e
python3 - "$node/run1.jsonl" "$code" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
pre = next(e for e in ev if e["event"] == "preempted")
ck = [e for e in ev if e["event"] == "checkpoint"][-1]
print(f"   exit {sys.argv[2]} (75 = preempted): checkpoint at step {ck['step']} committed in {ck['seconds']:.3f}s")
PY

echo
echo "== 4. the same command again (on any machine) continues at that step"
(cd / && env -i $node_env "$node/bundle/run.sh" > "$node/run2.jsonl" 2> "$node/run2.err")
python3 - "$node/run1.jsonl" "$node/run2.jsonl" <<'PY'
import json, sys
first = [json.loads(l) for l in open(sys.argv[1])]
second = [json.loads(l) for l in open(sys.argv[2])]
restore = next(e for e in second if e["event"] == "restore")
steps = [e for e in first + second if e["event"] == "step"]
for e in steps[:: max(1, len(steps) // 6)] + steps[-1:]:
    print(f"   step {e['step']:4d}  loss {e['loss']:.4f}")
done = second[-1]
print(f"   restored at step {restore['step']}; finished {done['steps']} steps, loss {done['first_loss']:.3f} -> {done['final_loss']:.4f}")
print(f"   adapter: {done['adapter']}")
PY

echo
echo "== 5. did it learn? accuracy on 60 held-out reviews, before and after"
adapter="$node/home/jobs/demo/adapter"
for label in before after; do
  extra=(); [ "$label" = after ] && extra=(--adapter "$adapter")
  spillpack eval tiny examples/data/evals.jsonl --name "demo-eval-$label" --state "out/demo/eval-$label" "${extra[@]}" \
      --headless > "out/demo/eval-$label.jsonl" 2> /dev/null
  python3 -c "import json,sys; d=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f'   {sys.argv[2]:<6} accuracy {d[\"accuracy\"]:.2f}  95% [{d[\"ci95\"][0]:.2f}, {d[\"ci95\"][1]:.2f}]')" \
      "out/demo/eval-$label.jsonl" "$label"
done
echo
echo "spillpack status $node/home/jobs/demo   # the job's story: processes, checkpoints, the interruption"
"${human[@]}" spillpack status "$node/home/jobs/demo"
