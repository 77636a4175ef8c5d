#!/usr/bin/env bash
# Formats gdr's C++/CUDA sources with clang-format 14 (Debian's clang-format-14, pinned
# because formatting differs between versions) using the committed .clang-format.
#   tools/autoformat.sh           rewrite files in place
#   tools/autoformat.sh --check   list unformatted files and exit 1 if there are any
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

clang_format=$(command -v clang-format-14 || true)
if [ -z "$clang_format" ]; then
  echo "autoformat: clang-format-14 not found (run tools/setup.sh)" >&2
  exit 1
fi

mapfile -t files < <(git ls-files -co --exclude-standard -- '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^third_party/' | while read -r f; do [ -f "$f" ] && echo "$f"; done)
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    if ! "$clang_format" --style=file "$f" | cmp -s - "$f"; then bad+=("$f"); fi
  done
  if [ ${#bad[@]} -gt 0 ]; then
    printf 'autoformat: not formatted: %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "autoformat: ${#files[@]} files formatted"
  exit 0
fi
[ ${#files[@]} -eq 0 ] || "$clang_format" --style=file -i "${files[@]}"
