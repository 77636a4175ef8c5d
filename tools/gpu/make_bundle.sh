#!/usr/bin/env bash
# Builds every gpu-tagged test and every benchmark binary with the CUDA libtorch and
# copies them (dereferenced, with their runfiles data, without libtorch itself) into
# .gpu/, with .gpu/run_all.sh. Then one device run runs them all on a GPU machine:
#   device run, carry [".gpu.tar.xz"], command: unpack it (docs/gpu_runs.md), then
#   bash .gpu/run_all.sh
# run_all.sh writes gpu_tests.log, junit.tar and bench.md under $OUT (or ./gpu-out).
# On a GPU box that has Bazel, `bazel test --test_tag_filters=gpu //...` also works.
# BUNDLE_TARGETS="//bench:a //bench:b" bundles only those bench binaries (no tests, no
# CLIs): a few MB of xz where the device carry must leave room for something else, e.g.
#   BUNDLE_TARGETS="//bench:gdr_core_bench //bench:gdr_core_accuracy" bash tools/gpu/make_bundle.sh
# beside the 46 MB anchor wheels of tools/gpu/gdr_core_vs_anchors.sh (the full bundle, ~21 MB,
# would take the carry past its 64 MiB).
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
bash tools/setup.sh

if [ -n "${BUNDLE_TARGETS:-}" ]; then
  tests=()
  clis=()
  read -r -a benches <<<"$BUNDLE_TARGETS"
  for b in "${benches[@]}"; do
    [[ "$b" == //bench:* ]] || { echo "make_bundle: BUNDLE_TARGETS takes //bench:NAME labels, got '$b'" >&2; exit 2; }
  done
else
  mapfile -t tests < <(bazel query --noshow_progress 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
  mapfile -t benches < <(bazel query --noshow_progress 'kind(cc_binary, //bench/...)' 2>/dev/null)
  # CLIs the GPU runs need: the CUDA trainer, the snapshot comparer, the HF exporter.
  mapfile -t clis < <(bazel query --noshow_progress 'attr(tags, "\bgpu\b", kind(cc_binary, //tools/...)) + //tools:compare_snapshots + //tools:export_hf' 2>/dev/null)
fi
echo "make_bundle: ${#tests[@]} GPU tests, ${#benches[@]} benchmarks"
# Static linking of our own libraries keeps the bundle self-contained apart from
# libtorch/CUDA, which the GPU machine has.
bazel build --dynamic_mode=off --define=cuda_archs=sm90 ${tests[@]+"${tests[@]}"} "${benches[@]}" ${clis[@]+"${clis[@]}"}

rm -rf .gpu
mkdir -p .gpu/tests .gpu/bench .gpu/tools
copy_target() {  # label dest_dir
  local label=$1 dest=$2
  local pkg=${label#//}; pkg=${pkg%%:*}
  local name=${label##*:}
  local bin="bazel-bin/$pkg/$name"
  mkdir -p "$dest/$name"
  cp -L "$bin" "$dest/$name/$name"
  if [ -d "$bin.runfiles/gdr" ]; then
    tar -C "$bin.runfiles/gdr" -chf - --exclude=_solib_k8 --exclude="./$pkg/$name" . |
      tar -C "$dest/$name" -xf -
  fi
}
for t in ${tests[@]+"${tests[@]}"}; do copy_target "$t" .gpu/tests; done
for b in "${benches[@]}"; do copy_target "$b" .gpu/bench; done
for c in ${clis[@]+"${clis[@]}"}; do copy_target "$c" .gpu/tools; done
cp tools/state_equality_check.sh bench/step_timing_paired.sh tools/gpu/dp_scaling.sh tools/launch.sh .gpu/
# System libraries of this machine the GPU machine may lack (Debian's Abseil, yaml-cpp,
# OpenSSL's libcrypto).
mkdir -p .gpu/lib
for bin in .gpu/tests/*/* .gpu/bench/*/* .gpu/tools/*/*; do
  [ -f "$bin" ] && [ -x "$bin" ] || continue
  # ldd fails on scripts (the sh_tests): not an error here.
  { ldd "$bin" 2>/dev/null || true; } | awk '/libabsl_|libyaml-cpp|libcrypto/ {print $3}' | while read -r lib; do
    cp -L -n "$lib" .gpu/lib/
  done
done
cp tools/gpu/run_all.sh .gpu/run_all.sh
# The tree the binaries were built from ("+dirty" when it had uncommitted changes), for the
# record of a GPU run (the machine gets no .git).
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo +dirty)" >.gpu/REVISION
du -sh .gpu
# The binaries share most of their bytes (statically linked kernels and libraries): one xz
# stream with a 64 MiB dictionary packs ~100 MB into a few MB for the device carry.
tar -cf - .gpu | xz -9 -T1 -c > .gpu.tar.xz
ls -l .gpu.tar.xz
