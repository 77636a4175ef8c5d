// Batched FP32 GEMMs on tensor cores at FP32-level accuracy (3xTF32) for the carry-free
// products of the chunk state pass (ops/gdr_core/chunk_state_op.cc: O = Qd S + P V after the
// forward scan; P^T dO, Qd^T dO before the backward scan and dW, dQd, dP, dKend after it),
// which cuBLAS runs as FP32 FFMA kernels, a large share of the core's forward+backward
// (measured: docs/benchmarks.md, GDR core). Plain C++ (no CUDA or torch headers).
//
// For z in [0, batch):
//   C_z = alpha * sum over p < products of op(A_pz) op(B_pz)   [+ beta * C_z]
// op(A_p) is M x K_p: A_p stored [M][K_p] (transpose_a false) or [K_p][M] (true, op = ^T);
// op(B_p) is K_p x N: B_p stored [K_p][N] or [N][K_p] (transpose_b). One or two products,
// both with the same op on A and on B (all the state pass needs; the kernel is
// instantiated per pair), summed into the same accumulators: all of product 0's k, then
// all of product 1's, one fixed order (O = Qd S + P V as one GEMM). Every matrix is FP32,
// row-major with unit column stride, a row stride and a batch stride (so views such as
// narrow() slices and chunk-merged [B, H, N, r, c] tensors need no copy). beta == 0 does
// not read C (an uninitialised output is fine); otherwise C = fmaf(beta, C, alpha * sum).
//
// Note [Chunk GEMM determinism]: every element of C is one warp's fixed sequence of
// mma.sync instructions over the whole K of every product (three accumulators per 16 x 8
// tile, each walking k in increasing order, added once as big + (lo_a + lo_b): Note
// [3xTF32 products] in kernels/common/mma_tf32.cuh), then alpha and beta. No split-K, no atomics,
// no cross-warp or cross-block reduction, and a grid that is a pure function of the
// shapes: the same inputs give the same bits on every run, stream and load. The bits
// differ from cuBLAS's FP32 GEMM (another rounding; both FP32-level).
//
// Tiling (kernels/gdr_core/chunk_gemm_kernel.cuh, Note [Chunk GEMM tiling]): one block per
// (z, 64-row tile, 64-column tile) of C, 4 warps of 32 x 32, K staged in slabs of 32 with
// cp.async double buffering, each staged element split into TF32 big / small once per
// block. On sm_90a (Note [Chunk GEMM on wgmma]) the block is one warpgroup on wgmma, with
// the same cp.async stages and the planes split into wgmma's K-major layout.
//
// Expected roofline (H100 SXM / H200, 132 SMs, ~1.8 GHz; estimates, not measured): mma.sync
// m16n8k8 TF32 is 2048 FLOP, and the dense TF32 peak (495 TFLOP/s) is one such mma per SM
// per clock, of which mma.sync reaches ~60-70% on sm_90 (wgmma the rest). 3 mmas per
// product make the FP32-equivalent ceiling ~165 TFLOP/s, ~100-110 for mma.sync, against 67
// for FP32 FFMA (cuBLAS reaches far less on these small products). A 64 x 64 output tile reads
// 4 * 64 * K bytes of A and of B and writes 16 KiB of C for 2 * 64 * 64 * K FLOP: 11-14
// FLOP/byte for K = 64 .. 256 (K summed over the products), under the H200's ridge of
// ~34 (165 TFLOP/s over 4.8 TB/s), so the products are HBM-bound: per (b, h, chunk) at
// dk = dv = 128 the forward GEMM moves 176 KiB (Qd, S, P, V in, O out) and the backward's
// six 672 KiB, i.e. 3.4 GiB at T = 16384, H = 16, ~0.76 ms at 4.8 TB/s (a column tile's
// re-read of its A tile is an L2 hit); cuBLAS's FP32 GEMMs: docs/benchmarks.md, GDR core.
// The next ceiling is shared-memory bandwidth (128 B per clock per SM): per 32-deep slab a
// block moves 128 KiB through it (16 KiB cp.async in, 16 KiB gathered by the split, 32 KiB
// of planes stored, 64 KiB of fragments loaded) for 384 mmas, i.e. ~0.375 mma per clock
// per SM, ~62 TFLOP/s FP32-equivalent, ~0.9 ms for the same products: the two ceilings are
// close, so expect ~1 ms, not the HBM floor.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

