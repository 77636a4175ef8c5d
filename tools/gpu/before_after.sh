#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu.tar.xz (tools/gpu/make_bundle.sh,
# this tree) and .gpu_reference.tar.xz (tools/gpu/make_reference_bundle.sh REV) carried:
#   tests   every single-GPU test of this tree's bundle
#   state   the 0.8B config trained 2 steps by the reference and by this tree, snapshots in
#           RAM; step 2's snapshots compared byte for byte (compare_snapshots: exit 0 equal)
#   timing  paired step timing, reference (A) against this tree (B), alternating fresh
#           processes (bench/step_timing_paired.sh with STEP_TIMING_B)
#   PART="tests state timing" (default: all three; a 10-minute device call fits two of them)
# Logs and results under $OUT (default ./gpu-out).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bundle_env.sh"
[ -d .gpu_reference ] || python3 -c "import tarfile; tarfile.open('.gpu_reference.tar.xz').extractall('.')"
R=$PWD/.gpu_reference
CONFIG=${CONFIG:-configs/train_qwen0p8b.yaml}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "reference: $(cat "$R/REVISION")" | tee -a "$OUT/gpu.txt"
part=${PART:-tests state timing}
if [[ " $part " == *" tests "* ]]; then
  single=$(ls "$G/tests" | grep -v '^distributed_gpu_test$' | tr '\n' ' ')
  BENCH=0 TESTS="$single" bash "$G/run_all.sh" 2>&1 | tail -30
fi
if [[ " $part " == *" state "* ]]; then
  rm -rf /dev/shm/gdr_reference /dev/shm/gdr_tree
  for arm in reference tree; do
    if [ "$arm" = reference ]; then dir=$R/train_cuda; else dir=$G/tools/train_cuda; fi
    start=$(date +%s)
    (cd "$dir" && ./train_cuda --config="$CONFIG" --set=train.steps=2 \
      --set=train.snapshot_dir=/dev/shm/gdr_$arm/snap) >"$OUT/state_$arm.log" 2>&1
    echo "$arm: exit $? in $(($(date +%s) - start)) s"
    tail -3 "$OUT/state_$arm.log"
    rm -rf "/dev/shm/gdr_$arm/snap/step_1"  # one 0.8B snapshot is 12.8 GB: keep step 2 only
  done
  "$G/tools/compare_snapshots/compare_snapshots" /dev/shm/gdr_reference/snap /dev/shm/gdr_tree/snap \
    >"$OUT/state_compare.txt" 2>&1
  echo "compare_snapshots reference tree: exit $?"
  tail -5 "$OUT/state_compare.txt"
  rm -rf /dev/shm/gdr_reference /dev/shm/gdr_tree
fi
if [[ " $part " == *" timing "* ]]; then
  (cd "$G/bench/step_timing" && STEP_TIMING=$R/step_timing/step_timing STEP_TIMING_B=./step_timing \
    bash "$G/step_timing_paired.sh" "${PAIRS:-2}" "" "" --config="$CONFIG" --warmup=5 --steps=20) \
    2>&1 | tee "$OUT/timing.txt" | tail -8
fi
