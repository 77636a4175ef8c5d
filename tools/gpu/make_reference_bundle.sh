#!/usr/bin/env bash
# Builds the CUDA trainer and the step-timing benchmark of another revision (the tree before
# a change) into .gpu_reference/ and .gpu_reference.tar.xz, for tools/gpu/before_after.sh:
# one device run then compares that revision with this tree's bundle (tools/gpu/make_bundle.sh)
# bit for bit (0.8B snapshots) and in step time (paired fresh processes).
#   bash tools/gpu/make_reference_bundle.sh REV     # e.g. the commit before a refactor
# The revision is built in a temporary git worktree (removed afterwards) with the same
# Bazel flags as make_bundle.sh; Bazel's disk cache makes unchanged files cheap.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
rev=${1:?usage: make_reference_bundle.sh REV}
git rev-parse --verify --quiet "$rev^{commit}" >/dev/null ||
  { echo "make_reference_bundle: no such revision '$rev'" >&2; exit 2; }
work=$(mktemp -d /tmp/gdr_reference.XXXXXX)
cleanup() {
  (cd "$work/tree" 2>/dev/null && bazel shutdown >/dev/null 2>&1) || true
  git worktree remove --force "$work/tree" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
git worktree add --detach "$work/tree" "$rev" >/dev/null
(
  cd "$work/tree"
  bash tools/setup.sh
  bazel build --dynamic_mode=off --define=cuda_archs=sm90 //tools:train_cuda //bench:step_timing
)
rm -rf .gpu_reference
mkdir -p .gpu_reference
for label in tools/train_cuda bench/step_timing; do
  name=$(basename "$label")
  mkdir -p ".gpu_reference/$name"
  cp -L "$work/tree/bazel-bin/$label" ".gpu_reference/$name/$name"
  tar -C "$work/tree/bazel-bin/$label.runfiles/gdr" -chf - --exclude=_solib_k8 --exclude="./$label" . |
    tar -C ".gpu_reference/$name" -xf -
done
git rev-parse "$rev" > .gpu_reference/REVISION
tar -cf - .gpu_reference | xz -9 -T1 -c > .gpu_reference.tar.xz
ls -l .gpu_reference.tar.xz
