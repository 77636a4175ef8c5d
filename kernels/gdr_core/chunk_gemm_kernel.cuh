// The batched 3xTF32 tensor-core GEMM of the chunk state pass: the block body (device code
// only; the contract is in kernels/gdr_core/chunk_gemm.h). Included by
// kernels/gdr_core/chunk_gemm.cu, which wraps the body in a __global__ kernel with dynamic shared
// memory, and by the CPU test //tests/ops:gdr_chunk_gemm_kernel_emulation_test, which runs this
// very code with one host thread per CUDA thread. NOTE: keep this file free of other includes
// (besides kernels/common/mma_tf32.cuh, kernels/common/wgmma_tf32.cuh and
// kernels/common/cp_async.cuh) and of CUDA APIs beyond __device__,
// __forceinline__, __syncthreads, threadIdx, blockIdx and fmaf, and of the helpers below and
// in those headers (tf32_round, tf32_as_float, mma_m16n8k8_tf32, the wgmma primitives,
// cp_async_16, cp_async_4, cp_async_wait_all): the emulation test defines the built-ins,
// defines GDR_CHUNK_GEMM_HOST_HELPERS (which implies GDR_MMA_TF32_HOST_HELPERS,
// GDR_WGMMA_TF32_HOST_HELPERS and GDR_CP_ASYNC_HOST_HELPERS) and supplies host stand-ins
// for the helpers (the mma as a warp-collective exchange through a per-warp scratch and
// barrier, the wgmma from the descriptors' shared memory at its wait).
//
// Note [Chunk GEMM tiling]
// Block: one (z, 64-row tile, 64-column tile) of C, the column tile fastest in blockIdx
// (the blocks sharing an A tile run together, so its re-reads hit L2). 128 threads =
// 4 warps in 2 x 2, warp (wm, wn) owning rows 32 wm + [0, 32) and columns 32 wn + [0, 32)
// of the tile: 2 x 4 mma tiles of 16 x 8, each with the three 3xTF32 accumulators (96
// FP32 registers), summing over the whole K of every product itself (no split-K, no
// cross-warp reduction: Note [Chunk GEMM determinism] in kernels/gdr_core/chunk_gemm.h).
// K is walked in slabs of up to 32 (a product's last slab may be 8, 16 or 24 deep), all
// of product 0's slabs, then product 1's. Per slab:
//   1. cp.async the slab's A [64 x ks] and B [ks x 64] FP32 tiles from global memory into
//      a raw stage, as stored (16-byte copies when the operand's pointer and strides allow,
//      else 4-byte ones); two raw stages, so slab s + 1 streams in during slab s's steps
//      2 and 3;
//   2. split: every raw element is split once into TF32 big / small (Note [3xTF32
//      products] in kernels/common/mma_tf32.cuh) and stored into the big and small planes in
//      mma-fragment order, one 16-byte word group per lane: A plane group (kstep, m-tile,
//      lane) holds the lane's (a0, a1, a2, a3), B plane group (kstep, n-tile pair, lane)
//      the lane's (b0, b1) of both n-tiles of the pair. Warp w splits A's m-tile w and B's
//      n-tile pair w (16 columns) for every k-step of the slab: a thread gathers its four
//      values from the raw stage with 32-bit loads and stores two 16-byte groups;
//   3. mma: per k-step a warp loads its 2 A groups and 2 B pair groups per plane (8
//      16-byte loads) and issues 2 x 4 x 3 mma.sync.
// Splitting once per block costs shared-memory traffic: the planes hold two words per
// element, so a slab moves 128 KiB through shared memory (kernels/gdr_core/chunk_gemm.h's
// roofline). Splitting FP32 fragments in each warp at the load instead (as the scan kernel
// does for its staged operands) would move ~2.7x less for twice the conversions (each
// element is read by two warps): the A/B to try if the GPU shows this kernel bound by
// shared memory.
// Barriers: wait + barrier before step 2 (the slab landed; the previous step 3 is done
// with the planes), barrier before step 3 (the planes are written). One plane stage and
// two raw stages: 68 KiB of shared memory, three blocks (12 warps) per SM on sm_90.
// Steps 2 and 3 as above are the mma.sync path's; the wgmma path's are in Note [Chunk
// GEMM on wgmma].
// Bank conflicts: raw stages keep the stored layout with pitch 36 floats where the
// fragment's row index g = lane / 4 runs down the stage's rows (A [m][k], B^T [n][k]) and
// 72 where it runs along them (A^T [k][m], B [k][n]), so the split's gathers hit bank
// 4 g + t or 8 g + t (+ const), 32 distinct banks (t = lane % 4); every 16-byte plane
// access is 32 consecutive lanes' groups (the minimum 4 wavefronts). The cp.async rows
// are whole 128-byte lines where the tile is full.
// Partial tiles: N a multiple of 16, so a column tile's valid width is whole n-tile pairs;
// pairs past N are neither loaded nor split nor multiplied nor stored (warp-uniform
// branches). M is a multiple of 64 and every K of 8 (whole k-steps).
// Epilogue: C = alpha * (big + (lo_a + lo_b)) [+ fmaf(beta, C, .)], straight from the
// accumulators: each lane writes two adjacent columns (one 8-byte store where C's pointer
// and strides are even, else two 4-byte ones).
//
// Note [Chunk GEMM on wgmma]
// Where the device code targets sm_90a (the H100 / H200 machine code of this build), the
// block's 128 threads are one warpgroup and step 3 runs on wgmma: per k-step three
// m64n64k8 TF32 (lo_a += A_small B_big, lo_b += A_big B_small, big += A_big B_big: Note
// [3xTF32 products]) that read the big / small planes straight from shared memory, the
// slab's twelve committed as one batch and waited for before the next barrier (after which
// the planes are rewritten). mma.sync made each warp load its fragments from the planes
// itself (64 KiB of shared-memory loads per slab, on the L1/TEX pipe that the profiles show
// busiest); here 24 mma.sync per warp and k-step become 3 instructions per warpgroup. Steps 1 (the
// cp.async raw stages) and the barriers are the mma.sync path's; the split of step 2 writes
// the planes in wgmma's K-major layout (Note [wgmma K-major operand layout] in
// kernels/common/wgmma_tf32.cuh: A's rows and B^T's rows, i.e. B's columns, in core matrices of
// 8 rows x 4 k): warp w takes rows 32 (w % 2) + lane and k = 8 ks + 4 (w / 2) .. + 3 of
// every k-step ks, one 16-byte group per operand and plane, and fences its stores for the
// async proxy. A short slab's missing k-steps are split as zeros, so every slab issues all
// twelve wgmmas with no branch between them (the compiler fences wgmma at branches).
// Every output element is still three chains of tensor-core steps over k in increasing
// order, added once at the end, with no cross-warp reduction: deterministic. On sm_90a the
// two paths give the same bits (every element of every state-pass product,
// //tests/ops:gdr_chunk_gemm_gpu_test): one m64n64k8 step accumulates its eight products
// as eight m16n8k8 steps do, and the padding adds exact zeros (an accumulator that starts
// at +0 never holds -0 under round-to-nearest), so the GEMM's bits, and the training
// run's, are those of the mma.sync path. Other targets (sm_80, sm_86,
// and the compute_90 PTX that newer GPUs JIT) run the mma.sync path. The CPU emulation
// test runs both paths against each other and an FP64 loop, its wgmma stand-in completing
// each batch at the latest moment allowed and failing when an operand changed in flight.
// This path is the faster of the two for the state pass's GEMMs (measured: docs/benchmarks.md,
// Decisions). A variant that loads the slabs straight into registers (no raw stage) and
// splits them into two alternating plane buffers, so that a slab's wgmmas overlap the next
// slab's split, is slower: its 16-byte loads each touch 32 rows, where cp.async moves whole
// 128-byte lines. So is this path with two plane buffers and the same overlap: 100 KiB of
// shared memory leaves two blocks per SM instead of three, which costs more than the
// overlap gains.
#pragma once