constexpr int kChunkGemmTileM = 64;       // rows of C per block
constexpr int kChunkGemmTileN = 64;       // columns of C per block
constexpr int kChunkGemmSlabK = 32;       // k per staged slab
constexpr int kChunkGemmThreads = 128;    // 4 warps, 32 x 32 of C each
constexpr int kChunkGemmMaxProducts = 2;  // products summed into one C

// One operand (or C): element (z, r, c) at data[z * stride_batch + r * stride_row + c].
struct ChunkGemmOperand {
  const float* data = nullptr;
  int64_t stride_batch = 0;
  int64_t stride_row = 0;
};

// One product op(A) op(B) with contraction length k.
struct ChunkGemmProduct {
  ChunkGemmOperand a;  // [M][k], or [k][M] with transpose_a
  ChunkGemmOperand b;  // [k][N], or [N][k] with transpose_b
  int k = 0;
};

struct ChunkGemmArgs {
  int64_t batch = 0;
  int m = 0;  // rows of C, a multiple of kChunkGemmTileM
  int n = 0;  // columns of C, a multiple of 16
  bool transpose_a = false;
  bool transpose_b = false;
  int products = 1;  // 1 or 2
  ChunkGemmProduct product[kChunkGemmMaxProducts];
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: C is written without being read
  float* c = nullptr;
  int64_t c_stride_batch = 0;
  int64_t c_stride_row = 0;
  // Where the device code is sm_90a (H100 / H200), the products run on wgmma (Note [Chunk
  // GEMM on wgmma] in kernels/gdr_core/chunk_gemm_kernel.cuh); false keeps them on mma.sync,
  // the path of every other target. Both are deterministic; their bits may differ.
  bool allow_wgmma = true;
};

// Blocks of the launch: batch * (m / 64) * ceil(n / 64).
inline int64_t chunk_gemm_blocks(const ChunkGemmArgs& args) {
  return args.batch * (args.m / kChunkGemmTileM) *
         ((args.n + kChunkGemmTileN - 1) / kChunkGemmTileN);
}

// The shapes the kernel computes: M a positive multiple of 64, N of 16, every product's
// K of 8, one or two products, a batch that fits one 1-D grid (< 2^31 blocks). Anything
// else the op layer leaves to at::bmm.
inline bool chunk_gemm_supports(const ChunkGemmArgs& args) {
  if (args.products < 1 || args.products > kChunkGemmMaxProducts) return false;
  for (int p = 0; p < args.products; ++p) {
    if (args.product[p].k <= 0 || args.product[p].k % 8 != 0) return false;
  }
  return args.batch >= 0 && args.m > 0 && args.m % kChunkGemmTileM == 0 && args.n > 0 &&
         args.n % 16 == 0 && chunk_gemm_blocks(args) <= 0x7fffffffLL;
}

// Dynamic shared memory of one block (raw FP32 slabs, two stages, and the TF32 planes).
constexpr int kChunkGemmSharedBytes =
    (4 * kChunkGemmTileM * (kChunkGemmSlabK + 4) + 4 * kChunkGemmTileM * kChunkGemmSlabK) * 4;

// Launches the GEMM on `stream`. Returns a cudaError_t as int (cudaSuccess = 0);
// unsupported arguments (chunk_gemm_supports false, null pointers) return
// cudaErrorInvalidValue without launching; batch = 0 launches nothing.
int launch_chunk_gemm(const ChunkGemmArgs& args, CUstream_st* stream);

// Successful launch_chunk_gemm calls that launched a kernel in this process (for tests
// and benchmarks: whether the op layer took this path; relaxed, process-wide).
int64_t chunk_gemm_launch_count();

}  // namespace gdr::kernels
