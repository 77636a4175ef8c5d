// The chunk state scan kernel itself (device code only; see kernels/gdr_chunk_state.h for
// the recurrence and layouts). Included by kernels/gdr_chunk_state.cu, and by the CPU
// test //tests/ops:gdr_chunk_state_kernel_emulation_test, which supplies host stand-ins
// for the CUDA built-ins (__global__, __shared__, __syncthreads, threadIdx, blockIdx) and
// runs this very code with one host thread per CUDA thread, so the indexing and barriers
// are checked on machines without a GPU.
// NOTE: keep this file free of other includes and of CUDA APIs beyond those built-ins,
// fmaf and expf: the emulation test defines exactly those.
//
// Note [Chunk state scan determinism]
// One block owns one (batch*head, 16-column dv tile) and walks every chunk of it; the
// carry of that tile never leaves the block between chunks. The recurrence only
// contracts over dk (left @ X) and over the chunk rows (right^T @ R), never over dv, so
// dv tiles are independent: no cross-block reduction exists, hence no atomics and no
// scratch partials. Inside a block, each output element is accumulated by one thread in
// a fixed index order. The same inputs therefore give the same bits on every run,
// stream and load. Keep it that way: the products that need no carry (O, dW, dQd, dKend,
// dP) are batched matmuls in the op layer after the scan (ops/gdr_chunk_state.cc), and
// dGlast, which contracts over dv and so across blocks, leaves this kernel only as
// per-thread partials (each slot written once by one thread) that the op layer sums in a
// fixed order.
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
//
// The operands stream through shared memory in slabs: per chunk DK/32 slabs of `left`
// (all C rows, 32 of the dk columns), then C/16 slabs of `right` (16 rows, all dk
// columns). The chunk walk is latency-bound (one block per SM at the training shape), so
// every slab's global load is issued into registers one slab ahead (the next chunk's
// first left slab during the last right slab) and only stored to shared memory after the
// barrier that ends the previous slab's use; base and extra, which need no staging, are
// loaded at the top of the chunk. Barriers: one after each slab's store (its data is
// visible, and for the first right slab also R in r_s) and one after each slab's use (the
// buffers and, at a phase's end, carry_s / r_s may be overwritten).
template <int DK>
__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(const ChunkStateScanArgs args) {
  constexpr int kRowsR = kC / kRowGroups;      // rows of R per thread (4)
  constexpr int kRowsCarry = DK / kRowGroups;  // rows of the carry per thread (4, 8, 16)
  constexpr int kLeftSlabs = DK / kSlabK;
  constexpr int kRightSlabs = kC / kSlabC;
  constexpr int kLeftLoads = kC * kSlabK / kThreads;   // floats per thread per left slab (8)
  constexpr int kRightLoads = kSlabC * DK / kThreads;  // per right slab (4, 8, 16)
  constexpr int kStaged = kLeftLoads > kRightLoads ? kLeftLoads : kRightLoads;
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

  // Slab element e = tid + t * kThreads of a left slab is (row e / 32, column k0 + e % 32);
  // of a right slab (row c0 + e / DK, column e % DK): consecutive threads read
  // consecutive floats of a row.
  float staged[kStaged];
  auto chunk_of = [&](int64_t step) { return args.reverse ? args.chunks - 1 - step : step; };
  auto load_left = [&](int64_t n, int k0) {
    const float* left = args.left.data + bh * args.left.stride_bh + n * args.left.stride_n;
#pragma unroll
    for (int t = 0; t < kLeftLoads; ++t) {
      const int e = tid + t * kThreads;
      staged[t] = left[(e / kSlabK) * args.left.stride_row + k0 + e % kSlabK];
    }
  };
  auto store_left = [&]() {
#pragma unroll
    for (int t = 0; t < kLeftLoads; ++t) {
      const int e = tid + t * kThreads;
      left_s[e / kSlabK][e % kSlabK] = staged[t];
    }
  };
  auto load_right = [&](int64_t n, int c0) {
    const float* right = args.right.data + bh * args.right.stride_bh + n * args.right.stride_n;
#pragma unroll
    for (int t = 0; t < kRightLoads; ++t) {
      const int e = tid + t * kThreads;
      staged[t] = right[(c0 + e / DK) * args.right.stride_row + e % DK];
    }
  };
  auto store_right = [&]() {
#pragma unroll
    for (int t = 0; t < kRightLoads; ++t) {
      const int e = tid + t * kThreads;
      right_s[e / DK][e % DK] = staged[t];
    }
  };

  float carry[kRowsCarry];
#pragma unroll
  for (int m = 0; m < kRowsCarry; ++m) {
    const int i = rg + m * kRowGroups;
    carry[m] = args.carry_in ? args.carry_in[bh * state_size + i * dv + col0 + j] : 0.0f;
  }
  if (args.chunks > 0) load_left(chunk_of(0), 0);

  for (int64_t step = 0; step < args.chunks; ++step) {
    const int64_t n = chunk_of(step);
    const int64_t bhn = bh * args.chunks + n;

    // Operands used without staging, loaded now so their latency hides behind the slabs.
    const float* base = args.base.data + bh * args.base.stride_bh + n * args.base.stride_n;
    float base_v[kRowsR];
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) {
      base_v[m] = base[(rg + m * kRowGroups) * args.base.stride_row + col0 + j];
    }
    float extra_v[kRowsCarry];
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      const int i = rg + m * kRowGroups;
      extra_v[m] = args.extra ? args.extra[bhn * state_size + i * dv + col0 + j] : 0.0f;
    }
    const float decay = expf(args.g_last[bhn]);
    float dot_v[kRowsCarry];
    if (args.dot_with) {
#pragma unroll
      for (int m = 0; m < kRowsCarry; ++m) {
        const int i = rg + m * kRowGroups;
        dot_v[m] = args.dot_with[bhn * state_size + i * dv + col0 + j];
      }
    }

    // The carry entering chunk n: to shared memory for left @ X, to global for the op
    // layer (forward: S_n for O, dW, dQd; backward: dS_{n+1} for dKend, dGlast).
    // (The barrier after the first slab's store below orders these writes.)
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      const int i = rg + m * kRowGroups;
      carry_s[i][j] = carry[m];
      args.carries_out[bhn * state_size + i * dv + col0 + j] = carry[m];
    }
    if (args.dot_with) {
      // m in order; the op layer sums the partials of (bh, n) in a fixed order.
      float dot = 0.0f;
#pragma unroll
      for (int m = 0; m < kRowsCarry; ++m) dot = fmaf(dot_v[m], carry[m], dot);
      args.dot_out[(bhn * tiles + blockIdx.x % tiles) * kThreads + tid] = decay * dot;
    }

    // R = base + left_sign * left @ X.
    float acc[kRowsR];
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) acc[m] = 0.0f;
    for (int s = 0; s < kLeftSlabs; ++s) {
      store_left();
      __syncthreads();
      if (s + 1 < kLeftSlabs) {
        load_left(n, (s + 1) * kSlabK);
      } else {
        load_right(n, 0);
      }
      const int k0 = s * kSlabK;
#pragma unroll 8
      for (int kk = 0; kk < kSlabK; ++kk) {
        const float x = carry_s[k0 + kk][j];
#pragma unroll
        for (int m = 0; m < kRowsR; ++m) acc[m] = fmaf(left_s[rg + m * kRowGroups][kk], x, acc[m]);
      }
      __syncthreads();
    }
    float* rows_out = args.rows_out + bhn * kC * dv;
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) {
      const int c = rg + m * kRowGroups;
      const float r = base_v[m] + args.left_sign * acc[m];
      r_s[c][j] = r;
      rows_out[c * dv + col0 + j] = r;
    }

    // X' = decay * X + extra + right_sign * right^T @ R.
    float upd[kRowsCarry];
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) upd[m] = 0.0f;
    for (int s = 0; s < kRightSlabs; ++s) {
      store_right();
      __syncthreads();
      if (s + 1 < kRightSlabs) {
        load_right(n, (s + 1) * kSlabC);
      } else if (step + 1 < args.chunks) {
        load_left(chunk_of(step + 1), 0);
      }
      const int c0 = s * kSlabC;
#pragma unroll 4
      for (int cc = 0; cc < kSlabC; ++cc) {
        const float r = r_s[c0 + cc][j];
#pragma unroll
        for (int m = 0; m < kRowsCarry; ++m) {
          upd[m] = fmaf(right_s[cc][rg + m * kRowGroups], r, upd[m]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      carry[m] = decay * carry[m] + extra_v[m] + args.right_sign * upd[m];
    }
  }

#pragma unroll
  for (int m = 0; m < kRowsCarry; ++m) {
    const int i = rg + m * kRowGroups;
    args.carry_final[bh * state_size + i * dv + col0 + j] = carry[m];
  }
}

}  // namespace gdr::kernels::chunk_state_detail
