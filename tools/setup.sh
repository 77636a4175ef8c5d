#!/usr/bin/env bash
# One-time (and idempotent) set-up of everything gdr needs to build and test:
# Debian packages, a patched copy of Debian's rules_cc, the pinned libtorch from the
# PyPI torch wheel, the pinned cuDNN frontend headers from the PyPI nvidia-cudnn-frontend
# wheel, and the generated .bazelrc.generated that points Bazel at them.
# A second run with everything in place takes about a second and installs nothing.
#
# Environment:
#   GDR_CACHE      where downloads and unpacked libtorch live (default ~/.cache/gdr)
#   GDR_LIBTORCH   use this libtorch instead (a directory with include/ and lib/)
set -euo pipefail

readonly TORCH_VERSION="2.11.0"
readonly TORCH_WHEEL="torch-${TORCH_VERSION}-cp312-cp312-manylinux_2_28_x86_64.whl"
readonly TORCH_WHEEL_SHA256="0f68f4ac6d95d12e896c3b7a912b5871619542ec54d3649cf48cc1edd4dd2756"
# cuDNN's C++ frontend (header-only; the attention op builds its cuDNN graphs with it). Only
# the wheel's include/ is used: the headers are the same in every platform's wheel.
readonly CUDNN_FRONTEND_VERSION="1.32.0"
readonly CUDNN_FRONTEND_WHEEL="nvidia_cudnn_frontend-${CUDNN_FRONTEND_VERSION}-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
readonly CUDNN_FRONTEND_WHEEL_SHA256="8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239"
readonly APT_PACKAGES=(bazel-bootstrap bazel-rules-cc bazel-platforms bazel-skylib
  bazel-rules-java libabsl-dev googletest libyaml-cpp-dev nlohmann-json3-dev libssl-dev
  clang-format-14 unzip python3-pip)

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${GDR_CACHE:-$HOME/.cache/gdr}

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

install_apt_packages() {
  local missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
      missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q >/tmp/gdr-apt-update.log 2>&1 ||
    die "apt-get update failed (no network to the Debian mirror?); log: /tmp/gdr-apt-update.log"
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/gdr-apt.log 2>&1 ||
    die "apt-get install ${missing[*]} failed; log: /tmp/gdr-apt.log"
}

# Debian's rules_cc 0.0.4 calls use_cpp_toolchain(), which Bazel 4.2.3 lacks. We patch a
# private copy rather than committing Debian's files.
make_patched_rules_cc() {
  local dest="$cache/rules_cc"
  [ -f "$dest/.gdr-patched" ] && return 0
  say "making patched rules_cc in $dest"
  rm -rf "$dest.tmp"
  cp -r /usr/share/bazel/rules/cc "$dest.tmp"
  chmod -R u+w "$dest.tmp"
  local f
  for f in compiler_flag.bzl cc_flags_supplier.bzl; do
    sed -i -e 's/, "use_cpp_toolchain")/)/' \
      -e 's/use_cpp_toolchain()/["@bazel_tools\/\/tools\/cpp:toolchain_type"]/' \
      "$dest.tmp/cc/private/rules_impl/$f"
  done
  grep -rq 'use_cpp_toolchain' "$dest.tmp/cc/private/rules_impl/"{compiler_flag,cc_flags_supplier}.bzl &&
    die "patching rules_cc failed: use_cpp_toolchain still present in $dest.tmp"
  touch "$dest.tmp/.gdr-patched"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
}

# Downloads one pinned wheel from PyPI into $cache/wheels (once) and checks its sha256.
fetch_wheel() {  # requirement wheel_file sha256 size_note
  local requirement=$1 file=$2 sha256=$3 size_note=$4
  local wheel="$cache/wheels/$file"
  mkdir -p "$cache/wheels"
  if [ ! -f "$wheel" ]; then
    say "downloading $file from PyPI ($size_note)" >&2
    rm -rf "$cache/wheels.tmp"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 -d "$cache/wheels.tmp" \
      "$requirement" >&2 ||
      die "downloading $requirement from PyPI failed (no network to PyPI?)"
    mv "$cache/wheels.tmp/$file" "$wheel" ||
      die "pip did not produce $file in $cache/wheels.tmp"
    rm -rf "$cache/wheels.tmp"
  fi
  say "checking sha256 of $wheel" >&2
  local actual
  actual=$(sha256sum "$wheel" | cut -d' ' -f1)
  if [ "$actual" != "$sha256" ]; then
    rm -f "$wheel"
    die "checksum mismatch for $file: expected $sha256, got $actual (file removed; run setup again to re-download)"
  fi
}

