# Sourced by the GPU-machine scripts of tools/gpu/ (from the repository root): $OUT for
# results (default ./gpu-out), the bundle .gpu/ unpacked from .gpu.tar.xz when needed (with
# Python's tarfile: the machine may have no xz), G=.gpu, and LD_LIBRARY_PATH with the
# machine's libtorch and the bundle's system libraries.
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -d .gpu ] || python3 -c "import tarfile; tarfile.open('.gpu.tar.xz').extractall('.')"
G=$PWD/.gpu
TORCH_LIB=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TORCH_LIB:$G/lib

# step_timing_row LABEL TABLE LOG ARGS...: one bench/step_timing run in a fresh process
# (ARGS: --config=... --set=...; warm-up $WARMUP, default 3, and $STEPS, default 10, timed
# steps), and one line "LABEL: exit RC: <its tokens/s and peak-memory line, or its error>"
# appended to TABLE; the whole output goes to LOG.
step_timing_row() {
  local label=$1 table=$2 log=$3
  shift 3
  (cd "$G/bench/step_timing" && ./step_timing "$@" --warmup="${WARMUP:-3}" \
    --steps="${STEPS:-10}") >"$log" 2>&1
  local rc=$?
  echo "$label: exit $rc: $(grep -E 'tokens_per_s=|error' "$log" | tail -1)" | tee -a "$table"
}
