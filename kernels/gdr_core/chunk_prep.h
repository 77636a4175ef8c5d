// The per-chunk preparation of the chunked gated delta rule (steps 1-6 of the spec in the
// shared design note qwen3_5.md) as one CUDA kernel each way: forward, one thread block
// per (batch, value head, chunk), produces exactly the operands of the chunk state scan
// (kernels/gdr_core/chunk_state.h); backward, one block per (batch, value head, chunk) again
// (at dk = 256 one block per SM walking the chunks: Note [Chunk prep wide-head backward]),
// turns their gradients into gradients of q, k, v, g, beta. Plain C++ (no CUDA or torch
// headers).
//
// Per chunk of C = 64 rows (rows past the sequence end are zero: g = beta = q = k = v = 0):
//   q, k = the chunk's rows of key head h / head_group (value head h's key head, as
//          repeat_interleave(head_group) along heads would give), L2-normalised per row
//          when l2_normalize_qk: x * rsqrt(sum(x^2) + kChunkPrepL2Eps) (Note [Fused q/k L2
//          norm] in kernels/gdr_core/chunk_prep_kernel.cuh)
//   Q = scale * q;  G = cumsum(g) (inclusive);  L[i,j] = exp(G_i - G_j) for i >= j, else 0
//   M = strict_lower(beta_i (K K^T) * L);  (I + M) [U | W] = [beta V | beta K * exp(G)]
//   P = (Q K^T) * L (diagonal kept);  Qd = Q * exp(G);  Kend = K * exp(G_last - G)
//   G_last = G_{C-1}
// The backward is derived in ops/gdr_core/chunk_prep_op.h (Note [Chunk prep backward]).
//
// Layouts: q, k [B, T, Hk, dk] (Hk = H / head_group key heads), FP32 or BF16 (one type);
// v [B, T, H, dv], FP32 or BF16 (the same type as q, k, or FP32 with BF16 q, k); unit
// stride in the head dim and any batch / token / head strides (TokenStrides: views such as
// narrow() slices of a wider projection need no copy); g, beta [B, T, H] FP32, any
// strides. Chunk outputs are contiguous FP32: u [B, H, N, C, dv], w, qd, kend
// [B, H, N, C, dk], p [B, H, N, C, C], g_last [B, H, N]. Gradients are contiguous: dv in
// v's type, dg, dbeta FP32, in the input shapes; dq, dk [B, T, H, dk], one row per VALUE
// head: with head_group 1 these are the gradients, in q's type; with head_group > 1 they
// are FP32 partials that the caller sums over each key head's group (no block owns a
// whole group, and no atomics: Note [Chunk prep determinism]). BF16 stores round to
// nearest even, as at::BFloat16 does. The chunk of the last (partial) chunk past T is
// handled in the kernels: no padded copies. The launchers run on the stream they are
// given. Results are deterministic: every block owns disjoint outputs (its chunk's rows),
// every sum is one thread's fixed-order FP32 sum or, in the tensor-core variant's
// products (Gram tiles, dM, the backward's dK / dQ), one warp's fixed sequence of 3xTF32
// mma instructions, no atomics (Note [Chunk
// prep determinism] and Note [Chunk prep on tensor cores] in
// kernels/gdr_core/chunk_prep_kernel.cuh).
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

constexpr int kChunkPrepChunk = 64;  // C: chunk length the kernels are built for
// Threads per block. The forward (83 KiB of shared memory at dk = 128) runs two blocks of
// 8 warps per SM; the backward (up to 227 KiB) fits only one block per SM, so it runs 16
// warps (at most 128 registers per thread) to keep 4 warps per scheduler resident. So does
// the forward where its shared memory leaves room for one block only
// (chunk_prep_forward_threads: dk = 256, 179 KiB at dv = 256).
constexpr int kChunkPrepForwardThreads = 256;
constexpr int kChunkPrepWideForwardThreads = 512;
constexpr int kChunkPrepBackwardThreads = 512;
constexpr int kChunkPrepSlab = 32;  // [U | W] columns staged per step of dM = -dR X^T
// Dynamic shared memory one block may use (H100 / H200: 227 KiB opt-in).
constexpr int64_t kChunkPrepMaxSharedBytes = 227 * 1024;
// eps of the fused q/k L2 norm (the model's, HF's use_qk_l2norm_in_kernel).
constexpr float kChunkPrepL2Eps = 1e-6f;

enum class ChunkPrepInput { kFloat, kBFloat16 };

// Element strides of a [B, T, H] or [B, T, H, d] input (the d stride is 1).
struct TokenStrides {
  int64_t batch = 0;
  int64_t token = 0;
  int64_t head = 0;
};

