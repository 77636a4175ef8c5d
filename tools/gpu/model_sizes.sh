#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu.tar.xz (tools/gpu/make_bundle.sh)
# carried: the 0.8B, 2B and 4B configs' deterministic BF16 step at seq 2048 (4 x 2048 tokens
# per optimizer step, CUDA graphs), each in a fresh process: tokens/s and peak allocated and
# reserved CUDA memory (bench/step_timing), or the error that stopped it (out of memory).
#   SIZES="0p8b 2b 4b" (default), STEPS=10, WARMUP=3; results in $OUT/model_sizes.txt.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -d .gpu ] || python3 -c "import tarfile; tarfile.open('.gpu.tar.xz').extractall('.')"
G=$PWD/.gpu
TORCH_LIB=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TORCH_LIB:$G/lib
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/model_sizes.txt"
for size in ${SIZES:-0p8b 2b 4b}; do
  log=$OUT/model_size_$size.log
  (cd "$G/bench/step_timing" && ./step_timing --config="configs/train_qwen$size.yaml" \
    --warmup="${WARMUP:-3}" --steps="${STEPS:-10}") >"$log" 2>&1
  rc=$?
  echo "$size: exit $rc: $(grep -E 'tokens_per_s=|error' "$log" | tail -1)" | tee -a "$OUT/model_sizes.txt"
done
