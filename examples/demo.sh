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