#include "kernels/gdr_core/chunk_gemm.h"

#ifdef GDR_CHUNK_GEMM_HOST_HELPERS
#define GDR_MMA_TF32_HOST_HELPERS
#define GDR_CP_ASYNC_HOST_HELPERS
#define GDR_WGMMA_TF32_HOST_HELPERS
#endif
#include "kernels/common/cp_async.cuh"
#include "kernels/common/mma_tf32.cuh"
#include "kernels/common/wgmma_tf32.cuh"

namespace gdr::kernels::chunk_gemm_detail {

using mma_tf32::Acc3;
using mma_tf32::mma_3xtf32;
using mma_tf32::split_tf32;
using mma_tf32::total;
using mma_tf32::zero;

constexpr int kTileM = kChunkGemmTileM;
constexpr int kTileN = kChunkGemmTileN;
constexpr int kSlabK = kChunkGemmSlabK;
constexpr int kThreads = kChunkGemmThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kKSteps = kSlabK / 8;  // k-steps of a full slab
static_assert(kTileM == 64 && kTileN == 64 && kSlabK == 32 && kThreads == 128,
              "the warp split and the stage geometry assume these");

// Raw stages: a [64][32] tile (rows along M or N) with pitch 36, or a [32][64] tile (rows
// along K) with pitch 72: the same 2304 floats either way.
constexpr int kPitchKInner = kSlabK + 4;
constexpr int kPitchKOuter = kTileM + 8;
constexpr int kRawFloats = kTileM * kPitchKInner;
static_assert(kRawFloats == kSlabK * kPitchKOuter, "both raw layouts fill one stage");
// Planes: kKSteps x 4 fragment groups (m-tiles of A, n-tile pairs of B) x 32 lanes x 4 words.
constexpr int kPlaneWords = kKSteps * 4 * 32 * 4;
static_assert(kPlaneWords == kTileM * kSlabK, "a plane holds one slab of one operand");

// Shared memory, in floats: raw stage s (A then B) at s * 2 kRawFloats, then the planes.
constexpr int kRawA = 0;
constexpr int kRawB = kRawFloats;
constexpr int kABig = 4 * kRawFloats;
constexpr int kASmall = kABig + kPlaneWords;
constexpr int kBBig = kASmall + kPlaneWords;
constexpr int kBSmall = kBBig + kPlaneWords;
constexpr int kSharedFloats = kBSmall + kPlaneWords;
static_assert(kSharedFloats * 4 == kChunkGemmSharedBytes, "kernels/gdr_core/chunk_gemm.h");

// Four 32-bit words (one 16-byte shared access); two floats (one 8-byte global store).
struct alignas(16) U32x4 {
  uint32_t x, y, z, w;
};
struct alignas(8) F32x2 {
  float x, y;
};
struct alignas(16) F32x4 {
  float x, y, z, w;
};

// Copies rows [0, rows) x columns [0, cols) of a row-major global tile (first element src,
// row stride `stride`) into a raw stage of kRows x kCols (2048 floats) with pitch `pitch`,
// with 16-byte cp.async when `quads` (src 16-byte aligned, stride a multiple of 4; cols
// is a multiple of 8 here) else 4-byte ones. Thread tid copies the quads (elements)
// tid + kThreads u of the full tile, those inside rows x cols.
template <int kRows, int kCols>
__device__ __forceinline__ void stage_tile(const float* src, int64_t stride, int rows, int cols,
                                           bool quads, float* dst, int pitch, int tid) {
  static_assert(kRows * kCols == kThreads * 16, "16 floats per thread");
  if (quads) {
    constexpr int kQuadsPerRow = kCols / 4;
    constexpr int kRowsPerPass = kThreads / kQuadsPerRow;
    const int row = tid / kQuadsPerRow, col = (tid % kQuadsPerRow) * 4;
    if (col < cols) {
#pragma unroll
      for (int u = 0; u < kRows / kRowsPerPass; ++u) {
        const int r = row + u * kRowsPerPass;
        if (r < rows) cp_async_16(dst + r * pitch + col, src + r * stride + col);
      }
    }
  } else {
    constexpr int kRowsPerPass = kThreads / kCols;
    const int row = tid / kCols, col = tid % kCols;
    if (col < cols) {
#pragma unroll 4
      for (int u = 0; u < kRows / kRowsPerPass; ++u) {
        const int r = row + u * kRowsPerPass;
        if (r < rows) cp_async_4(dst + r * pitch + col, src + r * stride + col);
      }
    }
  }
}

// Whether an operand's 16-byte copies are legal (pointer and strides in whole quads).
__device__ __forceinline__ bool quad_aligned(const float* data, int64_t stride_batch,
                                             int64_t stride_row) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && stride_batch % 4 == 0 &&
         stride_row % 4 == 0;
}