// Shared memory of one block, in floats; see the layouts in the kernel bodies. Rows read
// along their length in 16-byte loads are padded by four floats (Note [Chunk prep shared
// pitches] in kernels/gdr_core/chunk_prep_kernel.cuh), the C x C matrices also read down a
// column by one, so that threads walking down a column hit distinct banks.
// NOTE: keep in sync with forward_smem and backward_smem, the layouts in
// kernels/gdr_core/chunk_prep_kernel.cuh.
inline int64_t chunk_prep_forward_smem_floats(int64_t dk, int64_t dv) {
  const int64_t C = kChunkPrepChunk;
  // The right-hand side [beta V | beta K exp(G)] lives in registers; a BF16 V is staged
  // first (C x dv BF16, Note [Chunk prep BF16 value staging]).
  return 2 * C * (dk + 4) + C * C + 5 * C + C * dv / 2;
}
// Note [Chunk prep wide-head backward]
// The backward keeps K, Q, the C x C matrices and the C x (dv + dk) panel [dU | dW] (solved
// in place into dR) in shared memory: ~207 KiB at dk = dv = 128, and ~342 KiB at
// dk = dv = 256, past the 227 KiB an SM has. So for dk above kChunkPrepSharedPanelMaxDk the
// panel lives in global memory instead (a per-block scratch slot, L2-resident: one slot is
// C (dv + dk + 4) + C dk floats, 260 KiB at dk = dv = 256), with everything else where it
// was, plus a C x 36 buffer where phase 3 stages each 32-column dR slab next to its X slab
// (fetched one slab ahead, so the product's inner loop reads shared memory only): 215 KiB
// of shared memory at dk = 256, whatever dv. The grid is then persistent:
// scratch_slots blocks (one per SM: the op layer sizes it), block s taking chunks s,
// s + slots, ... in turn and reusing its slot, so the scratch is bounded by the SM count,
// not by the sequence length. Phase 6 runs in two column passes of 128 (its register tiles
// are those of dk = 128); with the fused L2 norm the raw dK of a pass parks in the slot's
// dW columns (each element read and then overwritten by the same thread) and the raw dQ in
// the slot's last C dk floats until the row dots are complete. The arithmetic and its order
// are those of the shared-memory kernel; where a chunk runs does not change its bits.
constexpr int kChunkPrepSharedPanelMaxDk = 128;
// constexpr, so that the kernel bodies share these two definitions (device code calls
// them under nvcc's --expt-relaxed-constexpr, as it does TileMap's).
constexpr bool chunk_prep_backward_uses_scratch(int64_t dk) {
  return dk > kChunkPrepSharedPanelMaxDk;
}
inline int64_t chunk_prep_backward_smem_floats(int64_t dk, int64_t dv) {
  const int64_t C = kChunkPrepChunk;
  // The panel, or for the wide-head backward phase 3's staged dR slab (C x (slab + 4)).
  const int64_t panel =
      chunk_prep_backward_uses_scratch(dk) ? C * (kChunkPrepSlab + 4) : C * (dv + dk + 4);
  return 2 * C * (dk + 4) + panel + 4 * C * (C + 1) + C * (kChunkPrepSlab + 4) + 7 * C;
}
// The forward's block size for these shapes: kChunkPrepForwardThreads where two blocks'
// shared memory fit an SM (228 KiB, 1 KiB of it reserved per block), else
// kChunkPrepWideForwardThreads. The same arithmetic either way (every product element and
// solve column is one thread's fixed-order sum, whichever thread), so the same bits.
constexpr int64_t kChunkPrepSmSharedBytes = 228 * 1024;
inline int chunk_prep_forward_threads(int64_t dk, int64_t dv) {
  return 2 * (chunk_prep_forward_smem_floats(dk, dv) * 4 + 1024) <= kChunkPrepSmSharedBytes
             ? kChunkPrepForwardThreads
             : kChunkPrepWideForwardThreads;
}

// Global scratch floats per slot of the wide-head backward; 0 when it needs none.
constexpr int64_t chunk_prep_backward_scratch_floats(int64_t dk, int64_t dv) {
  const int64_t C = kChunkPrepChunk;
  return chunk_prep_backward_uses_scratch(dk) ? C * (dv + dk + 4) + C * dk : 0;
}

// dk is a template parameter of the backward (register arrays); dv splits into whole
// 16-column groups and must leave the shared memory of both kernels within the limit
// (dk = 64: dv <= 400; dk = 128: dv <= 208; dk = 256: dv <= 624, set by the forward).
inline bool chunk_prep_supports(int64_t dk, int64_t dv) {
  return (dk == 64 || dk == 128 || dk == 256) && dv > 0 && dv % 16 == 0 &&
         chunk_prep_backward_smem_floats(dk, dv) * 4 <= kChunkPrepMaxSharedBytes &&
         chunk_prep_forward_smem_floats(dk, dv) * 4 <= kChunkPrepMaxSharedBytes;
}

// The (q / k, v) type pairs the kernels are built for: (FP32, FP32), (BF16, BF16) and
// (BF16, FP32), the model's (BF16 conv outputs for q and k, FP32 v).
inline bool chunk_prep_supports_inputs(ChunkPrepInput qk, ChunkPrepInput v) {
  return qk == v || (qk == ChunkPrepInput::kBFloat16 && v == ChunkPrepInput::kFloat);
}

