#!/bin/sh
# kill -9 during training with a checkpoint after every step: whatever moment the kill
# lands (often inside a checkpoint write), resuming from the checkpoint directory must
# pick the latest complete checkpoint and train on; a half-written one is never loaded.
# Also builds an indexed dataset with build_dataset and trains one step on it.
set -u
TRAIN="$1"
BUILD_DATASET="$2"
CONFIG="$3"
CORPUS="$4"
OUT="${TEST_TMPDIR:-/tmp}/crash_resume"
rm -rf "$OUT"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }

for delay in 0.7 1.1 1.6 2.2 4.0; do
  dir="$OUT/run_$delay"
  "$TRAIN" --config="$CONFIG" --set=train.steps=200 --set=train.checkpoint_every=1 \
    --set=train.checkpoint_dir="$dir/ckpt" > "$dir.log" 2>&1 &
  pid=$!
  sleep "$delay"
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  if ! ls "$dir/ckpt" 2>/dev/null | grep -q '^step_'; then
    echo "delay $delay: killed before the first checkpoint; nothing to resume"
    continue
  fi
  "$TRAIN" --config="$CONFIG" --set=train.steps=200 --set=train.checkpoint_dir="$dir/ckpt2" \
    --set=train.checkpoint_every=1000 --resume="$dir/ckpt" > "$dir.resume.log" 2>&1 &
  rpid=$!
  # Wait for the resume line (not a fixed sleep: on a loaded machine start-up can take
  # seconds), then stop the run.
  for _ in $(seq 600); do
    grep -q "^resumed from" "$dir.resume.log" 2>/dev/null && break
    kill -0 "$rpid" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$rpid" 2>/dev/null
  wait "$rpid" 2>/dev/null
  grep -q "^resumed from .* at step [0-9]" "$dir.resume.log" ||
    fail "delay $delay: resume did not start: $(cat "$dir.resume.log")"
  echo "delay $delay: $(grep '^resumed' "$dir.resume.log")"
done
ls "$OUT"/run_*/ckpt 2>/dev/null | grep -q step_ || fail "no run reached a checkpoint"

"$BUILD_DATASET" --input="$CORPUS" --output="$OUT/corpus" > "$OUT/build.log" 2>&1 ||
  fail "build_dataset: $(cat "$OUT/build.log")"
grep -q "^wrote .*: [0-9]* documents, [0-9]* tokens$" "$OUT/build.log" || fail "$(cat "$OUT/build.log")"
"$TRAIN" --config="$CONFIG" --set=train.steps=1 --set=data.source=indexed \
  --set=data.prefix="$OUT/corpus" > "$OUT/indexed.log" 2>&1 || fail "indexed training: $(cat "$OUT/indexed.log")"
grep -q "^step 1/1 loss " "$OUT/indexed.log" || fail "$(cat "$OUT/indexed.log")"
"$BUILD_DATASET" --input="$OUT/nope.txt" --output="$OUT/x" > "$OUT/bad.log" 2>&1
[ $? -eq 2 ] || fail "missing input must exit 2"
[ "$(wc -l < "$OUT/bad.log")" -eq 1 ] || fail "expected one error line: $(cat "$OUT/bad.log")"
echo "PASS"
