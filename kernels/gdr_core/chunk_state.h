// The sequential part of the chunked gated delta rule (step 7 of the spec in the shared
// design note qwen3_5.md): one CUDA kernel that walks the chunks of every (batch, head)
// carrying a [dk, dv] FP32 matrix, used for the forward state pass and, walking backwards,
// for the state-gradient pass. Plain C++ (no CUDA or torch headers).
//
// One step of the scan, chunk n, carry X ([dk, dv]), decay_n = exp(g_last_n):
//   R_n   = base_n + left_sign * left_n @ X            [C, dv]   (left_n: [C, dk])
//   X'    = decay_n * X + extra_n + right_sign * right_n^T @ R_n   (right_n: [C, dk])
// and, when asked (the backward's dGlast_n = decay_n * sum(S_n .* dS_{n+1})), per thread
// the partial dot decay_n * <dot_with_n, X> over the carry elements the thread owns.
// Forward:  X = S, base = U, left = W, left_sign = -1, right = Kend, right_sign = +1,
//           no extra; R_n = Vn (the corrected values), carry entering chunk n = S_n.
// Backward: X = dS, base = P^T dO, left = Kend, left_sign = +1, right = W,
//           right_sign = -1, extra = Qd^T dO; R_n = dVn, carry entering chunk n = dS_{n+1}.
// Everything else (O, dW, dQd, dKend, dP) needs no carry once the carries are stored, so
// the op layer computes it with batched matmuls after the scan. dGlast contracts over dv,
// i.e. across blocks: the kernel only writes per-thread partials, which the op layer sums
// in a fixed order. The kernel therefore never reduces across blocks (see Note [Chunk
// state scan determinism] in kernels/gdr_core/chunk_state_kernel.cuh).
//
// Layouts: base/left/right are [BH, N, C, d] FP32 with unit stride in the last dimension
// and the given strides elsewhere (so narrow() views of a wider tensor need no copy);
// extra, g_last, carry_in, rows_out, carries_out, carry_final, dot_with, dot_out are
// contiguous FP32.
// The launcher runs on the stream it is given. Results are deterministic: every output
// element is one thread's fixed-order FP32 sum (SIMT kernel) or one warp's fixed sequence
// of 3xTF32 mma instructions (tensor-core kernel), with no atomics.
//
// Two kernels compute the same contract (see the Notes in kernels/gdr_core/chunk_state_kernel.cuh
// and kernels/gdr_core/chunk_state_tc_kernel.cuh): the tensor-core kernel (mma.sync m16n8k8
// TF32 with the 3xTF32 split, FP32-level accuracy) for every shape the scan supports
// unless args.allow_tensor_cores is false, and the FP32 SIMT kernel otherwise (also if
// the device refuses the tensor-core kernel's dynamic shared memory). The choice is
// chunk_state_scan_uses_tensor_cores(dk, dv, allow), a pure function of the shapes and the
// flag. The CUDA op layer (ops/gdr_core/gdr_core_op_cuda.cc) sets the flag from the execution
// policy's chunk_scan_tensor_cores (ops/policy/execution_policy.h; environment override
// GDR_CHUNK_SCAN_TC): false selects the SIMT kernel, true (the default) the tensor-core
// kernel. The two kernels round differently (both FP32-level), so their bits
// differ from each other; each gives the same bits on every run.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

constexpr int kChunkStateChunk = 64;     // C: chunk length the kernel is built for
constexpr int kChunkStateTileDv = 16;    // dv columns of the carry held by one block
constexpr int kChunkStateThreads = 256;  // threads per block

// dk is a template parameter of the kernel (register arrays); dv only needs to split
// into whole column tiles.
inline bool chunk_state_scan_supports(int64_t dk, int64_t dv) {
  return (dk == 64 || dk == 128 || dk == 256) && dv > 0 && dv % kChunkStateTileDv == 0;
}

// A [BH, N, C, d] operand with unit stride in d.
struct ChunkOperand {
  const float* data = nullptr;
  int64_t stride_bh = 0;
  int64_t stride_n = 0;
  int64_t stride_row = 0;
};

struct ChunkStateScanArgs {
  int64_t batch_heads = 0;  // BH
  int64_t chunks = 0;       // N
  int dk = 0;
  int dv = 0;
  bool reverse = false;  // walk n = N-1 .. 0 (the backward pass)
  ChunkOperand base;     // [BH, N, C, dv]
  ChunkOperand left;     // [BH, N, C, dk]
  ChunkOperand right;    // [BH, N, C, dk]
  float left_sign = 1.0f;
  float right_sign = 1.0f;
  const float* extra = nullptr;     // [BH, N, dk, dv], nullptr = zeros
  const float* g_last = nullptr;    // [BH, N]: log of the decay (the kernel takes expf)
  const float* carry_in = nullptr;  // [BH, dk, dv], nullptr = zeros
  float* rows_out = nullptr;        // [BH, N, C, dv]: R_n
  float* carries_out = nullptr;     // [BH, N, dk, dv]: the carry entering chunk n
  float* carry_final = nullptr;     // [BH, dk, dv]: the carry after the last step
  // Optional (both or neither): dot_out[((bh * N + n) * (dv / 16) + tile) * 256 + thread]
  // = decay_n * sum over m < dk / 16 (in order) of dot_with_n[i, j] * X[i, j] with
  // i = thread / 16 + 16 m and j = tile * 16 + thread % 16, X the carry entering chunk n.
  // Summing a (bh, n)'s dv / 16 * 256 partials gives decay_n * <dot_with_n, X>.
  const float* dot_with = nullptr;  // [BH, N, dk, dv]
  float* dot_out = nullptr;         // [BH, N, dv / 16, 256]
  // false: always the FP32 SIMT kernel (the op layer passes the policy's
  // chunk_scan_tensor_cores).
  bool allow_tensor_cores = true;
};

// Whether launch_chunk_state_scan runs the tensor-core kernel for these shapes (given a
// supported shape, a device that grants its dynamic shared memory: 104 KiB for dk = 64,
// 186 KiB for dk = 128, 219 KiB for dk = 256, so sm_90 parts for all three, sm_80 for
// dk = 64 only; elsewhere the SIMT kernel runs).
inline bool chunk_state_scan_uses_tensor_cores(int64_t dk, int64_t dv, bool allow_tensor_cores) {
  return allow_tensor_cores && (dk == 64 || dk == 128 || dk == 256) && dv > 0 &&
         dv % kChunkStateTileDv == 0;
}

// Partials per (bh, n) that dot_out holds.
inline int64_t chunk_state_dot_partials(int64_t dv) {
  return dv / kChunkStateTileDv * kChunkStateThreads;
}

// Returns a cudaError_t as int (cudaSuccess = 0). Caller checks
// chunk_state_scan_supports(dk, dv) first; unsupported shapes return
// cudaErrorInvalidValue without launching.
int launch_chunk_state_scan(const ChunkStateScanArgs& args, CUstream_st* stream);

// Whether the last successful launch_chunk_state_scan in this process ran the tensor-core
// kernel (for tests and benchmarks; relaxed, process-wide).
bool chunk_state_scan_last_used_tensor_cores();

}  // namespace gdr::kernels
