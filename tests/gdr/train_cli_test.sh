#!/bin/sh
# The train and compare_snapshots binaries end to end, in fresh processes:
#   1. two independent 3-step runs write byte-identical snapshots (exit 0);
#   2. a run resumed from the step-1 checkpoint reproduces steps 2 and 3 (exit 0);
#   3. a run with another seed is reported as different (exit 1): the checker can fail;
#   4. a missing snapshot directory is missing evidence (exit 2);
#   5. bad input: unknown flag, bad --set, corrupted checkpoint -> one error line, exit 2;
#      token ids beyond model.vocab_size (found in step 1, after the run header) -> one
#      error line, exit 1; an invalid GDR_* variable -> one error line naming it, exit 2;
#   6. --help works for both binaries;
#   7. --eval_only from a checkpoint prints the run's own evaluation at that step, and
#      without a validation set is one error line, exit 2.
set -u
TRAIN="$1"
COMPARE="$2"
CONFIG="$3"
OUT="${TEST_TMPDIR:-/tmp}/train_cli"
rm -rf "$OUT"
export OMP_NUM_THREADS=1  # see TRAIN_TEST_ENV in tests/gdr/BUILD

fail() { echo "FAIL: $*"; exit 1; }

expect_rc() {  # expect_rc WANT DESCRIPTION CMD...
  want="$1"; what="$2"; shift 2
  "$@" > "$OUT/last.log" 2>&1
  rc=$?
  [ "$rc" -eq "$want" ] || { cat "$OUT/last.log"; fail "$what: exit $rc, expected $want"; }
}

mkdir -p "$OUT"
run() {  # run NAME [ARGS...]
  name="$1"; shift
  expect_rc 0 "train $name" "$TRAIN" --config="$CONFIG" --set=train.steps=3 \
    --set=train.snapshot_dir="$OUT/$name/snap" --set=train.checkpoint_dir="$OUT/$name/ckpt" \
    --set=train.checkpoint_every=1 --set=train.metrics_path="$OUT/$name/metrics.jsonl" "$@"
}

run a
grep -q "^step 3/3 loss " "$OUT/last.log" || fail "no progress line: $(cat "$OUT/last.log")"
[ "$(wc -l < "$OUT/a/metrics.jsonl")" -eq 3 ] || fail "metrics.jsonl should have 3 lines"
run b
expect_rc 0 "fresh-process rerun equal" "$COMPARE" "$OUT/a/snap" "$OUT/b/snap"

run resumed --resume="$OUT/a/ckpt/step_1"
for s in 2 3; do
  expect_rc 0 "resumed step $s equal" "$COMPARE" "$OUT/a/snap/step_$s" "$OUT/resumed/snap/step_$s"
done

run other_seed --set=train.seed=99
expect_rc 1 "other seed differs" "$COMPARE" "$OUT/a/snap" "$OUT/other_seed/snap"
expect_rc 2 "missing evidence" "$COMPARE" "$OUT/a/snap" "$OUT/nope"

# --eval_only from a checkpoint reports what the run's own evaluation after that step did.
run evaluated --set=data.valid_fraction=0.1 --set=train.eval_every=3 --set=train.eval_batches=2
in_run=$(grep "^eval step 3 loss " "$OUT/last.log" | head -1 | sed 's/ tokens, .*//')
[ -n "$in_run" ] || fail "no eval line in the run: $(cat "$OUT/last.log")"
expect_rc 0 "eval only" "$TRAIN" --config="$CONFIG" --set=data.valid_fraction=0.1 \
  --set=train.eval_every=3 --set=train.eval_batches=2 --resume="$OUT/evaluated/ckpt" --eval_only
[ "$(grep "^eval step 3 loss " "$OUT/last.log" | sed 's/ tokens, .*//')" = "$in_run" ] ||
  fail "eval_only: expected '$in_run' but got: $(cat "$OUT/last.log")"
grep -q "^step " "$OUT/last.log" && fail "eval_only trained: $(cat "$OUT/last.log")"
expect_rc 2 "eval only without a validation set" "$TRAIN" --config="$CONFIG" --eval_only
grep -q "^train: error: evaluate: the run has no validation set" "$OUT/last.log" ||
  fail "expected the no-validation-set error: $(cat "$OUT/last.log")"

expect_rc 2 "unknown flag" "$TRAIN" --config="$CONFIG" --bogus
grep -q "^train: error: unknown argument '--bogus' (see --help)$" "$OUT/last.log" || fail "$(cat "$OUT/last.log")"
expect_rc 2 "bad --set" "$TRAIN" --config="$CONFIG" --set=train.stepz=1
grep -q "^train: error: --set train.stepz=1: train.stepz: unknown key$" "$OUT/last.log" || fail "$(cat "$OUT/last.log")"
printf 'x' | dd of="$OUT/a/ckpt/step_2/model.safetensors" bs=1 seek=100 conv=notrunc 2>/dev/null
expect_rc 2 "corrupted checkpoint" "$TRAIN" --config="$CONFIG" --resume="$OUT/a/ckpt/step_2"
grep -q "checksum mismatch" "$OUT/last.log" || fail "$(cat "$OUT/last.log")"
[ "$(wc -l < "$OUT/last.log")" -eq 1 ] || fail "expected one error line: $(cat "$OUT/last.log")"

expect_rc 1 "token ids beyond the vocabulary" "$TRAIN" --config="$CONFIG" --set=train.steps=1 \
  --set=model.vocab_size=100
grep -q "^train: error: step 1: token id [0-9]* at position [0-9]* of microbatch 1 is outside the vocabulary \[0, 100) of model.vocab_size; check that the data (.*) was tokenized for this model$" "$OUT/last.log" || fail "$(cat "$OUT/last.log")"
# Found during step 1, so the run header and the execution policy (the first two lines of
# every run) precede it.
[ "$(wc -l < "$OUT/last.log")" -eq 3 ] && head -n 1 "$OUT/last.log" | grep -q "^run: " &&
  sed -n 2p "$OUT/last.log" | grep -q "^execution policy: deterministic=" ||
  fail "expected the run header, the policy line and one error line: $(cat "$OUT/last.log")"

expect_rc 2 "an invalid GDR_* variable" env GDR_RMS_NORM=fast "$TRAIN" --config="$CONFIG" \
  --set=train.steps=1
grep -q "^train: error: GDR_RMS_NORM: expected fused or composite, but got 'fast'$" "$OUT/last.log" ||
  fail "$(cat "$OUT/last.log")"
[ "$(wc -l < "$OUT/last.log")" -eq 1 ] || fail "expected one error line: $(cat "$OUT/last.log")"

expect_rc 0 "train --help" "$TRAIN" --help
grep -q "^usage: train" "$OUT/last.log" || fail "train --help"
expect_rc 0 "compare --help" "$COMPARE" --help
grep -q "^usage: compare_snapshots" "$OUT/last.log" || fail "compare --help"
echo PASS
