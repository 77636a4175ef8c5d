#!/usr/bin/env bash
# The state-equality protocol (shared design note determinism.md) in one command:
#   1. reference: N steps, a state snapshot after every step, a checkpoint at step K;
#   2. fresh-process re-run: every snapshot must be byte-identical;
#   3. resume from the step-K checkpoint: snapshots K+1..N must equal the reference;
#   4. a deliberately broken run (another seed) must be reported different;
#   5. optionally (NONDET=1) the same steps with deterministic_mode off, reported
#      (tensors that differ and by how much), not judged.
# Usage: tools/state_equality_check.sh CONFIG [--set=...]...
# Env: TRAIN, COMPARE (binaries; default bazel-bin/tools/{train,compare_snapshots}),
#      STEPS (3), RESUME_FROM (1), WORK (scratch dir, default /tmp/gdr-state-check),
#      ARM_WORK (where re-run/resume/broken snapshots go, default $WORK), CKPT_DIR
#      (reference checkpoints, default $WORK/checkpoints), NONDET (0).
# Each arm's snapshots are deleted after its comparison (0.8B snapshots are ~13 GB a step).
# Exit 0 when 2-4 hold, 1 when one fails, 2 on bad usage or missing evidence.
set -uo pipefail
if [ $# -lt 1 ] || [ "$1" = "--help" ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -lt 1 ] && exit 2 || exit 0
fi
config=$1
shift
train=${TRAIN:-bazel-bin/tools/train}
compare=${COMPARE:-bazel-bin/tools/compare_snapshots}
steps=${STEPS:-3}
resume_from=${RESUME_FROM:-1}
work=${WORK:-/tmp/gdr-state-check}
arm_work=${ARM_WORK:-$work}
ckpt_dir=${CKPT_DIR:-$work/checkpoints}
for b in "$train" "$compare"; do
  [ -x "$b" ] || { echo "state_equality_check: no executable $b (build it or set TRAIN/COMPARE)" >&2; exit 2; }
done
rm -rf "$work" "$arm_work/arms" "$ckpt_dir"
mkdir -p "$work" "$arm_work/arms"
failures=0

run() {  # run NAME SNAPSHOT_DIR [ARGS...]
  local name=$1 snap=$2
  shift 2
  echo "--- $name"
  local start=$(date +%s)
  "$train" --config="$config" --set=train.snapshot_dir="$snap" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$work/$name.log"
  echo "($name: exit $rc, $(( $(date +%s) - start )) s)"
  return $rc
}

judge() {  # judge WANT DESCRIPTION DIR_A DIR_B
  local want=$1 what=$2
  "$compare" "$3" "$4" >"$work/compare.log" 2>&1
  local rc=$?
  tail -n 6 "$work/compare.log"
  if [ "$rc" -eq "$want" ]; then
    echo "OK: $what (compare exit $rc)"
  else
    echo "FAILED: $what (compare exit $rc, expected $want)"
    failures=$((failures + 1))
  fi
}

run reference "$work/reference" "$@" --set=train.steps="$steps" \
  --set=train.checkpoint_dir="$ckpt_dir" --set=train.checkpoint_every="$resume_from" ||
  { echo "reference run failed" >&2; exit 2; }

run rerun "$arm_work/arms/rerun" "$@" --set=train.steps="$steps" || exit 2
judge 0 "fresh-process re-run is byte-identical in every snapshot" "$work/reference" "$arm_work/arms/rerun"
rm -rf "$arm_work/arms/rerun"

run resume "$arm_work/arms/resume" "$@" --set=train.steps="$steps" \
  --resume="$ckpt_dir/step_$resume_from" || exit 2
for ((s = resume_from + 1; s <= steps; s++)); do
  judge 0 "resume from step $resume_from equals the reference at step $s" \
    "$work/reference/step_$s" "$arm_work/arms/resume/step_$s"
done
rm -rf "$arm_work/arms/resume"

run broken "$arm_work/arms/broken" "$@" --set=train.steps=1 --set=train.seed=424242 || exit 2
judge 1 "a run with another seed is reported different" "$work/reference/step_1" "$arm_work/arms/broken/step_1"
rm -rf "$arm_work/arms/broken"

if [ "${NONDET:-0}" = "1" ]; then
  run nondeterministic "$arm_work/arms/nondet" "$@" --set=train.steps="$steps" \
    --set=model.deterministic_mode=false || exit 2
  echo "deterministic_mode off vs reference (reported, not judged):"
  "$compare" "$work/reference" "$arm_work/arms/nondet" 2>&1 | tail -n 40
  rm -rf "$arm_work/arms/nondet"
fi

echo "state_equality_check: $failures failed check(s)"
[ "$failures" -eq 0 ]
