#!/usr/bin/env bash
# Paired step timing: runs two arms of bench/step_timing as alternating fresh processes
# (A, B, A, B, ...) so drift in clocks or load hits both arms alike, then prints each
# pair's B/A ratio of median step time and the median ratio.
#   STEP_TIMING=path/to/step_timing  bench/step_timing_paired.sh PAIRS "ARGS_A" "ARGS_B" COMMON_ARGS...
# STEP_TIMING_B=path/to/another/step_timing runs arm B with that binary (e.g. a tree before
# and after a change; ARGS_A and ARGS_B may then be "").
# e.g. ... 3 "--set=model.deterministic_mode=false" "--set=model.deterministic_mode=true" \
#          --config=configs/train_qwen0p8b.yaml --warmup=5 --steps=50
set -uo pipefail
bin=${STEP_TIMING:-bazel-bin/bench/step_timing}
bin_b=${STEP_TIMING_B:-$bin}
if [ $# -lt 3 ]; then
  echo "usage: $0 PAIRS \"ARGS_A\" \"ARGS_B\" COMMON_ARGS..." >&2
  exit 2
fi
pairs=$1 arm_a=$2 arm_b=$3
shift 3
ratios=()
for ((i = 1; i <= pairs; i++)); do
  # shellcheck disable=SC2086
  a=$("$bin" "$@" $arm_a | grep '^RESULT') || { echo "arm A failed in pair $i" >&2; exit 1; }
  # shellcheck disable=SC2086
  b=$("$bin_b" "$@" $arm_b | grep '^RESULT') || { echo "arm B failed in pair $i" >&2; exit 1; }
  echo "pair $i A: $a"
  echo "pair $i B: $b"
  ma=$(sed -E 's/.*median_step_s=([0-9.]+).*/\1/' <<<"$a")
  mb=$(sed -E 's/.*median_step_s=([0-9.]+).*/\1/' <<<"$b")
  ratio=$(awk -v a="$ma" -v b="$mb" 'BEGIN { printf "%.4f", b / a }')
  ratios+=("$ratio")
  echo "pair $i B/A median step time ratio: $ratio"
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
echo "median B/A ratio over $pairs pairs: $median"
