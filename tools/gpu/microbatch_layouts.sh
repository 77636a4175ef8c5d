#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu.tar.xz (tools/gpu/make_bundle.sh)
# carried: one 8192-token optimizer step of the 0.8B config (seq 2048, deterministic, CUDA
# graphs) laid out as grad_accum x micro_batch_size = 4 x 1, 2 x 2 and 1 x 4, each in a fresh
# process: tokens/s and peak allocated / reserved memory (bench/step_timing), or the error.
#   CONFIG (configs/train_qwen0p8b.yaml), LAYOUTS ("4x1 2x2 1x4"), STEPS=10, WARMUP=3;
#   results in $OUT/microbatch_layouts.txt.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bundle_env.sh"
CONFIG=${CONFIG:-configs/train_qwen0p8b.yaml}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/microbatch_layouts.txt"
for layout in ${LAYOUTS:-4x1 2x2 1x4}; do
  accum=${layout%x*} micro=${layout#*x}
  step_timing_row "grad_accum $accum x micro_batch_size $micro" "$OUT/microbatch_layouts.txt" \
    "$OUT/microbatch_layout_$layout.log" --config="$CONFIG" --set=train.grad_accum="$accum" \
    --set=data.micro_batch_size="$micro"
done