struct ChunkPrepShape {
  int64_t batch = 0;       // B
  int64_t tokens = 0;      // T
  int64_t heads = 0;       // H: value heads, one block row per head
  int64_t chunks = 0;      // N = ceil(T / C)
  int64_t head_group = 1;  // H / Hk: value head h reads key head h / head_group of q, k
  int dk = 0;
  int dv = 0;
  float scale = 1.0f;
  bool l2_normalize_qk = false;  // q, k rows normalised on load (Note [Fused q/k L2 norm])
  ChunkPrepInput qk_input = ChunkPrepInput::kFloat;
  ChunkPrepInput v_input = ChunkPrepInput::kFloat;
  // false: always the FP32 SIMT products. The op layer sets it from the execution policy's
  // chunk_prep_tensor_cores (default true, the faster variant; measured: docs/benchmarks.md,
  // Decisions; ops/gdr_core/gdr_core_op_cuda.cc).
  bool allow_tensor_cores = true;
};

// Whether the backward launcher runs the tensor-core (3xTF32 mma.sync) variant of its
// kernel (Note [Chunk prep on tensor cores] in kernels/gdr_core/chunk_prep_kernel.cuh) for these
// shapes: a pure function of the shapes and the switch, so one shape always runs one
// variant. dk in {64, 128} has one (C = 64 and dk split into whole m16n8k8 tiles); the
// wide-head backward (dk = 256) is SIMT only, so dk = 256 runs SIMT both ways. The forward
// is FP32 SIMT in every case. The two variants round differently (both FP32-level), so
// their bits differ; each is deterministic on its own.
inline bool chunk_prep_uses_tensor_cores(int64_t dk, int64_t dv, bool allow_tensor_cores) {
  (void)dv;  // every supported dv (a multiple of 16) fills dM's k-steps of 8 whole
  return allow_tensor_cores && (dk == 64 || dk == 128);
}

struct ChunkPrepForwardArgs {
  ChunkPrepShape shape;
  TokenStrides q_strides, k_strides, v_strides, g_strides, beta_strides;
  const void* q = nullptr;      // [B, T, Hk, dk]
  const void* k = nullptr;      // [B, T, Hk, dk]
  const void* v = nullptr;      // [B, T, H, dv]
  const float* g = nullptr;     // [B, T, H]
  const float* beta = nullptr;  // [B, T, H]
  float* u = nullptr;           // [B, H, N, C, dv]
  float* w = nullptr;           // [B, H, N, C, dk]
  float* qd = nullptr;          // [B, H, N, C, dk]
  float* p = nullptr;           // [B, H, N, C, C]
  float* kend = nullptr;        // [B, H, N, C, dk]
  float* g_last = nullptr;      // [B, H, N]
};

struct ChunkPrepBackwardArgs {
  ChunkPrepShape shape;
  TokenStrides q_strides, k_strides, v_strides, g_strides, beta_strides;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
  const float* u = nullptr;  // the forward's outputs (saved)
  const float* w = nullptr;
  // Upstream gradients in the chunk layouts; nullptr = zeros.
  const float* grad_u = nullptr;
  const float* grad_w = nullptr;
  const float* grad_qd = nullptr;
  const float* grad_p = nullptr;
  const float* grad_kend = nullptr;
  const float* grad_g_last = nullptr;
  // [B, T, H, dk] contiguous, one row per value head: q's (k's) type when head_group is 1,
  // else FP32 partials for the caller to sum over each key head's group.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;      // [B, T, H, dv] contiguous, v's type
  float* dg = nullptr;     // [B, T, H]
  float* dbeta = nullptr;  // [B, T, H]
  // Elements from one token's row of dq, dk and dv to the next (head h of token t of batch
  // b at (b * T + t) * stride + h * d): 0 for the contiguous layouts above (H * dk, H * dv).
  // Non-zero (head_group 1 only) when the three are column slices of one [B, T, stride]
  // buffer, the layout of the model's split of the conv output (Note [Gradients in the
  // inputs' layout] in ops/gdr_core/chunk_prep_op.cc).
  int64_t grad_token_stride = 0;
  // The wide-head backward only (chunk_prep_backward_uses_scratch(dk), Note [Chunk prep
  // wide-head backward]): scratch_slots * chunk_prep_backward_scratch_floats(dk, dv) floats
  // of device memory, 16-byte aligned, and the grid: scratch_slots blocks walk the chunks.
  float* scratch = nullptr;
  int64_t scratch_slots = 0;
};

// Return a cudaError_t as int (cudaSuccess = 0). Callers check chunk_prep_supports first;
// unsupported shapes (and a wide-head backward without scratch) return
// cudaErrorInvalidValue without launching. The backward's variant is
// chunk_prep_uses_tensor_cores(dk, dv, shape.allow_tensor_cores); the forward is SIMT.
int launch_chunk_prep_forward(const ChunkPrepForwardArgs& args, CUstream_st* stream);
int launch_chunk_prep_backward(const ChunkPrepBackwardArgs& args, CUstream_st* stream);

// Whether the last successful chunk prep launch in this process ran the tensor-core variant
// (for tests and benchmarks; relaxed, process-wide).
bool chunk_prep_last_used_tensor_cores();

}  // namespace gdr::kernels
