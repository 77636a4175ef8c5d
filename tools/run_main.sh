#!/usr/bin/env bash
# The main job: set-up, then train the tiny Qwen3.5 model on the embedded corpus with
# configs/train_tiny.yaml (on CUDA when a GPU is visible, else on the CPU). Extra
# arguments go to the trainer (e.g. --set=train.steps=100).
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"
bash tools/setup.sh
device=cpu
target=//tools:train  # links the CPU libtorch only, so it runs where CUDA's libraries are absent
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=cuda
  target=//tools:train_cuda
fi
exec bazel run "$target" -- --config="$repo_root/configs/train_tiny.yaml" \
  --set=train.device="$device" "$@"