// Splits x0..x3 and stores them as one group of the big and of the small plane.
__device__ __forceinline__ void put_group(uint32_t* big, uint32_t* small, int group, float x0,
                                          float x1, float x2, float x3) {
  U32x4 b, s;
  split_tf32(x0, b.x, s.x);
  split_tf32(x1, b.y, s.y);
  split_tf32(x2, b.z, s.z);
  split_tf32(x3, b.w, s.w);
  reinterpret_cast<U32x4*>(big)[group] = b;
  reinterpret_cast<U32x4*>(small)[group] = s;
}

__device__ __forceinline__ U32x4 get_group(const uint32_t* plane, int group) {
  return reinterpret_cast<const U32x4*>(plane)[group];
}

// ----------------------------------------------------------------------------
// The block bodies (the __global__ wrapper is in kernels/gdr_core/chunk_gemm.cu)

// Whether this compilation pass has the warpgroup path (Note [Chunk GEMM on wgmma]):
// sm_90a device code. The CPU emulation test instantiates both paths itself.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaPass = true;
#else
constexpr bool kWgmmaPass = false;
#endif

// The block's tile of C (the column tile fastest in blockIdx) and its slabs: product 0's
// k in steps of kSlabK, then product 1's.
struct BlockTile {
  int64_t z;
  int m0, n0;
  int n_valid;  // columns of the tile inside N: a multiple of 16
  int k0, k1, slabs0, slabs;

