#!/usr/bin/env bash
# The README's demo: tune the built-in tiny model on the example task and show the loss fall.
set -euo pipefail
cd "$(dirname "$0")/.."
export SPILLPACK_HOME="${SPILLPACK_HOME:-$PWD/out/demo-home}"
rm -rf out/demo && mkdir -p out/demo

spillpack doctor
echo
echo "== tune tiny on examples/data/train.jsonl (loss should fall from ~8.5 to near 0)"
spillpack tune tiny examples/data/train.jsonl --name demo --state out/demo/state --out out/demo/adapter \
    --epochs 8 --lr 2e-3 --warmup 20 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
    --headless > out/demo/tune.jsonl
python3 - <<'PY'
import json
events = [json.loads(l) for l in open("out/demo/tune.jsonl")]
steps = [e for e in events if e["event"] == "step"]
for e in steps[:: max(1, len(steps) // 8)] + steps[-1:]:
    print(f"  step {e['step']:4d}  loss {e['loss']:.4f}")
done = events[-1]
print(f"done: {done['steps']} steps in {done['seconds']:.1f}s, loss {done['first_loss']:.3f} -> {done['final_loss']:.4f}; adapter in out/demo/adapter")
PY

echo
echo "== pack the same job into one directory, then run it from somewhere else like a cluster node would"
spillpack tune tiny examples/data/train.jsonl --name demo-packed --epochs 1 --lr 2e-3 --warmup 20 --ckpt-every 10 \
    --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --emit-config out/demo/tune.json
spillpack pack out/demo/tune.json -o out/demo/bundle
rm -rf out/demo/node && mkdir -p out/demo/node && cp -r out/demo/bundle out/demo/node/bundle
node="$PWD/out/demo/node"
# A clean environment, as on another machine: only PATH (with a python3 that has torch), HOME and SPILLPACK_HOME;
# started from / to show the bundle does not care where it is started from. No subshell: $! is the job itself.
node_env="PATH=$PATH HOME=$node SPILLPACK_HOME=$node/home"

echo
echo "== run it; a scheduler takes the machine away (SIGTERM) after the first checkpoint"
cd /
env -i $node_env "$node/bundle/run.sh" > "$node/run1.jsonl" 2>"$node/run1.err" &
pid=$!
cd "$OLDPWD"
until grep -q '"event":"checkpoint"' "$node/run1.jsonl" 2>/dev/null; do sleep 0.5; done
kill -TERM "$pid"
set +e; wait "$pid"; code=$?; set -e
python3 - "$node/run1.jsonl" "$code" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
last_ckpt = [e for e in ev if e["event"] == "checkpoint"][-1]
print(f"  exit {sys.argv[2]} (75 = preempted); checkpoint committed at step {last_ckpt['step']} in {last_ckpt['seconds']}s")
PY

echo
echo "== the same command again continues where it stopped"
(cd / && env -i $node_env "$node/bundle/run.sh" > "$node/run2.jsonl" 2>"$node/run2.err")
python3 - "$node/run2.jsonl" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
restore = next(e for e in ev if e["event"] == "restore")
done = ev[-1]
print(f"  restored at step {restore['step']}, finished {done['steps']} steps: loss {done['first_loss']:.3f} -> {done['final_loss']:.4f}")
print(f"  adapter: {done['adapter']}")
PY
