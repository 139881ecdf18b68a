#!/usr/bin/env bash
# torch-cuda's acceptance test on a CUDA machine: exit 0 only when every check passes
# (benchmarks/gpu_check.py says what each one holds the engine to), then the 2-GPU step
# (benchmarks/gpu_check_dist.sh, skipped with one GPU). Under 5 minutes on one GPU.
# Run from anywhere:  bash benchmarks/gpu_check.sh [--skip-figures] [--json FILE]
# Needs a Python with CUDA torch and spillpack's runtime dependencies (PYTHON=... to choose it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The whole check is bounded: a hang is a failure with its own message, not a stuck terminal.
timeout --kill-after=10 420 "$PY" benchmarks/gpu_check.py "$@" && rc=0 || rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "gpu_check: FAILED: timed out after 420 s (the checks above it passed; the next one hung)"
fi
bash benchmarks/gpu_check_dist.sh && dist=0 || dist=$?
if [ "$dist" != 0 ]; then echo "gpu_check: FAILED: the 2-GPU step exited $dist"; fi
[ "$rc" = 0 ] && [ "$dist" = 0 ]
