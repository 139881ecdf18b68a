#!/usr/bin/env bash
# torch-cuda's acceptance test on a CUDA machine: exit 0 only when every check passes
# (benchmarks/gpu_check.py says what each one holds the engine to), then the 2-GPU step
# (benchmarks/gpu_check_dist.sh, skipped with one GPU), then the same with the base split across
# the ranks (--shard-base on; on CPU ranks with one GPU). Under 7 minutes on one GPU.
# Run from anywhere:  bash benchmarks/gpu_check.sh [--skip-figures] [--json FILE]
# Needs a Python with CUDA torch and spillpack's runtime dependencies (PYTHON=... to choose it).
# In the spillpack:cuda image (docs/containers.md: `make image FLAVOR=cuda`), the GPU passed in:
#   podman run --rm --device nvidia.com/gpu=all -v "$PWD":/src -w /src --user 0 --entrypoint bash spillpack:cuda benchmarks/gpu_check.sh
#   docker run --rm --gpus all -v "$PWD":/src -w /src --user 0 --entrypoint bash spillpack:cuda benchmarks/gpu_check.sh
# (CDI needs `nvidia-ctk cdi generate`, docker the NVIDIA Container Toolkit). There it also proves the
# image: its torch CUDA build and CUDA wheels run on the host's driver and --engine auto picks torch-cuda
# inside the container. Without the device the image runs on the CPU (doctor: "no CUDA device is visible").
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
# The base split across the ranks (tune --shard-base on, FSDP2): on 2 GPUs over NCCL; with one
# GPU the same check on 2 CPU ranks over gloo, and the per-rank memory of benchmarks/bench_shard.py.
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then
  SHARD=on bash benchmarks/gpu_check_dist.sh && shard=0 || shard=$?
else
  echo "== --shard-base on: $gpus CUDA device(s) here, so on 2 CPU ranks (gloo) instead of NCCL"
  { ENGINE=torch-cpu SHARD=on bash benchmarks/gpu_check_dist.sh && timeout 300 "$PY" benchmarks/bench_shard.py; } && shard=0 || shard=$?
fi
if [ "$shard" != 0 ]; then echo "gpu_check: FAILED: the --shard-base step exited $shard"; fi
[ "$rc" = 0 ] && [ "$dist" = 0 ] && [ "$shard" = 0 ]