  __device__ __forceinline__ explicit BlockTile(const ChunkGemmArgs& args) {
    const int col_tiles = (args.n + kTileN - 1) / kTileN, row_tiles = args.m / kTileM;
    const int64_t block = blockIdx.x;
    const int col_tile = static_cast<int>(block % col_tiles);
    const int row_tile = static_cast<int>(block / col_tiles % row_tiles);
    z = block / col_tiles / row_tiles;
    m0 = row_tile * kTileM;
    n0 = col_tile * kTileN;
    n_valid = args.n - n0 < kTileN ? args.n - n0 : kTileN;
    k0 = args.product[0].k;
    k1 = args.products > 1 ? args.product[1].k : 0;
    slabs0 = (k0 + kSlabK - 1) / kSlabK;
    slabs = slabs0 + (k1 + kSlabK - 1) / kSlabK;
  }
  __device__ __forceinline__ int slab_depth(int s) const {
    const int rest = s < slabs0 ? k0 - s * kSlabK : k1 - (s - slabs0) * kSlabK;
    return rest < kSlabK ? rest : kSlabK;
  }
  __device__ __forceinline__ int slab_first_k(int s) const {
    return (s < slabs0 ? s : s - slabs0) * kSlabK;
  }
};

// The epilogue of both paths: C[row][col, col + 1] = alpha * sum [+ fmaf(beta, C, .)], one
// 8-byte store where C's pointer and strides are even, else two 4-byte ones.
__device__ __forceinline__ void store_pair(const ChunkGemmArgs& args, int64_t z, int row, int col,
                                           float sum0, float sum1) {
  float* const out = args.c + z * args.c_stride_batch + row * args.c_stride_row + col;
  float v0 = args.alpha * sum0;
  float v1 = args.alpha * sum1;
  if (args.beta != 0.0f) {
    v0 = fmaf(args.beta, out[0], v0);
    v1 = fmaf(args.beta, out[1], v1);
  }
  const bool pairs_aligned = reinterpret_cast<uintptr_t>(args.c) % 8 == 0 &&
                             args.c_stride_batch % 2 == 0 && args.c_stride_row % 2 == 0;
  if (pairs_aligned) {
    *reinterpret_cast<F32x2*>(out) = F32x2{v0, v1};
  } else {
    out[0] = v0;
    out[1] = v1;
  }
}

