#!/usr/bin/env bash
# Data-parallel throughput scaling on one host: the CUDA trainer at DP=1 and DP=2 with the
# same per-GPU work (train.grad_accum microbatches per rank per step), through
# tools/launch.sh; prints each run's median tokens/s over the steps after the first
# (rank 0's progress lines count all ranks' tokens) and the DP=2 / DP=1 ratio.
#   TRAIN=path/to/train_cuda LAUNCH=path/to/launch.sh dp_scaling.sh CONFIG STEPS [--set=...]
set -uo pipefail
train=${TRAIN:-bazel-bin/tools/train_cuda}
launch=${LAUNCH:-tools/launch.sh}
if [ $# -lt 2 ]; then
  echo "usage: $0 CONFIG STEPS [--set=key=value ...]" >&2
  exit 2
fi
config=$1 steps=$2
shift 2
median_tokens_per_s() {  # from the launch log on stdin
  grep '^\[rank 0\] step ' | tail -n +2 | sed -E 's/.* tokens\/s ([0-9]+).*/\1/' | sort -n |
    awk '{ v[NR] = $1 } END { if (NR == 0) print 0; else print v[int((NR + 1) / 2)] }'
}
declare -A tps
for n in 1 2; do
  log=$(mktemp)
  metrics=$(mktemp)
  if ! "$launch" "$n" "$train" --config="$config" --set=train.device=cuda \
    --set=train.steps="$steps" --set=train.log_every=1 --set=train.metrics_path="$metrics" \
    "$@" > "$log" 2>&1; then
    echo "DP=$n failed:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  tps[$n]=$(median_tokens_per_s < "$log")
  grep '^\[rank 0\] step ' "$log" | tail -n 2
  echo "DP=$n median tokens/s (steps 2..$steps): ${tps[$n]}"
  # Where rank 0's step time went (Note [Host-bound steps] in gdr/trainer.cc).
  python3 - "$metrics" "$n" <<'PY' || true
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][1:]
med = lambda k: statistics.median(r.get(k, 0) for r in rows) if rows else 0
print(f"DP={sys.argv[2]} rank 0 medians (steps 2..): step_time_s {med('step_time_s'):.4f} "
      f"host_queue_s {med('host_queue_s'):.4f} gpu_wait_s {med('gpu_wait_s'):.4f} "
      f"reduce_time_s {med('reduce_time_s'):.4f}")
PY
  rm -f "$log" "$metrics"
done
echo "DP=2 / DP=1 tokens/s: $(awk -v a="${tps[1]}" -v b="${tps[2]}" 'BEGIN { printf "%.3f", b / a }')"
