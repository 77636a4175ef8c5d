// The chunk state scan kernel itself (device code only; see kernels/gdr_chunk_state.h for
// the recurrence and layouts). Included by kernels/gdr_chunk_state.cu, and by the CPU
// test //tests/ops:gdr_chunk_state_kernel_emulation_test, which supplies host stand-ins
// for the CUDA built-ins (__global__, __shared__, __syncthreads, threadIdx, blockIdx) and
// runs this very code with one host thread per CUDA thread, so the indexing and barriers
// are checked on machines without a GPU.
// NOTE: keep this file free of other includes and of CUDA APIs beyond those built-ins and
// fmaf: the emulation test defines exactly those.
//
// Note [Chunk state scan determinism]
// One block owns one (batch*head, 16-column dv tile) and walks every chunk of it; the
// carry of that tile never leaves the block between chunks. The recurrence only
// contracts over dk (left @ X) and over the chunk rows (right^T @ R), never over dv, so
// dv tiles are independent: no cross-block reduction exists, hence no atomics and no
// scratch partials. Inside a block, each output element is accumulated by one thread in
// a fixed index order. The same inputs therefore give the same bits on every run,
// stream and load. Keep it that way: the quantities that do contract over dv (O, dW,
// dQd, dKend, dP, dGlast) are computed by the op layer with batched matmuls / ATen sums
// after the scan (ops/gdr_core_cuda.cc), not here.
#pragma once

#include "kernels/gdr_chunk_state.h"

namespace gdr::kernels::chunk_state_detail {

constexpr int kC = kChunkStateChunk;
constexpr int kTile = kChunkStateTileDv;
constexpr int kThreads = kChunkStateThreads;
constexpr int kRowGroups = kThreads / kTile;  // 16 threads share a column
constexpr int kSlabK = 32;                    // dk slab staged for left @ X
constexpr int kSlabC = 16;                    // chunk-row slab staged for right^T @ R
static_assert(kC % kRowGroups == 0, "chunk rows must split evenly over row groups");
static_assert(kC % kSlabC == 0, "chunk rows must split evenly into slabs");
static_assert((kC * kSlabK) % kThreads == 0, "left slab load must split evenly");

// ----------------------------------------------------------------------------
// CUDA kernels

// Thread t owns column j = t % 16 of the tile and the rows rg, rg + 16, rg + 32, ... with
// rg = t / 16, both of R (C rows) and of the carry (DK rows). A warp thus covers two row
// groups and 16 consecutive columns: shared loads of the staged operands are broadcasts
// of two words in different banks, and loads of the carry or R are 16 consecutive words.
template <int DK>
__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(const ChunkStateScanArgs args) {
  constexpr int kRowsR = kC / kRowGroups;      // rows of R per thread (4)
  constexpr int kRowsCarry = DK / kRowGroups;  // rows of the carry per thread (4, 8, 16)
  static_assert(DK % kSlabK == 0, "dk must split into whole slabs");
  static_assert((kSlabC * DK) % kThreads == 0, "right slab load must split evenly");

  __shared__ float carry_s[DK][kTile];
  __shared__ float r_s[kC][kTile];
  __shared__ float left_s[kC][kSlabK + 1];  // +1: the two row groups of a warp hit two banks
  __shared__ float right_s[kSlabC][DK];

  const int tiles = args.dv / kTile;
  const int64_t bh = blockIdx.x / tiles;
  const int col0 = (blockIdx.x % tiles) * kTile;
  const int tid = threadIdx.x;
  const int j = tid % kTile;
  const int rg = tid / kTile;
  const int64_t dv = args.dv;
  const int64_t state_size = static_cast<int64_t>(DK) * dv;

  float carry[kRowsCarry];
#pragma unroll
  for (int m = 0; m < kRowsCarry; ++m) {
    const int i = rg + m * kRowGroups;
    carry[m] = args.carry_in ? args.carry_in[bh * state_size + i * dv + col0 + j] : 0.0f;
  }

  for (int64_t step = 0; step < args.chunks; ++step) {
    const int64_t n = args.reverse ? args.chunks - 1 - step : step;
    const int64_t bhn = bh * args.chunks + n;

    // The carry entering chunk n: to shared memory for left @ X, to global for the op
    // layer (forward: S_n for O, dW, dQd; backward: dS_{n+1} for dKend, dGlast).
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      const int i = rg + m * kRowGroups;
      carry_s[i][j] = carry[m];
      args.carries_out[bhn * state_size + i * dv + col0 + j] = carry[m];
    }
    // (The barrier at the top of the first slab below orders these writes.)

    // R = base + left_sign * left @ X, left staged in dk slabs.
    const float* left = args.left.data + bh * args.left.stride_bh + n * args.left.stride_n;
    float acc[kRowsR];
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) acc[m] = 0.0f;
    for (int k0 = 0; k0 < DK; k0 += kSlabK) {
#pragma unroll
      for (int t = 0; t < kC * kSlabK / kThreads; ++t) {
        const int e = tid + t * kThreads;
        const int c = e / kSlabK, kk = e % kSlabK;
        left_s[c][kk] = left[c * args.left.stride_row + k0 + kk];
      }
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kSlabK; ++kk) {
        const float x = carry_s[k0 + kk][j];
#pragma unroll
        for (int m = 0; m < kRowsR; ++m) acc[m] = fmaf(left_s[rg + m * kRowGroups][kk], x, acc[m]);
      }
      __syncthreads();
    }
    const float* base = args.base.data + bh * args.base.stride_bh + n * args.base.stride_n;
    float* rows_out = args.rows_out + bhn * kC * dv;
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) {
      const int c = rg + m * kRowGroups;
      const float r = base[c * args.base.stride_row + col0 + j] + args.left_sign * acc[m];
      r_s[c][j] = r;
      rows_out[c * dv + col0 + j] = r;
    }
    __syncthreads();

    // X' = decay * X + extra + right_sign * right^T @ R, right staged in chunk-row slabs.
    const float* right = args.right.data + bh * args.right.stride_bh + n * args.right.stride_n;
    float upd[kRowsCarry];
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) upd[m] = 0.0f;
    for (int c0 = 0; c0 < kC; c0 += kSlabC) {
#pragma unroll
      for (int t = 0; t < kSlabC * DK / kThreads; ++t) {
        const int e = tid + t * kThreads;
        const int cc = e / DK, i = e % DK;
        right_s[cc][i] = right[(c0 + cc) * args.right.stride_row + i];
      }
      __syncthreads();
#pragma unroll 4
      for (int cc = 0; cc < kSlabC; ++cc) {
        const float r = r_s[c0 + cc][j];
#pragma unroll
        for (int m = 0; m < kRowsCarry; ++m) {
          upd[m] = fmaf(right_s[cc][rg + m * kRowGroups], r, upd[m]);
        }
      }
      // Also orders this step's reads of carry_s / r_s before the next step's writes.
      __syncthreads();
    }
    const float decay = args.decay[bhn];
    const float* extra = args.extra ? args.extra + bhn * state_size : nullptr;
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      const int i = rg + m * kRowGroups;
      const float e = extra ? extra[i * dv + col0 + j] : 0.0f;
      carry[m] = decay * carry[m] + e + args.right_sign * upd[m];
    }
  }

#pragma unroll
  for (int m = 0; m < kRowsCarry; ++m) {
    const int i = rg + m * kRowGroups;
    args.carry_final[bh * state_size + i * dv + col0 + j] = carry[m];
  }
}

}  // namespace gdr::kernels::chunk_state_detail
