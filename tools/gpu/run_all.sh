#!/usr/bin/env bash
# Runs the GPU bundle made by tools/gpu/make_bundle.sh: every test (JUnit XML + log),
# then every benchmark. Output under $OUT (default ./gpu-out): gpu_tests.log,
# junit.tar, bench.md. Ends with "N passed, N failed" counted from the tests' exit codes.
#   BENCH=0  skip benchmarks;   BENCH_ARGS="..."  extra benchmark flags
#   TESTS="a b"  run only these tests;  GTEST_FILTER works as usual
set -uo pipefail
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out/junit"

torch_lib=${GDR_TORCH_LIB:-$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)}
extra=""
for d in "$torch_lib"/../../nvidia/cu13/lib "$torch_lib"/../../nvidia/*/lib /usr/local/cuda/lib64; do
  [ -d "$d" ] && extra="$extra:$(cd "$d" && pwd)"
done
export LD_LIBRARY_PATH="$torch_lib$extra:$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu_tests.log"

passed=0
failed=0
for dir in "$bundle"/tests/*/; do
  name=$(basename "$dir")
  if [ -n "${TESTS:-}" ] && [[ " $TESTS " != *" $name "* ]]; then continue; fi
  echo "=== $name" | tee -a "$out/gpu_tests.log"
  start=$(date +%s)
  (cd "$dir" && "./$name" --gtest_output="xml:$out/junit/$name.xml") >>"$out/gpu_tests.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then passed=$((passed + 1)); status=PASSED; else failed=$((failed + 1)); status="FAILED (exit $rc)"; fi
  echo "=== $name $status in $(( $(date +%s) - start )) s" | tee -a "$out/gpu_tests.log"
done
tar -C "$out" -cf "$out/junit.tar" junit && rm -rf "$out/junit"

if [ "${BENCH:-1}" != "0" ]; then
  for dir in "$bundle"/bench/*/; do
    name=$(basename "$dir")
    echo "## $name" >>"$out/bench.md"
    (cd "$dir" && "./$name" ${BENCH_ARGS:-}) >>"$out/bench.md" 2>&1 || echo "benchmark $name failed" | tee -a "$out/bench.md"
  done
fi
echo "${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
