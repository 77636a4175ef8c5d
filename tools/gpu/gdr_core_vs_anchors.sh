#!/usr/bin/env bash
# gdr's GDR core beside FlashQLA and FLA's Triton kernels in one device call (issue 31): GPU
# time (CUDA-graph replay) and eager time at gdn_anchor.py's shapes, then the errors of o, the
# final state and every gradient against FP64 on one seeded input file, for all three.
#
# Here (CPU machine), from the repo root:
#   BUNDLE_TARGETS="//bench:gdr_core_bench //bench:gdr_core_accuracy" bash tools/gpu/make_bundle.sh
#   bash ../shared/tools/anchor_wheels.sh .gpu_anchors.tar.xz      # FLA 0.6.0 + FlashQLA, 46 MB
# Device run, carry [".gpu.tar.xz", ".gpu_anchors.tar.xz"], command:
#   bash tools/gpu/gdr_core_vs_anchors.sh
# Writes $OUT/gdr_vs_anchors.md (the tables, also printed at the end) and
# $OUT/gdr_vs_anchors.log (every line the runs printed; the tables are rebuilt from it with
# tools/gpu/gdr_vs_anchors_table.py).
#
# Order, so that a timeout loses the least: gdr's timings and accuracy (C++, seconds), the
# FlashQLA timings (TileLang JIT-compiles for 1-2 minutes on first use), the FLA Triton
# timings, then the two anchors' accuracy runs. Each step's timeout leaves the steps after it
# their reserve of the BUDGET_S seconds (default 570, inside the device's 10-minute command);
# gdn_anchor.py prints one line per shape, so a step cut short keeps the shapes it finished.
#   STEPS="gdr gdr_extra gdr_accuracy flashqla fla flashqla_accuracy fla_accuracy"  (default: all)
#   ACCURACY_ARGS="--seq=512"   extra gdr_core_accuracy flags (shape, seed, --paths=bf16)
#   ANCHOR_ACCURACY_ARGS="..."  extra gdn_anchor_accuracy.py flags (--paths=bf16)
set -uo pipefail
start=$(date +%s)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
log=$out/gdr_vs_anchors.log
: >"$log"
budget=${BUDGET_S:-570}
steps=" ${STEPS:-gdr gdr_extra gdr_accuracy flashqla fla flashqla_accuracy fla_accuracy} "
work=${WORK:-/tmp/gdr_vs_anchors}
mkdir -p "$work"
inputs=$work/accuracy_inputs.safetensors

say() { echo "$*" | tee -a "$log"; }

# Unpack with Python's tarfile (lzma): the machine may have no xz.
unpack() {  # archive dest
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"
}
[ -f .gpu.tar.xz ] || { say "gdr_core_vs_anchors: .gpu.tar.xz missing (carry it)"; exit 2; }
rm -rf .gpu && unpack .gpu.tar.xz .
for b in gdr_core_bench gdr_core_accuracy; do
  [ -x ".gpu/bench/$b/$b" ] || { say "gdr_core_vs_anchors: .gpu/bench/$b missing (BUNDLE_TARGETS above)"; exit 2; }
done
if [ -f .gpu_anchors.tar.xz ]; then
  mkdir -p /tmp/site && unpack .gpu_anchors.tar.xz /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  say "gdr_core_vs_anchors: .gpu_anchors.tar.xz missing: the anchor steps will fail"
fi
export PYTHONUNBUFFERED=1

