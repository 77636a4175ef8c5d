#!/bin/bash
# Data parallelism on CPU (Gloo, 2 processes on loopback), the train binary end to end:
#   1. DP=2 through tools/launch.sh: both ranks end with the same losses, gradients,
#      parameters and optimizer state (rank 0's snapshots vs rank 1's, exit 0); only rank 0
#      logs, writes metrics and checkpoints;
#   2. a fresh DP=2 rerun is byte-identical (exit 0), and so is a DP=2 run resumed from
#      rank 0's step-1 checkpoint, and so are runs with train.overlap_grad_reduction;
#   3. a killed rank ends the other with an error within 30 s, and so does a hung
#      (SIGSTOPped) one, by the GDR_DIST_TIMEOUT_S timeout; a missing peer at start-up too;
#   4. a config that differs between ranks is refused at start-up on both ranks;
#   5. launch.sh stops the other ranks and fails when one rank fails;
#   6. bad rank environment -> one error line naming the variable, exit 2;
#   7. DP=1 with grad_accum 4 and DP=2 with grad_accum 2 (the same global batch) are
#      byte-identical (Note [Gradient reduction tree] in gdr/distributed.h), fp32 and bf16;
#   8. train.shard_optimizer_state (Note [Sharded optimizer state] in gdr/trainer.cc): DP=2
#      sharded == DP=2 replicated byte for byte after 3 steps (snapshots of both ranks:
#      losses, gradients, masters, AdamW state; and the checkpoints), fp32 and bf16, both
#      optimizer.impl paths, with clipping; each rank holds only its owned moments; a sharded
#      checkpoint resumed sharded and replicated, and a replicated one resumed sharded,
#      continue identically.
set -u
TRAIN="$1"
COMPARE="$2"
LAUNCH="$3"
CONFIG="$4"
OUT="${TEST_TMPDIR:-/tmp}/distributed"
rm -rf "$OUT"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1  # see TRAIN_TEST_ENV in tests/gdr/BUILD
export GDR_DIST_TIMEOUT_S=10
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT

fail() { echo "FAIL: $*"; exit 1; }

