#!/usr/bin/env bash
# torch-cuda on a GPU machine, in under 3 minutes: doctor's rates, a short tune on torch-cuda
# against the same tune on torch-cpu, logits and greedy generation against torch-cpu, and the
# engine benchmark. Run from the repository root:  bash benchmarks/gpu_check.sh
# Needs a Python with CUDA torch and spillpack's runtime dependencies (PYTHON=... to choose it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD SPILLPACK_HOME=${SPILLPACK_HOME:-$(mktemp -d)/home} SPILLPACK_HEADLESS=1
mkdir -p "$SPILLPACK_HOME"
$PY -c 'import torch, safetensors, tokenizers, orjson, psutil, numpy, jinja2; assert torch.cuda.is_available(), "no CUDA"; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
T0=$SECONDS

echo "== doctor"
$PY -m spillpack doctor | $PY -c 'import json,sys; r=json.load(sys.stdin); [print(" ", k, v) for k, v in r["engines"].items()]; print("  chosen:", r["engine"], "-", r["engine_reason"])'

echo "== tune tiny, 30 steps, torch-cuda (auto) vs torch-cpu"
for e in auto torch-cpu; do
  timeout 100 $PY -m spillpack tune tiny examples/data/train.jsonl --steps 30 --batch 4 --lr 2e-3 --warmup 5 \
    --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --engine $e --state "$SPILLPACK_HOME/st-$e" \
    > "$SPILLPACK_HOME/tune-$e.jsonl"
done
$PY - "$SPILLPACK_HOME" <<'PYEOF'
import json, sys
home = sys.argv[1]
runs = {}
for e in ("auto", "torch-cpu"):
    ev = [json.loads(l) for l in open(f"{home}/tune-{e}.jsonl")]
    steps = [x for x in ev if x["event"] == "step"]
    runs[e] = steps
    tps = sorted(x["tokens_per_s"] for x in steps[3:])
    print(f"  {steps[0]['engine']:<10} loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, "
          f"median {tps[len(tps)//2]:.0f} tokens/s, peak {steps[-1]['peak_mem_gb']} GB")
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["auto"], runs["torch-cpu"]))
print(f"  max |loss difference| over 30 steps (bf16 base on CUDA vs float32 on CPU): {diff:.4g}")
PYEOF

echo "== logits and greedy generation: torch-cuda against torch-cpu on tiny"
$PY - <<'PYEOF'
import torch
from runtime.engines import get_engine
from runtime.generation import generate
from runtime.models.ref import resolve_model
from runtime.engines.torch.models import load_model
from runtime.models.tiny import ensure_tiny
from runtime.models.tokenizer import Tokenizer
md = resolve_model(str(ensure_tiny()))
ids = torch.randint(0, md.config["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = load_model(md)(ids)
    f32 = load_model(md, device="cuda")(ids.cuda()).cpu()
    bf = get_engine("torch-cuda").load_model(md)(ids.cuda()).float().cpu()
print(f"  float32 on CUDA: max |logit diff| {(f32 - ref).abs().max():.3g} (tests hold CPU engines to 1e-4)")
print(f"  engine's bf16 base: max |logit diff| {(bf - ref).abs().max():.3g}, logit range {ref.abs().max():.3g}")
tok = Tokenizer.from_dir(md.path)
prompts = [tok.encode_prompt([{"role": "user", "content": p}])
           for p in ("Great movie!", "Terrible plot.", "It was fine.", "I loved it", "Boring.", "A classic", "Meh", "Wow")]
cpu = [r.tokens for r in generate(load_model(md), tok, prompts, max_tokens=16, batch=4)]
gpu32 = [r.tokens for r in generate(load_model(md, device="cuda"), tok, prompts, max_tokens=16, batch=4)]
gen = get_engine("torch-cuda").generator(md, tok, slots=4, max_len=128)
from runtime.generation import Request
for i, p in enumerate(prompts):
    gen.add(Request(str(i), p, 16))
out = {}
while gen.active:
    out.update({r.key: r.tokens for r in gen.step()})
bf = [out[str(i)] for i in range(len(prompts))]
print(f"  greedy, float32 on CUDA: {sum(a == b for a, b in zip(cpu, gpu32))}/{len(cpu)} identical to torch-cpu")
print(f"  greedy, engine (bf16):   {sum(a == b for a, b in zip(cpu, bf))}/{len(cpu)} identical to torch-cpu")
PYEOF

echo "== engine benchmark"
timeout 60 $PY benchmarks/bench_engines.py --engines torch-cuda,torch-cpu --steps 3 2>/dev/null || echo "  (benchmark cut at 60 s)"
bash benchmarks/gpu_check_dist.sh
echo "== done in $((SECONDS - T0)) s"
