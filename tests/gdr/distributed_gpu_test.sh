#!/bin/bash
# Data parallelism on CUDA (NCCL, 2 GPUs of one host), the CUDA train binary end to end:
#   1. DP=2 through tools/launch.sh on the tiny model (bf16, deterministic mode): both ranks
#      end with the same losses, gradients, parameters and optimizer state;
#   2. a fresh DP=2 rerun is byte-identical, and so is a DP=2 run resumed from step 1, and
#      so is a run with train.overlap_grad_reduction;
#   3. DP=1 with grad_accum 4 and DP=2 with grad_accum 2 are byte-identical (Note [Gradient
#      reduction tree] in gdr/distributed.h);
#   4. a killed rank ends the other with an error in bounded time;
#   5. train.shard_optimizer_state (NCCL broadcasts, graphed microbatches) is byte-identical to
#      the replicated run, and its checkpoint resumes replicated identically.
# Needs two GPUs: with fewer it fails (a skipped test is not a pass).
# Arguments (Bazel passes them; the GPU bundle runs it with none, from its runfiles copy):
#   TRAIN COMPARE LAUNCH CONFIG
set -u
# The GPU bundle's runner passes every test --gtest_output=...; not ours.
while [[ "${1:-}" == --gtest* ]]; do shift; done
TRAIN="${1:-tools/train_cuda}"
COMPARE="${2:-tools/compare_snapshots}"
LAUNCH="${3:-tools/launch.sh}"
CONFIG="${4:-configs/train_tiny.yaml}"
OUT="${TEST_TMPDIR:-/tmp}/distributed_gpu"
rm -rf "$OUT"
mkdir -p "$OUT"
export GDR_DIST_TIMEOUT_S=20
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT

fail() { echo "FAIL: $*"; exit 1; }
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || fail "needs 2 GPUs, this machine has $gpus"

expect_rc() {  # expect_rc WANT DESCRIPTION CMD...
  want="$1"; what="$2"; shift 2
  "$@" > "$OUT/last.log" 2>&1
  rc=$?
  [ "$rc" -eq "$want" ] || { cat "$OUT/last.log"; fail "$what: exit $rc, expected $want"; }
}

COMMON=(--set=train.device=cuda --set=train.dtype=bf16 --set=data.seq_len=128
  --set=data.micro_batch_size=2 --set=train.steps=3)

run_dp() {  # run_dp N NAME [ARGS...]
  n="$1"; name="$2"; shift 2
  expect_rc 0 "DP=$n $name" "$LAUNCH" "$n" "$TRAIN" --config="$CONFIG" "${COMMON[@]}" \
    --set=train.snapshot_dir="$OUT/$name/snap" --set=train.checkpoint_dir="$OUT/$name/ckpt" \
    --set=train.metrics_path="$OUT/$name/metrics.jsonl" "$@"
  cp "$OUT/last.log" "$OUT/$name.log"
}

# 1. Both ranks compute the same steps.
run_dp 2 a --set=train.grad_accum=2 --set=train.checkpoint_every=1
grep -q "^\[rank 0\] step 3/3 loss " "$OUT/a.log" || fail "no rank-0 progress line: $(cat "$OUT/a.log")"
[ -d "$OUT/a/snap.rank1/step_3" ] || fail "no rank-1 snapshot"
expect_rc 0 "rank 0 and rank 1 equal" "$COMPARE" "$OUT/a/snap" "$OUT/a/snap.rank1"

# 2. Reruns and resumed runs are byte-identical.
run_dp 2 b --set=train.grad_accum=2
expect_rc 0 "DP=2 rerun equal" "$COMPARE" "$OUT/a/snap" "$OUT/b/snap"
run_dp 2 resumed --set=train.grad_accum=2 --resume="$OUT/a/ckpt/step_1"
expect_rc 0 "DP=2 resumed step 3 equal" "$COMPARE" "$OUT/a/snap/step_3" "$OUT/resumed/snap/step_3"

# 2b. The reduction overlapped with the last backward gives the same bits (Note
# [Overlapped gradient reduction]).
run_dp 2 plain --set=train.grad_accum=2 --set=train.overlap_grad_reduction=false
expect_rc 0 "DP=2 overlapped (default) == not overlapped" "$COMPARE" "$OUT/a/snap" "$OUT/plain/snap"

# 3. The same global batch over one or two GPUs gives the same bits.
run_dp 1 one --set=train.grad_accum=4
run_dp 2 two --set=train.grad_accum=2
expect_rc 0 "DP=1 x4 == DP=2 x2" "$COMPARE" "$OUT/one/snap" "$OUT/two/snap"
echo "DP=1 x4 and DP=2 x2 byte-identical: $(tail -n 1 "$OUT/last.log")"

# 5. Sharded optimizer state (Note [Sharded optimizer state] in gdr/trainer.cc): the same
# bits as replicated (run a), snapshots of both ranks and the checkpoint; resumed replicated.
run_dp 2 sharded --set=train.grad_accum=2 --set=train.checkpoint_every=1 \
  --set=train.shard_optimizer_state=true
grep -q "^\[rank 0\] optimizer state: sharded over 2 ranks" "$OUT/sharded.log" ||
  fail "no sharding line: $(cat "$OUT/sharded.log")"
expect_rc 0 "sharded == replicated" "$COMPARE" "$OUT/a/snap" "$OUT/sharded/snap"
expect_rc 0 "sharded == replicated (rank 1)" "$COMPARE" "$OUT/a/snap" "$OUT/sharded/snap.rank1"
for f in "$OUT"/a/ckpt/step_3/*.safetensors; do
  cmp -s "$f" "$OUT/sharded/ckpt/step_3/$(basename "$f")" || fail "sharded checkpoint: $f differs"
done
run_dp 2 sharded_resumed --set=train.grad_accum=2 --resume="$OUT/sharded/ckpt/step_1"
expect_rc 0 "sharded checkpoint resumed replicated" "$COMPARE" "$OUT/a/snap/step_3" \
  "$OUT/sharded_resumed/snap/step_3"

# 4. A killed rank ends the other in bounded time (NCCL's watchdog, GDR_DIST_TIMEOUT_S).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 29517)
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GDR_DIST_TIMEOUT_S=10 \
    "$TRAIN" --config="$CONFIG" "${COMMON[@]}" --set=train.steps=100000 > "$OUT/kill.$r.log" 2>&1 &
  eval "pid$r=$!"
done
for _ in $(seq 1200); do
  grep -q "^step 2/" "$OUT/kill.0.log" && break
  sleep 0.1
done
grep -q "^step 2/" "$OUT/kill.0.log" || { kill -9 "$pid0" "$pid1"; fail "no step 2: $(cat "$OUT"/kill.*.log)"; }
kill -9 "$pid1"
start=$(date +%s)
while kill -0 "$pid0" 2>/dev/null && [ $(($(date +%s) - start)) -lt 90 ]; do sleep 0.2; done
if kill -0 "$pid0" 2>/dev/null; then kill -9 "$pid0"; fail "rank 0 still running 90 s after rank 1 died"; fi
wait "$pid0"
rc=$?
[ "$rc" -ne 0 ] || fail "rank 0 exited 0 after rank 1 died"
grep -q "^train: error: step [0-9]*: rank 0 of 2: gradient all-reduce failed" "$OUT/kill.0.log" ||
  fail "rank 0's error: $(tail -n 5 "$OUT/kill.0.log")"
echo "dead peer: rank 0 exited $rc after $(($(date +%s) - start)) s: $(grep error "$OUT/kill.0.log")"
echo "PASS"