expect_rc() {  # expect_rc WANT DESCRIPTION CMD...
  want="$1"; what="$2"; shift 2
  "$@" > "$OUT/last.log" 2>&1
  rc=$?
  [ "$rc" -eq "$want" ] || { cat "$OUT/last.log"; fail "$what: exit $rc, expected $want"; }
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

SMALL=(--set=data.seq_len=32 --set=data.micro_batch_size=2 --set=train.steps=2)

run_dp() {  # run_dp N NAME [ARGS...]
  n="$1"; name="$2"; shift 2
  expect_rc 0 "DP=$n $name" "$LAUNCH" "$n" "$TRAIN" --config="$CONFIG" "${SMALL[@]}" \
    --set=train.snapshot_dir="$OUT/$name/snap" --set=train.checkpoint_dir="$OUT/$name/ckpt" \
    --set=train.metrics_path="$OUT/$name/metrics.jsonl" "$@"
}

# 1. Both ranks compute the same steps.
run_dp 2 a --set=train.grad_accum=2 --set=train.checkpoint_every=1
cp "$OUT/last.log" "$OUT/a.log"
grep -q "^\[rank 0\] step 2/2 loss " "$OUT/a.log" || fail "no rank-0 progress line: $(cat "$OUT/a.log")"
! grep -q "^\[rank 1\] step" "$OUT/a.log" || fail "rank 1 printed progress: $(cat "$OUT/a.log")"
[ "$(wc -l < "$OUT/a/metrics.jsonl")" -eq 2 ] || fail "metrics.jsonl should have 2 lines (rank 0 only)"
[ -d "$OUT/a/ckpt/step_2" ] || fail "no checkpoint from rank 0"
[ -d "$OUT/a/snap.rank1/step_2" ] || fail "no rank-1 snapshot"
grep -q '"tokens":256' "$OUT/a/metrics.jsonl" || fail "tokens should count both ranks: $(cat "$OUT/a/metrics.jsonl")"
expect_rc 0 "rank 0 and rank 1 equal" "$COMPARE" "$OUT/a/snap" "$OUT/a/snap.rank1"

# 2. Reruns are byte-identical.
run_dp 2 b --set=train.grad_accum=2
expect_rc 0 "DP=2 rerun equal" "$COMPARE" "$OUT/a/snap" "$OUT/b/snap"
run_dp 2 resumed --set=train.grad_accum=2 --resume="$OUT/a/ckpt/step_1"
grep -q "^\[rank 0\] resumed from .* at step 1$" "$OUT/last.log" || fail "resume line: $(cat "$OUT/last.log")"
expect_rc 0 "DP=2 resumed step 2 equal" "$COMPARE" "$OUT/a/snap/step_2" "$OUT/resumed/snap/step_2"
expect_rc 0 "DP=2 resumed step 2 equal (rank 1)" "$COMPARE" "$OUT/a/snap/step_2" "$OUT/resumed/snap.rank1/step_2"

# 2b. The reduction overlapped with the last backward (Note [Overlapped gradient
# reduction]) gives the same bits, with one and with several buckets in flight per step.
run_dp 2 plain --set=train.grad_accum=2 --set=train.overlap_grad_reduction=false
expect_rc 0 "overlapped (default) == not overlapped" "$COMPARE" "$OUT/a/snap" "$OUT/plain/snap"
expect_rc 0 "not-overlapped ranks equal" "$COMPARE" "$OUT/plain/snap" "$OUT/plain/snap.rank1"
run_dp 2 overlap_bf16 --set=train.grad_accum=2 --set=train.dtype=bf16 \
  --set=train.overlap_grad_reduction=true
run_dp 2 plain_bf16 --set=train.grad_accum=2 --set=train.dtype=bf16 \
  --set=train.overlap_grad_reduction=false
expect_rc 0 "overlapped == not overlapped, bf16" "$COMPARE" "$OUT/plain_bf16/snap" \
  "$OUT/overlap_bf16/snap"
run_dp 2 overlap1 --set=train.grad_accum=1 --set=train.overlap_grad_reduction=true
run_dp 2 plain1 --set=train.grad_accum=1 --set=train.overlap_grad_reduction=false
expect_rc 0 "overlapped == not overlapped, grad_accum 1" "$COMPARE" "$OUT/plain1/snap" \
  "$OUT/overlap1/snap"

# 3. A killed rank ends the other with an error in bounded time.
port=$(free_port)
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GDR_DIST_TIMEOUT_S=5 \
    "$TRAIN" --config="$CONFIG" "${SMALL[@]}" --set=train.steps=100000 > "$OUT/kill.$r.log" 2>&1 &
  eval "pid$r=$!"
done
for _ in $(seq 600); do
  grep -q "^step 1/" "$OUT/kill.0.log" && break
  sleep 0.1
done
grep -q "^step 1/" "$OUT/kill.0.log" || { kill -9 "$pid0" "$pid1"; fail "no step 1: $(cat "$OUT"/kill.*.log)"; }
kill -9 "$pid1"
start=$(date +%s)
while kill -0 "$pid0" 2>/dev/null && [ $(($(date +%s) - start)) -lt 30 ]; do sleep 0.2; done
if kill -0 "$pid0" 2>/dev/null; then kill -9 "$pid0"; fail "rank 0 still running 30 s after rank 1 died"; fi
wait "$pid0"
rc=$?
[ "$rc" -ne 0 ] || fail "rank 0 exited 0 after rank 1 died"
grep -q "^train: error: step [0-9]*: rank 0 of 2: gradient all-reduce failed" "$OUT/kill.0.log" ||
  fail "rank 0's error: $(cat "$OUT/kill.0.log")"
echo "dead peer: rank 0 exited $rc after $(($(date +%s) - start)) s: $(grep error "$OUT/kill.0.log")"

# A hung rank: the timeout (3 s here) ends the other.
port=$(free_port)
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GDR_DIST_TIMEOUT_S=3 \
    "$TRAIN" --config="$CONFIG" "${SMALL[@]}" --set=train.steps=100000 > "$OUT/hang.$r.log" 2>&1 &
  eval "pid$r=$!"
done
for _ in $(seq 600); do
  grep -q "^step 1/" "$OUT/hang.0.log" && break
  sleep 0.1
done
kill -STOP "$pid1"
start=$(date +%s)
while kill -0 "$pid0" 2>/dev/null && [ $(($(date +%s) - start)) -lt 30 ]; do sleep 0.2; done
kill -9 "$pid1"
if kill -0 "$pid0" 2>/dev/null; then kill -9 "$pid0"; fail "rank 0 still running 30 s after rank 1 hung"; fi
wait "$pid0"
[ $? -ne 0 ] || fail "rank 0 exited 0 after rank 1 hung"
grep -q "^train: error: step [0-9]*: rank 0 of 2: gradient all-reduce failed.*Timed out" "$OUT/hang.0.log" ||
  fail "rank 0's error after a hang: $(cat "$OUT/hang.0.log")"
echo "hung peer: rank 0 exited after $(($(date +%s) - start)) s"

# A peer that never arrives.
start=$(date +%s)
expect_rc 2 "missing peer" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
  GDR_DIST_TIMEOUT_S=2 "$TRAIN" --config="$CONFIG" "${SMALL[@]}"
grep -q "^train: error: rank 0: rendezvous at 127.0.0.1:[0-9]* failed within 2 s" "$OUT/last.log" ||
  fail "missing peer: $(cat "$OUT/last.log")"
[ $(($(date +%s) - start)) -lt 30 ] || fail "missing peer took too long"

# 4. A config that differs between ranks is refused at start-up, on every rank.
port=$(free_port)
for r in 0 1; do
  lr=3.0e-3
  [ "$r" -eq 1 ] && lr=1.0e-3
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$TRAIN" --config="$CONFIG" "${SMALL[@]}" --set=optimizer.lr=$lr > "$OUT/mismatch.$r.log" 2>&1 &
  eval "pid$r=$!"
done
for r in 0 1; do
  eval "wait \$pid$r"
  rc=$?
  [ "$rc" -eq 2 ] || fail "mismatched config: rank $r exit $rc: $(cat "$OUT/mismatch.$r.log")"
  grep -q "^train: error: config hash differs between ranks: rank 0 [0-9a-f]\{64\}, rank 1 [0-9a-f]\{64\}$" \
    "$OUT/mismatch.$r.log" || fail "mismatched config, rank $r: $(cat "$OUT/mismatch.$r.log")"
done

# 5. launch.sh: one failing rank stops the others.
start=$(date +%s)
expect_rc 3 "launch with a failing rank" "$LAUNCH" 2 sh -c 'if [ "$RANK" = 1 ]; then echo bye; exit 3; fi; exec sleep 60'
[ $(($(date +%s) - start)) -lt 20 ] || fail "launch.sh took too long to stop the ranks"
grep -q "^\[rank 1\] bye$" "$OUT/last.log" || fail "no rank prefix: $(cat "$OUT/last.log")"
expect_rc 2 "launch usage" "$LAUNCH" x true

# 6. Bad rank environment.
bad_env() {  # bad_env MESSAGE VAR=VALUE...
  msg="$1"; shift
  expect_rc 2 "bad env $*" env "$@" "$TRAIN" --config="$CONFIG" "${SMALL[@]}"
  grep -q "^train: error: $msg" "$OUT/last.log" || fail "bad env $*: $(cat "$OUT/last.log")"
}
bad_env "RANK: 2 is outside 0..1" RANK=2 WORLD_SIZE=2 MASTER_PORT=29500
bad_env "MASTER_PORT: not set, but WORLD_SIZE is 2" RANK=0 WORLD_SIZE=2
bad_env "WORLD_SIZE: expected an integer but got 'two'" RANK=0 WORLD_SIZE=two MASTER_PORT=29500
bad_env "RANK: expected an integer but got 'x'" RANK=x WORLD_SIZE=2 MASTER_PORT=29500

# 7. DP=1 x 4 microbatches and DP=2 x 2 microbatches: the same steps, byte for byte.
run_dp 1 dp1 --set=train.grad_accum=4
run_dp 2 dp2 --set=train.grad_accum=2
expect_rc 0 "DP=1 x 4 vs DP=2 x 2" "$COMPARE" "$OUT/dp1/snap" "$OUT/dp2/snap"
# ... and in bf16 (each microbatch's gradient is widened to FP32 before the tree).
run_dp 1 dp1_bf16 --set=train.grad_accum=4 --set=train.dtype=bf16
run_dp 2 dp2_bf16 --set=train.grad_accum=2 --set=train.dtype=bf16
expect_rc 0 "bf16 DP=2 ranks equal" "$COMPARE" "$OUT/dp2_bf16/snap" "$OUT/dp2_bf16/snap.rank1"
expect_rc 0 "bf16 DP=1 x 4 vs DP=2 x 2" "$COMPARE" "$OUT/dp1_bf16/snap" "$OUT/dp2_bf16/snap"
# 8. Sharded optimizer state: the same bits as replicated, and the state really is split.
same_tensors() {  # same_tensors DIR_A DIR_B: the two directories' safetensors byte-identical
  for f in "$1"/*.safetensors; do
    cmp -s "$f" "$2/$(basename "$f")" || fail "$f differs from $2/$(basename "$f")"
  done
}
for dtype in fp32 bf16; do
  for impl in fused loop; do
    # grad_clip 0.05: the clip factor is < 1, so the clipped gradients are compared too.
    common=(--set=train.steps=3 --set=train.grad_accum=2 --set=train.dtype=$dtype
            --set=optimizer.impl=$impl --set=optimizer.grad_clip=0.05)
    run_dp 2 rep_${dtype}_$impl "${common[@]}"
    run_dp 2 shard_${dtype}_$impl "${common[@]}" --set=train.shard_optimizer_state=true
    cp "$OUT/last.log" "$OUT/shard_${dtype}_$impl.log"
    for r in "" .rank1; do
      expect_rc 0 "sharded == replicated, $dtype $impl$r" "$COMPARE" \
        "$OUT/rep_${dtype}_$impl/snap$r" "$OUT/shard_${dtype}_$impl/snap$r"
    done
    same_tensors "$OUT/rep_${dtype}_$impl/ckpt/step_3" "$OUT/shard_${dtype}_$impl/ckpt/step_3"
  done
  log="$OUT/shard_${dtype}_fused.log"
  plan=$(grep "^\[rank 0\] optimizer state: sharded over 2 ranks (rank 0 owns [0-9]* tensors, .* elements; rank 1 owns [0-9]* tensors, .* elements)$" "$log") ||
    fail "no sharding line: $(cat "$log")"
  echo "$dtype: $plan"
  # Each rank holds the moments of its own parameters only, and together all of them.
  n0=$(sed -n 's/^\[rank 0\] rank 0 holds AdamW moments of \([0-9]*\) tensors (\([0-9]*\) elements).*/\1 \2/p' "$log")
  n1=$(sed -n 's/^\[rank 1\] rank 1 holds AdamW moments of \([0-9]*\) tensors (\([0-9]*\) elements).*/\1 \2/p' "$log")
  [ -n "$n0" ] && [ -n "$n1" ] || fail "no holdings lines: $(cat "$log")"
  echo "$plan" | grep -q "rank 0 owns ${n0% *} tensors" || fail "rank 0 holds $n0, plan: $plan"
  echo "$plan" | grep -q "rank 1 owns ${n1% *} tensors" || fail "rank 1 holds $n1, plan: $plan"
  total=$(python3 -c "
import json, struct, sys
with open(sys.argv[1], 'rb') as f:
    n = struct.unpack('<Q', f.read(8))[0]; h = json.loads(f.read(n))
tensors = [k for k in h if k.startswith('adam/') and k.endswith('.exp_avg')]
elements = 0
for k in tensors:
    e = 1
    for d in h[k]['shape']: e *= d
    elements += e
print(len(tensors), elements)" "$OUT/rep_${dtype}_fused/snap/step_3/snapshot.safetensors")
  [ "$(( ${n0% *} + ${n1% *} )) $(( ${n0#* } + ${n1#* } ))" = "$total" ] ||
    fail "$dtype: ranks hold $n0 + $n1, the model has $total"
  [ "${n0% *}" -gt 0 ] && [ "${n1% *}" -gt 0 ] || fail "$dtype: a rank holds nothing: $n0 / $n1"
  if [ "$dtype" = bf16 ]; then
    grep -q "^\[rank 1\] rank 1 holds AdamW moments of ${n1% *} tensors (${n1#* } elements) and FP32 masters of ${n1% *} tensors (${n1#* } elements)$" "$log" ||
      fail "bf16 masters not sharded: $(grep holds "$log")"
  fi
done
# Resume across the switch: a sharded checkpoint, resumed sharded and replicated, and a
# replicated one resumed sharded, continue as the uninterrupted run (steps 2 and 3).
for dtype in fp32 bf16; do
  common=(--set=train.steps=3 --set=train.grad_accum=2 --set=train.dtype=$dtype
          --set=optimizer.grad_clip=0.05)
  run_dp 2 shard_ck_$dtype "${common[@]}" --set=train.shard_optimizer_state=true \
    --set=train.checkpoint_every=1
  run_dp 2 rep_ck_$dtype "${common[@]}" --set=train.checkpoint_every=1
  same_tensors "$OUT/rep_ck_$dtype/ckpt/step_1" "$OUT/shard_ck_$dtype/ckpt/step_1"
  for from in shard rep; do
    for to in true false; do
      run_dp 2 res_${from}_${to}_$dtype "${common[@]}" --set=train.shard_optimizer_state=$to \
        --resume="$OUT/${from}_ck_$dtype/ckpt/step_1"
      for st in 2 3; do
        for r in "" .rank1; do
          expect_rc 0 "resumed $from -> sharded=$to, $dtype, step $st$r" "$COMPARE" \
            "$OUT/rep_${dtype}_fused/snap/step_$st" "$OUT/res_${from}_${to}_$dtype/snap$r/step_$st"
        done
      done
    done
  done
done
echo PASS
