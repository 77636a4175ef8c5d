#!/usr/bin/env bash
# Runs every test gdr has on this machine: set-up (idempotent), the clang-format check,
# and `bazel test //...` (GPU-tagged tests only where a GPU is visible). Ends with one
# summary line, "N passed, N failed[, N skipped]", counted from Bazel's test results, and
# exits non-zero when a test failed, the format check failed, or no test ran.
set -uo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

bash tools/setup.sh || exit 1

format_failed=0
if ! bash tools/autoformat.sh --check; then
  echo "test: format check failed (run tools/autoformat.sh to fix)" >&2
  format_failed=1
fi

tag_filter="-gpu"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  tag_filter=""  # a GPU is here: run everything
fi

log=$(mktemp /tmp/gdr-test.XXXXXX.log)
bazel test --test_tag_filters="$tag_filter" --test_summary=short "$@" //... 2>&1 | tee "$log"
bazel_status=${PIPESTATUS[0]}

# "(cached)", or "(3/4 cached)" for a sharded test whose shards were partly cached.
passed=$(grep -cE '^//[^ ]+ +(\([^)]*cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\([^)]*cached\) )?(FAILED|TIMEOUT|FLAKY|INCOMPLETE|NO STATUS|FAILED TO BUILD)' "$log")
skipped=0
if [ -n "$tag_filter" ]; then
  skipped=$(bazel query --noshow_progress 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | grep -c '^//')
fi
rm -f "$log"

if [ "$bazel_status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build broke before any test could report
fi
failed=$((failed + format_failed))
if [ "$skipped" -gt 0 ]; then
  echo "${passed} passed, ${failed} failed, ${skipped} skipped"
else
  echo "${passed} passed, ${failed} failed"
fi
if [ "$failed" -ne 0 ]; then exit 1; fi
if [ "$passed" -eq 0 ]; then
  echo "test: no test ran" >&2
  exit 1
fi
exit 0
