#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu.tar.xz (tools/gpu/make_bundle.sh)
# carried: the 0.8B, 2B and 4B configs' deterministic BF16 step at seq 2048 (4 x 2048 tokens
# per optimizer step, CUDA graphs), each in a fresh process: tokens/s and peak allocated and
# reserved CUDA memory (bench/step_timing), or the error that stopped it (out of memory).
#   SIZES="0p8b 2b 4b" (default), STEPS=10, WARMUP=3; results in $OUT/model_sizes.txt.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bundle_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/model_sizes.txt"
for size in ${SIZES:-0p8b 2b 4b}; do
  step_timing_row "$size" "$OUT/model_sizes.txt" "$OUT/model_size_$size.log" \
    --config="configs/train_qwen$size.yaml"
done