// Slab s of the block's operands into raw stage `stage` by cp.async (Note [Chunk GEMM
// tiling], step 1; selects the product's fields by value: no dynamic indexing of the
// kernel parameters).
template <bool TA, bool TB>
__device__ __forceinline__ void stage_raw_slab(const ChunkGemmArgs& args, const BlockTile& tile,
                                               int s, int stage, float* smem, int tid) {
  const bool second = s >= tile.slabs0;
  const ChunkGemmOperand a = second ? args.product[1].a : args.product[0].a;
  const ChunkGemmOperand b = second ? args.product[1].b : args.product[0].b;
  const int kk = tile.slab_first_k(s);
  const int depth = tile.slab_depth(s);
  const int m0 = tile.m0, n0 = tile.n0, n_valid = tile.n_valid;
  float* const raw_a = smem + kRawA + stage * 2 * kRawFloats;
  float* const raw_b = smem + kRawB + stage * 2 * kRawFloats;
  const float* a_src = a.data + tile.z * a.stride_batch;
  const float* b_src = b.data + tile.z * b.stride_batch;
  const bool a_quads = quad_aligned(a.data, a.stride_batch, a.stride_row);
  const bool b_quads = quad_aligned(b.data, b.stride_batch, b.stride_row);
  if (TA) {  // A stored [K][M]: rows kk.., columns m0..
    stage_tile<kSlabK, kTileM>(a_src + kk * a.stride_row + m0, a.stride_row, depth, kTileM, a_quads,
                               raw_a, kPitchKOuter, tid);
  } else {  // A stored [M][K]: rows m0.., columns kk..
    stage_tile<kTileM, kSlabK>(a_src + m0 * a.stride_row + kk, a.stride_row, kTileM, depth, a_quads,
                               raw_a, kPitchKInner, tid);
  }
  if (TB) {  // B stored [N][K]: rows n0.., columns kk..
    stage_tile<kTileN, kSlabK>(b_src + n0 * b.stride_row + kk, b.stride_row, n_valid, depth,
                               b_quads, raw_b, kPitchKInner, tid);
  } else {  // B stored [K][N]: rows kk.., columns n0..
    stage_tile<kSlabK, kTileN>(b_src + kk * b.stride_row + n0, b.stride_row, depth, n_valid,
                               b_quads, raw_b, kPitchKOuter, tid);
  }
}

// The mma.sync path (Note [Chunk GEMM tiling]). TA / TB: args.transpose_a /
// args.transpose_b. smem: kSharedFloats floats, 16-byte aligned.
template <bool TA, bool TB>
__device__ __forceinline__ void chunk_gemm_block_mma(const ChunkGemmArgs& args, float* smem) {
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const BlockTile tile(args);
  const int64_t z = tile.z;
  const int m0 = tile.m0, n0 = tile.n0, n_valid = tile.n_valid, slabs = tile.slabs;
  const int pairs = n_valid / 16;  // valid n-tile pairs

  uint32_t* const a_big = reinterpret_cast<uint32_t*>(smem + kABig);
  uint32_t* const a_small = reinterpret_cast<uint32_t*>(smem + kASmall);
  uint32_t* const b_big = reinterpret_cast<uint32_t*>(smem + kBBig);
  uint32_t* const b_small = reinterpret_cast<uint32_t*>(smem + kBSmall);

  auto stage_slab = [&](int s, int stage) {
    stage_raw_slab<TA, TB>(args, tile, s, stage, smem, tid);
  };

  // The raw stage's slab into the planes (Note [Chunk GEMM tiling], step 2): warp w
  // splits A's m-tile w and B's n-tile pair w, k-step by k-step.
  auto split_slab = [&](int stage, int ksteps) {
    const float* const raw_a = smem + kRawA + stage * 2 * kRawFloats;
    const float* const raw_b = smem + kRawB + stage * 2 * kRawFloats;
    // op(A)[r][k] and op(B)[k][c] in the raw stage (r, c within the tile, k within the
    // slab).
    auto a_at = [&](int r, int k) {
      return TA ? raw_a[k * kPitchKOuter + r] : raw_a[r * kPitchKInner + k];
    };
    auto b_at = [&](int k, int c) {
      return TB ? raw_b[c * kPitchKInner + k] : raw_b[k * kPitchKOuter + c];
    };
    const int r = 16 * warp + g, c = 16 * warp + g;
    const bool pair_valid = warp < pairs;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      if (ks < ksteps) {
        const int k = 8 * ks + t;
        const int group = (ks * 4 + warp) * 32 + lane;
        put_group(a_big, a_small, group, a_at(r, k), a_at(r + 8, k), a_at(r, k + 4),
                  a_at(r + 8, k + 4));
        if (pair_valid) {
          put_group(b_big, b_small, group, b_at(k, c), b_at(k + 4, c), b_at(k, c + 8),
                    b_at(k + 4, c + 8));
        }
      }
    }
  };

  const int wm = warp / 2, wn = warp % 2;
  Acc3 acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) zero(acc[i][j]);
  }
  // This warp's n-tile pairs 2 wn + q (q = 0, 1) that lie inside N.
  const bool pair_ok[2] = {2 * wn < pairs, 2 * wn + 1 < pairs};

  // The planes into the accumulators (step 3).
  auto mma_slab = [&](int ksteps) {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      if (ks < ksteps) {
        uint32_t bb[4][2], bs[4][2];  // big / small B fragments of n-tiles 4 wn + j
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int group = (ks * 4 + 2 * wn + q) * 32 + lane;
          const U32x4 vb = get_group(b_big, group), vs = get_group(b_small, group);
          bb[2 * q][0] = vb.x;
          bb[2 * q][1] = vb.y;
          bb[2 * q + 1][0] = vb.z;
          bb[2 * q + 1][1] = vb.w;
          bs[2 * q][0] = vs.x;
          bs[2 * q][1] = vs.y;
          bs[2 * q + 1][0] = vs.z;
          bs[2 * q + 1][1] = vs.w;
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int group = (ks * 4 + 2 * wm + i) * 32 + lane;
          const U32x4 vb = get_group(a_big, group), vs = get_group(a_small, group);
          const uint32_t ab[4] = {vb.x, vb.y, vb.z, vb.w};
          const uint32_t as[4] = {vs.x, vs.y, vs.z, vs.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (pair_ok[j / 2]) mma_3xtf32(acc[i][j], ab, as, bb[j], bs[j]);
          }
        }
      }
    }
  };

  stage_slab(0, 0);
  for (int s = 0; s < slabs; ++s) {
    const int stage = s % 2;
    cp_async_wait_all();
    __syncthreads();  // slab s landed; the previous mma_slab is done with the planes
    if (s + 1 < slabs) stage_slab(s + 1, stage ^ 1);  // its stage was last read by split s - 1
    const int ksteps = tile.slab_depth(s) / 8;
    split_slab(stage, ksteps);
    __syncthreads();  // the planes hold slab s
    mma_slab(ksteps);
  }

  // Epilogue: accumulator element e of tile (i, j) is row 32 wm + 16 i + g + 8 (e / 2),
  // column 32 wn + 8 j + 2 t + e % 2 of the block's tile.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (!pair_ok[j / 2]) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        store_pair(args, z, m0 + 32 * wm + 16 * i + g + 8 * h, n0 + 32 * wn + 8 * j + 2 * t,
                   total(acc[i][j], 2 * h), total(acc[i][j], 2 * h + 1));
      }
    }
  }
}

