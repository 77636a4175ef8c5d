#!/usr/bin/env bash
# launch.sh N BINARY [ARGS...]: starts N local ranks of a data-parallel run on this machine.
#
# Each rank gets torchrun's variables: RANK=r, LOCAL_RANK=r, WORLD_SIZE=N,
# MASTER_ADDR=127.0.0.1 (unless set) and MASTER_PORT (a free port, unless set), plus
# GLOO_SOCKET_IFNAME=lo unless set. Each rank's stdout and stderr go to launch.sh's stdout,
# every line prefixed "[rank r] ". When a rank exits non-zero, the others get SIGTERM
# (SIGKILL 5 s later) and launch.sh exits with that rank's status; otherwise it exits 0 once
# all ranks are done. SIGINT/SIGTERM to launch.sh stop all ranks.
#   tools/launch.sh 2 bazel-bin/tools/train --config=configs/train_tiny.yaml
set -u
if [ "$#" -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch.sh N BINARY [ARGS...]  (N >= 1 local ranks)" >&2
  exit 2
fi
n="$1"
shift

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $((20000 + RANDOM % 40000))
}
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export MASTER_PORT="${MASTER_PORT:-$(free_port)}"
export WORLD_SIZE="$n"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

state=$(mktemp -d "${TMPDIR:-/tmp}/launch.XXXXXX")
trap 'rm -rf "$state"' EXIT

run_rank() {  # run_rank R CMD...: the rank's pid to $state/pid.R, its status to $state/rc.R
  local r="$1"
  shift
  RANK=$r LOCAL_RANK=$r "$@" 2>&1 &
  echo $! > "$state/pid.$r"
  wait $!
  echo $? > "$state/rc.$r"
}

for ((r = 0; r < n; r++)); do
  run_rank "$r" "$@" | sed -u "s/^/[rank $r] /" &
done
for ((r = 0; r < n; r++)); do
  while [ ! -s "$state/pid.$r" ]; do sleep 0.05; done
done

stop_all() {
  local pids=() p
  for ((r = 0; r < n; r++)); do pids+=("$(cat "$state/pid.$r")"); done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && return
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap 'stop_all; wait; rm -rf "$state"; exit 130' INT TERM

while :; do
  finished=0
  for ((r = 0; r < n; r++)); do
    [ -s "$state/rc.$r" ] || continue
    finished=$((finished + 1))
    rc=$(cat "$state/rc.$r")
    if [ "$rc" -ne 0 ]; then
      stop_all
      wait  # the other ranks' output
      echo "launch: rank $r exited with status $rc; stopped the other ranks" >&2
      exit "$rc"
    fi
  done
  [ "$finished" -eq "$n" ] && break
  sleep 0.1
done
wait  # the output prefixers
exit 0