fetch_libtorch() {
  local dest="$cache/libtorch-$TORCH_VERSION"
  if [ -f "$dest/.gdr-complete" ]; then
    echo "$dest"
    return 0
  fi
  local wheel="$cache/wheels/$TORCH_WHEEL"
  fetch_wheel "torch==$TORCH_VERSION" "$TORCH_WHEEL" "$TORCH_WHEEL_SHA256" "~530 MB"
  local free_kb
  free_kb=$(df -Pk "$cache" | awk 'NR==2 {print $4}')
  [ "$free_kb" -gt 3000000 ] ||
    die "not enough disk space in $cache to unpack libtorch: need ~3 GB, have $((free_kb / 1024)) MB"
  say "unpacking libtorch into $dest" >&2
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  unzip -q "$wheel" 'torch/include/*' 'torch/lib/*' 'torch/share/*' -d "$dest.tmp" ||
    die "unpacking $wheel failed (disk full?)"
  mv "$dest.tmp/torch/include" "$dest.tmp/torch/lib" "$dest.tmp/torch/share" "$dest.tmp/"
  rmdir "$dest.tmp/torch"
  echo "$TORCH_WHEEL_SHA256" >"$dest.tmp/.gdr-complete"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  echo "$dest"
}

fetch_cudnn_frontend() {
  local dest="$cache/cudnn_frontend-$CUDNN_FRONTEND_VERSION"
  if [ -f "$dest/.gdr-complete" ]; then
    echo "$dest"
    return 0
  fi
  fetch_wheel "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION" "$CUDNN_FRONTEND_WHEEL" \
    "$CUDNN_FRONTEND_WHEEL_SHA256" "~12 MB"
  say "unpacking the cuDNN frontend headers into $dest" >&2
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  unzip -q "$cache/wheels/$CUDNN_FRONTEND_WHEEL" 'include/*' \
    "nvidia_cudnn_frontend-$CUDNN_FRONTEND_VERSION.dist-info/licenses/*" -d "$dest.tmp" ||
    die "unpacking $CUDNN_FRONTEND_WHEEL failed (disk full?)"
  [ -f "$dest.tmp/include/cudnn_frontend.h" ] ||
    die "$CUDNN_FRONTEND_WHEEL has no include/cudnn_frontend.h"
  echo "$CUDNN_FRONTEND_WHEEL_SHA256" >"$dest.tmp/.gdr-complete"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  echo "$dest"
}

check_libtorch_dir() {
  local dir=$1
  [ -f "$dir/include/ATen/ATen.h" ] || die "GDR_LIBTORCH=$dir has no include/ATen/ATen.h"
  [ -f "$dir/lib/libtorch_cpu.so" ] || die "GDR_LIBTORCH=$dir has no lib/libtorch_cpu.so"
}

write_generated_bazelrc() {
  local libtorch=$1 cudnn_frontend=$2 cuda=${CUDA_PATH:-/usr/local/cuda}
  [ -x "$cuda/bin/nvcc" ] || die "no nvcc at $cuda/bin/nvcc: install the CUDA toolkit or set CUDA_PATH"
  [ -f "$cuda/include/cudnn.h" ] ||
    die "no cudnn.h in $cuda/include: the attention op needs cuDNN 9's headers next to the CUDA toolkit"
  local out="$repo_root/.bazelrc.generated"
  local content
  content=$(cat <<RC
# Generated by tools/setup.sh; do not edit or commit.
common --override_repository=rules_cc=$cache/rules_cc
common --override_repository=rules_java=/usr/share/bazel/rules/java
common --override_repository=platforms=/usr/share/bazel/platforms
common --override_repository=bazel_skylib=/usr/share/bazel/tools/skylib
build --repo_env=GDR_LIBTORCH=$libtorch
build --repo_env=GDR_CUDNN_FRONTEND=$cudnn_frontend
build --repo_env=CUDA_PATH=$cuda
build --disk_cache=$cache/bazel-disk-cache
RC
)
  if [ ! -f "$out" ] || [ "$(cat "$out")" != "$content" ]; then
    say "writing $out"
    printf '%s\n' "$content" >"$out"
  fi
}

main() {
  mkdir -p "$cache" || die "cannot create cache directory $cache"
  install_apt_packages
  make_patched_rules_cc
  local libtorch
  if [ -n "${GDR_LIBTORCH:-}" ]; then
    libtorch=$GDR_LIBTORCH
  else
    libtorch=$(fetch_libtorch)
  fi
  check_libtorch_dir "$libtorch"
  local cudnn_frontend
  cudnn_frontend=$(fetch_cudnn_frontend)
  write_generated_bazelrc "$libtorch" "$cudnn_frontend"
}

main "$@"