// The wgmma path (Note [Chunk GEMM on wgmma]). TA / TB: args.transpose_a /
// args.transpose_b. smem: kSharedFloats floats, 16-byte aligned (the same raw stages and
// planes as the mma.sync path, the planes in wgmma's layout).
template <bool TA, bool TB>
__device__ __forceinline__ void chunk_gemm_block_wgmma(const ChunkGemmArgs& args, float* smem) {
  // Unqualified calls: the CPU emulation test supplies the primitives in the global
  // namespace.
  using namespace wgmma_tf32;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const BlockTile tile(args);
  uint32_t* const a_big = reinterpret_cast<uint32_t*>(smem + kABig);
  uint32_t* const a_small = reinterpret_cast<uint32_t*>(smem + kASmall);
  uint32_t* const b_big = reinterpret_cast<uint32_t*>(smem + kBBig);
  uint32_t* const b_small = reinterpret_cast<uint32_t*>(smem + kBSmall);
  // This thread's share of the split: rows `row` of A and of B^T (B's column), k = 8 ks +
  // 4 kc .. + 3 of every k-step ks.
  const int row = 32 * (warp % 2) + lane, kc = warp / 2;
  const bool column_valid = row < tile.n_valid;

  // The raw stage's slab into the planes: four k of one row per k-step and operand (one
  // 16-byte load where k runs along the stage's rows, pitch 36: every 8 lanes hit 8
  // distinct bank quads; else four loads, pitch 72: 32 distinct banks), one 16-byte store
  // per operand and plane (8 lanes to a core matrix: conflict-free), fenced for the async
  // proxy. The k-steps past a short slab's depth are zeros, so that every slab issues all
  // its wgmmas with no branch between them (the compiler fences wgmma at branches); the
  // zero products leave the sums' bits as they are (an accumulator that starts at +0 never
  // holds -0 under round-to-nearest, and x + 0 = x). Columns past N are left as they are:
  // they only reach accumulator columns that are not stored.
  auto split_slab = [&](int stage, int ksteps) {
    const float* const raw_a = smem + kRawA + stage * 2 * kRawFloats;
    const float* const raw_b = smem + kRawB + stage * 2 * kRawFloats;
    auto quad = [](const float* raw, bool k_inner, int r, int k) {
      if (k_inner) return *reinterpret_cast<const F32x4*>(raw + r * kPitchKInner + k);
      const float* p = raw + k * kPitchKOuter + r;
      return F32x4{p[0], p[kPitchKOuter], p[2 * kPitchKOuter], p[3 * kPitchKOuter]};
    };
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const int k = 8 * ks + 4 * kc;
      const int group = (ks * kOperandWords + kmajor_word(row, 4 * kc)) / 4;
      const bool inside = ks < ksteps;
      const F32x4 a = inside ? quad(raw_a, !TA, row, k) : F32x4{0.0f, 0.0f, 0.0f, 0.0f};
      put_group(a_big, a_small, group, a.x, a.y, a.z, a.w);
      if (column_valid) {
        const F32x4 b = inside ? quad(raw_b, TB, row, k) : F32x4{0.0f, 0.0f, 0.0f, 0.0f};
        put_group(b_big, b_small, group, b.x, b.y, b.z, b.w);
      }
    }
    fence_operands_for_wgmma();
  };

  // Three m64n64 accumulators of the warpgroup (Note [3xTF32 products]).
  float big[32], lo_a[32], lo_b[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) big[i] = lo_a[i] = lo_b[i] = 0.0f;
  // The planes into the accumulators: twelve wgmmas, one batch, waited for (the planes
  // are rewritten after the next barrier).
  auto mma_slab = [&] {
    fence_accumulators(big);
    fence_accumulators(lo_a);
    fence_accumulators(lo_b);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {  // short slabs are zero-padded (split_slab)
      const int offset = ks * kOperandWords;
      const uint64_t ab = kmajor_descriptor(shared_address(a_big + offset));
      const uint64_t as = kmajor_descriptor(shared_address(a_small + offset));
      const uint64_t bb = kmajor_descriptor(shared_address(b_big + offset));
      const uint64_t bs = kmajor_descriptor(shared_address(b_small + offset));
      wgmma_m64n64k8_tf32(lo_a, as, bb);
      wgmma_m64n64k8_tf32(lo_b, ab, bs);
      wgmma_m64n64k8_tf32(big, ab, bb);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(big);
    fence_accumulators(lo_a);
    fence_accumulators(lo_b);
  };

  stage_raw_slab<TA, TB>(args, tile, 0, 0, smem, tid);
  for (int s = 0; s < tile.slabs; ++s) {
    const int stage = s % 2;
    cp_async_wait_all();
    __syncthreads();  // slab s landed; every warp's wgmmas are done with the planes
    if (s + 1 < tile.slabs) stage_raw_slab<TA, TB>(args, tile, s + 1, stage ^ 1, smem, tid);
    split_slab(stage, tile.slab_depth(s) / 8);
    __syncthreads();  // the planes hold slab s
    mma_slab();
  }

  // Register 4 c + 2 h + e: row 16 warp + g + 8 h, column 8 c + 2 t + e.
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (8 * c >= tile.n_valid) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 4 * c + 2 * h;
      store_pair(args, tile.z, tile.m0 + 16 * warp + g + 8 * h, tile.n0 + 8 * c + 2 * t,
                 big[e] + (lo_a[e] + lo_b[e]), big[e + 1] + (lo_a[e + 1] + lo_b[e + 1]));
    }
  }
}

// TA / TB: args.transpose_a / args.transpose_b; W: the wgmma path instead of mma.sync.
template <bool TA, bool TB, bool W>
__device__ __forceinline__ void chunk_gemm_block(const ChunkGemmArgs& args, float* smem) {
  if constexpr (W) {
    chunk_gemm_block_wgmma<TA, TB>(args, smem);
  } else {
    chunk_gemm_block_mma<TA, TB>(args, smem);
  }
}

}  // namespace gdr::kernels::chunk_gemm_detail