# The C++ binaries' libraries, as .gpu/run_all.sh finds them (libtorch of the machine's
# PyTorch, its nvidia-* packages, the bundle's Abseil / yaml-cpp / libcrypto).
torch_lib=${GDR_TORCH_LIB:-$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)}
cxx_libs=$torch_lib
for d in "$torch_lib"/../../nvidia/cu13/lib "$torch_lib"/../../nvidia/*/lib /usr/local/cuda/lib64; do
  [ -d "$d" ] && cxx_libs="$cxx_libs:$(cd "$d" && pwd)"
done
cxx_libs="$cxx_libs:$root/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
say "gdr_core_vs_anchors: $gpu; bundle built from $(cat .gpu/REVISION 2>/dev/null || echo '?'); budget ${budget} s"
python3 - <<'EOF' 2>&1 | tee -a "$log"
import importlib.metadata as m
names = ("torch", "triton", "flash-linear-attention", "fla-core", "flash-qla", "tilelang")
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "missing"
print("versions:", ", ".join(f"{n} {version(n)}" for n in names))
EOF

# run_step NAME RESERVE_S COMMAND...: runs COMMAND (output into the log) with a timeout
# that leaves RESERVE_S seconds of the budget to the steps after it.
run_step() {
  local name=$1 reserve=$2
  shift 2
  [[ "$steps" == *" $name "* ]] || return 0
  local left=$((budget - ($(date +%s) - start)))
  local limit=$((left - reserve))
  if [ "$limit" -lt 20 ]; then
    say "=== $name: skipped, ${left} s left of the budget"
    return 0
  fi
  say "=== $name (timeout ${limit} s): $*"
  local t0
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "=== $name: exit $rc$([ $rc -eq 124 ] && echo ' (timed out)') in $(($(date +%s) - t0)) s"
}

bench=$root/.gpu/bench
anchor_shapes="--anchor_shapes --dtype=model --heads=16 --dk=128 --dv=128"
# gdr, as the model calls its core (raw BF16 q/k with the fused L2 norm, BF16 v, FP32 g/beta).
run_step gdr 420 env -C "$bench/gdr_core_bench" LD_LIBRARY_PATH="$cxx_libs" \
  ./gdr_core_bench --json $anchor_shapes
# gdr only: packed documents (varlen) and Hv = 2 Hk (the anchors' script has neither).
run_step gdr_extra 410 env -C "$bench/gdr_core_bench" LD_LIBRARY_PATH="$cxx_libs" \
  ./gdr_core_bench --json --dtype=model --shapes=1x8192 --documents=4
run_step gdr_extra 400 env -C "$bench/gdr_core_bench" LD_LIBRARY_PATH="$cxx_libs" \
  ./gdr_core_bench --json --dtype=model --shapes=1x2048 --heads=32 --key_heads=16
# Writes the seeded inputs and gdr's FP64 reference that the anchors' accuracy runs read.
[[ "$steps" == *" gdr_accuracy "* ]] && rm -f "$inputs" "$inputs.pyref.pt"
run_step gdr_accuracy 370 env -C "$bench/gdr_core_accuracy" LD_LIBRARY_PATH="$cxx_libs" \
  ./gdr_core_accuracy --inputs="$inputs" ${ACCURACY_ARGS:-}
run_step flashqla 240 python3 tools/gpu/gdn_anchor.py flashqla
run_step fla 130 env FLA_FLASH_QLA=0 python3 tools/gpu/gdn_anchor.py fla
if [ -f "$inputs" ]; then
  run_step flashqla_accuracy 65 python3 tools/gpu/gdn_anchor_accuracy.py flashqla "$inputs" \
    ${ANCHOR_ACCURACY_ARGS:-}
  run_step fla_accuracy 10 env FLA_FLASH_QLA=0 python3 tools/gpu/gdn_anchor_accuracy.py fla "$inputs" \
    ${ANCHOR_ACCURACY_ARGS:-}
else
  say "=== accuracy of the anchors: skipped, no inputs file (the gdr_accuracy step failed?)"
fi

python3 tools/gpu/gdr_vs_anchors_table.py "$log" "$gpu, $(date -u +%F), bundle $(cut -c1-12 .gpu/REVISION 2>/dev/null)" >"$out/gdr_vs_anchors.md"
cat "$out/gdr_vs_anchors.md"
say "gdr_core_vs_anchors: done in $(($(date +%s) - start)) s"
