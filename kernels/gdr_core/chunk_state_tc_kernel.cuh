// The tensor-core variant of the chunk state scan kernel (device code only; see
// kernels/gdr_core/chunk_state.h for the recurrence and layouts, and
// kernels/gdr_core/chunk_state_kernel.cuh for the FP32 SIMT kernel it replaces where it
// applies). Included by kernels/gdr_core/chunk_state.cu, and by the CPU test
// //tests/ops:gdr_chunk_state_kernel_emulation_test, which runs this very code with one
// host thread per CUDA thread.
// NOTE: keep this file free of other includes (besides kernels/common/mma_tf32.cuh and
// kernels/common/cp_async.cuh) and of CUDA APIs beyond __global__, __device__, __forceinline__,
// __launch_bounds__, __syncthreads, threadIdx, blockIdx, fmaf and expf, and of the helpers
// below, in kernels/common/mma_tf32.cuh and kernels/common/cp_async.cuh (tf32_round, tf32_as_float,
// mma_m16n8k8_tf32, cp_async_16, cp_async_4, cp_async_wait_all, chunk_state_tc_shared): the
// emulation test defines the built-ins, defines GDR_CHUNK_STATE_TC_HOST_HELPERS (which
// implies GDR_MMA_TF32_HOST_HELPERS and GDR_CP_ASYNC_HOST_HELPERS) and supplies host stand-
// ins for the helpers (the mma as a warp-collective exchange through a per-warp scratch and
// barrier).
//
// Note [Chunk state scan on tensor cores (3xTF32)]
// Both per-chunk products, R = left @ X ([64 x dk] @ [dk x 16]) and
// U = right^T @ R ([dk x 64] @ [64 x 16]), run as warp-level mma.sync m16n8k8 TF32 with
// FP32 accumulation, each FP32 operand split into big and small TF32 parts and three
// accumulators per output tile (Note [3xTF32 products] in kernels/common/mma_tf32.cuh; the three
// chains are independent, so the chain is DK / 8 mma long, not 3 DK / 8): FP32-level
// accuracy, and every output element is one warp's fixed sequence of mma instructions on
// fixed inputs, so the bits do not depend on scheduling.
//
// Block: one (batch*head, 16-column dv tile), 256 threads = 8 warps, the same grid and
// dv tiles as the SIMT kernel (128 blocks at B=1, H=16, dv=128). Work split, no
// cross-warp reduction anywhere:
//   R [64 x 16]:  warp w owns rows 8 w .. 8 w + 7 (all 16 columns), computed as the
//                 16 x 8 tile R^T = X^T @ left^T (A = X^T, B = left^T: each left element
//                 is split by one warp), summing over all of dk (DK / 8 k-steps, 3 mma
//                 each; a_small b_big is then X_small left_big, which only swaps the
//                 two commuting terms of lo_a + lo_b);
//   X' [dk x 16]: warp w owns kMt x kNt 16 x 8 tiles (dk 64: 1 x 1, 128: 1 x 2,
//                 256: 2 x 2), summing over the 64 chunk rows (8 k-steps). The carry X
//                 lives in those warps' registers in the mma accumulator layout (FP32,
//                 never rounded to TF32), and is copied to shared memory x_s once per
//                 chunk for the next R product, carries_out and the dGlast partials.
// Shared memory (dynamic): kStages operand stages, each left_s [64][DK + 4] and right_s
// [64][DK + 8] (a whole chunk of each operand; 2 stages for dk 64 and 128, 1 for dk 256,
// whose two would not fit in 227 KiB), x_s [DK][24] and r_s [64][24] (FP32), and the
// same values split once into TF32 big / small planes by the warp that produces them
// (all 8 warps read each x element, as A of R^T, and each R element, as B of X', so
// splitting at the reader converted them 8x over): x_big / x_small [DK][24] with column
// j at 2 (j % 8) + j / 8, r_big / r_small [32][40] with R[c][j] in row-pair
// 4 (c / 8) + c % 4 at 2 j + (c % 8) / 4, so an A fragment's (a0, a1) and (a2, a3) of X^T
// and a B fragment's (b0, b1) of R are each one 64-bit load into the mma's operand
// registers. The pitches make every fragment load conflict-free (g = lane / 4,
// t = lane % 4): B from left_s (left^T) reads rows g, columns t (bank 4 g + t), A from
// right_s (right^T) rows t, columns g (bank 8 t + g), the 64-bit plane loads (per half
// warp) rows t, words 2 g + {0, 1} (banks 24 t or 40 t, + 2 g + {0, 1} mod 32).
// Per chunk with two stages: the next chunk's `left` and `right` stream from global
// memory into the other stage (cp.async) during the whole chunk; phase A (R) reads left_s
// and the x planes, stores R to r_s and the R planes; barrier; phase B (X') reads right_s
// and the R planes, stores the new carry to x_s and the x planes; wait + barrier. With
// one stage (dk 256): phase A overlaps the chunk's `right` load, phase B the next `left`
// load, each phase ending in wait + barrier. Two barriers per chunk either way, and no operand load
// holds registers. The chunk's base, g_last and (dk <= 128) dot_with and extra elements are
// read from global memory one chunk ahead (Note [Chunk state scan prefetch]), so their latency
// hides behind the chunk before. Outputs: carries_out, rows_out,
// carry_final and the dGlast partials are written from x_s / r_s with the SIMT kernel's
// element-to-thread maps (element e = tid + 256 u of the [rows x 16] tile, row e / 16, column e %
// 16), so dot_out keeps its exact slot layout (kernels/gdr_core/chunk_state.h): thread tid's
// partial is decay * sum over u in order of dot_with * X at row tid / 16 + 16 u, column tid % 16.
#pragma once

#include "kernels/gdr_core/chunk_state.h"

#ifdef GDR_CHUNK_STATE_TC_HOST_HELPERS
#define GDR_MMA_TF32_HOST_HELPERS
#define GDR_CP_ASYNC_HOST_HELPERS
#endif
#include "kernels/common/cp_async.cuh"
#include "kernels/common/mma_tf32.cuh"

namespace gdr::kernels::chunk_state_tc_detail {

using mma_tf32::Acc3;
using mma_tf32::mma_3xtf32;
using mma_tf32::split_tf32;
using mma_tf32::total;
using mma_tf32::zero;

#ifndef GDR_CHUNK_STATE_TC_HOST_HELPERS
// The block's dynamic shared memory (TcLayout<DK>::kBytes, set by the launcher).
__device__ __forceinline__ float* chunk_state_tc_shared() {
  extern __shared__ __align__(16) float chunk_state_tc_smem[];
  return chunk_state_tc_smem;
}
#endif  // GDR_CHUNK_STATE_TC_HOST_HELPERS

constexpr int kC = kChunkStateChunk;
constexpr int kTile = kChunkStateTileDv;
constexpr int kThreads = kChunkStateThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kPitchTile = kTile + 8;        // x_s and r_s rows, in floats
constexpr int kPitchXPlane = kTile + 8;      // x_big / x_small rows (16 used)
constexpr int kPitchRPlane = 2 * kTile + 8;  // r_big / r_small rows (row pairs, 32 used)
constexpr int kMaxSharedBytes = 227 * 1024;  // sm_90's opt-in limit per block
static_assert(kC == 64 && kTile == 16 && kThreads == 256, "the warp split assumes these");

// Two adjacent 32-bit words (one 64-bit shared load).
struct alignas(8) U32x2 {
  uint32_t lo, hi;
};

// Shared memory layout, in floats (every offset a multiple of 4 floats). kStages operand
// stages (left_s + right_s each): 2 where they fit, so the next chunk's operands stream in
// during the whole current chunk; 1 (dk 256) otherwise.
template <int DK>
struct TcLayout {
  static constexpr int kPitchLeft = DK + 4;
  static constexpr int kPitchRight = DK + 8;
  static constexpr int kOperands = kC * (kPitchLeft + kPitchRight);  // one stage
  static constexpr int kRest =
      (DK + kC) * kPitchTile + 2 * DK * kPitchXPlane + 2 * (kC / 2) * kPitchRPlane;
  static constexpr int kStages = (2 * kOperands + kRest) * 4 <= kMaxSharedBytes ? 2 : 1;
  static constexpr int kLeft = 0;  // stage s at + s * kOperands
  static constexpr int kRight = kLeft + kC * kPitchLeft;
  static constexpr int kX = kStages * kOperands;
  static constexpr int kR = kX + DK * kPitchTile;
  static constexpr int kXBig = kR + kC * kPitchTile;
  static constexpr int kXSmall = kXBig + DK * kPitchXPlane;
  static constexpr int kRBig = kXSmall + DK * kPitchXPlane;
  static constexpr int kRSmall = kRBig + (kC / 2) * kPitchRPlane;
  static constexpr int kFloats = kRSmall + (kC / 2) * kPitchRPlane;
  static constexpr int kBytes = kFloats * 4;
  static_assert(kFloats - kX == kRest && kBytes <= kMaxSharedBytes, "layout");
};

// x's split into the big / small planes at word `at`.
__device__ __forceinline__ void put_split(uint32_t* big_plane, uint32_t* small_plane, int at,
                                          float x) {
  split_tf32(x, big_plane[at], small_plane[at]);
}

// Words at and at + 1 of a plane (at even).
__device__ __forceinline__ void load_u32x2(const uint32_t* plane, int at, uint32_t& lo,
                                           uint32_t& hi) {
  const U32x2 v = *reinterpret_cast<const U32x2*>(plane + at);
  lo = v.lo;
  hi = v.hi;
}

// ----------------------------------------------------------------------------
// CUDA kernels

template <int DK>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_state_scan_tc_kernel(const ChunkStateScanArgs args) {
  using L = TcLayout<DK>;
  constexpr int kPL = L::kPitchLeft, kPR = L::kPitchRight, kPX = kPitchTile;
  constexpr int kPXP = kPitchXPlane, kPRP = kPitchRPlane;
  constexpr int kStages = L::kStages;
  // X' split: kNt n-tiles (8 columns) and kMt m-tiles (16 rows) per warp.
  constexpr int kNt = DK >= 128 ? 2 : 1;
  constexpr int kWarpsPerColumnGroup = kWarps * kNt / 2;  // warps sharing x_col0
  constexpr int kMt = DK / 16 / kWarpsPerColumnGroup;
  constexpr int kLoads = kC * DK / kThreads;  // floats per thread per staged operand
  constexpr int kQuadsPerRow = DK / 4;
  constexpr int kTileElems = DK * kTile / kThreads;  // carry elements per thread (x_s maps)
  constexpr int kRowElems = kC * kTile / kThreads;   // R elements per thread (r_s maps)
  // Whether the chunk's dot_with and extra elements are loaded before phase A's mma loop
  // (their global latency then hides behind it); dk 256 has no registers to spare.
  constexpr bool kEarly = DK <= 128;
  static_assert(kMt >= 1 && kMt * kWarpsPerColumnGroup * 16 == DK, "X' rows split over warps");
  static_assert(kLoads % 4 == 0 && kTileElems >= 1 && kRowElems >= 1, "even splits");

  float* const smem = chunk_state_tc_shared();
  float* const x_s = smem + L::kX;  // [i][j]: the carry entering the chunk
  float* const r_s = smem + L::kR;  // [c][j]: R
  // x_s and r_s split into TF32 pairs once by their producers (the mma B operands).
  // The TF32 big / small planes of x and R (Note above): word x_at(i, j) holds x[i][j],
  // word r_at(c, j) R[c][j].
  uint32_t* const x_big = reinterpret_cast<uint32_t*>(smem + L::kXBig);
  uint32_t* const x_small = reinterpret_cast<uint32_t*>(smem + L::kXSmall);
  uint32_t* const r_big = reinterpret_cast<uint32_t*>(smem + L::kRBig);
  uint32_t* const r_small = reinterpret_cast<uint32_t*>(smem + L::kRSmall);
  auto x_at = [](int i, int j) { return i * kPXP + 2 * (j % 8) + j / 8; };
  auto r_at = [](int c, int j) { return (c / 8 * 4 + c % 4) * kPRP + 2 * j + c % 8 / 4; };
  // Operand stage s: left_s [c][k] and right_s [c][i].
  auto left_of = [smem](int s) { return smem + L::kLeft + s * L::kOperands; };
  auto right_of = [smem](int s) { return smem + L::kRight + s * L::kOperands; };

  const int tiles = args.dv / kTile;
  const int64_t bh = blockIdx.x / tiles;
  const int tile = blockIdx.x % tiles;
  const int col0 = tile * kTile;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t dv = args.dv;
  const int64_t state_size = static_cast<int64_t>(DK) * dv;
  // R rows of this warp (R^T tile: all 16 columns x rows r_row0 + [0, 8)); X' tiles: rows
  // x_row0 + 16 kWarpsPerColumnGroup q + [0, 16), columns x_col0 + 8 p + [0, 8).
  const int r_row0 = 8 * warp;
  // R element e of this lane's accumulator: row r_row(e), column r_col(e).
  auto r_row = [&](int e) { return r_row0 + 2 * t + e % 2; };
  auto r_col = [&](int e) { return g + 8 * (e / 2); };
  const int x_row0 = 16 * (warp % kWarpsPerColumnGroup);
  const int x_col0 = 8 * kNt * (warp / kWarpsPerColumnGroup);
  auto x_row = [&](int q, int e) {
    return x_row0 + 16 * kWarpsPerColumnGroup * q + g + 8 * (e / 2);
  };
  auto x_col = [&](int p, int e) { return x_col0 + 8 * p + 2 * t + e % 2; };

  auto quad_ok = [](const ChunkOperand& op) {
    return reinterpret_cast<uintptr_t>(op.data) % 16 == 0 && op.stride_bh % 4 == 0 &&
           op.stride_n % 4 == 0 && op.stride_row % 4 == 0;
  };
  const bool left_quads = quad_ok(args.left);
  const bool right_quads = quad_ok(args.right);
  auto chunk_of = [&](int64_t step) { return args.reverse ? args.chunks - 1 - step : step; };

  // A whole chunk of `left` or `right` ([64 x DK]) into shared memory with cp.async (the
  // copies run while the warps do mma work; cp_async_wait_all + a later barrier publish
  // them). float4 path: quad q = tid + u * kThreads is row q / (DK / 4), columns
  // 4 (q % (DK / 4)) ..; scalar path: element e = tid + u * kThreads is row e / DK,
  // column e % DK.
  // kThreads is a multiple of both DK / 4 and DK, so pass u is rows row + u kRows..., one
  // running 64-bit source offset and constant shared offsets.
  static_assert(kThreads % DK == 0, "whole rows per pass");
  auto stage = [&](const ChunkOperand& op, bool quads, int64_t n, float* dst, int pitch) {
    const float* src = op.data + bh * op.stride_bh + n * op.stride_n;
    if (quads) {
      constexpr int kRows = kThreads / kQuadsPerRow;
      const int row = tid / kQuadsPerRow, col = (tid % kQuadsPerRow) * 4;
      int64_t at = row * op.stride_row + col;
      const int64_t pass = kRows * op.stride_row;
      float* const d = dst + row * pitch + col;
#pragma unroll
      for (int u = 0; u < kLoads / 4; ++u) {
        cp_async_16(d + u * kRows * pitch, src + at);  // quad tid + u kThreads
        at += pass;
      }
    } else {
      constexpr int kRows = kThreads / DK;
      const int row = tid / DK, col = tid % DK;
      int64_t at = row * op.stride_row + col;
      const int64_t pass = kRows * op.stride_row;
      float* const d = dst + row * pitch + col;
#pragma unroll 8
      for (int u = 0; u < kLoads; ++u) {
        cp_async_4(d + u * kRows * pitch, src + at);  // element tid + u kThreads
        at += pass;
      }
    }
  };
  // Offset of this thread's element u of a [rows x 16] tile (element tid + u kThreads: row
  // tid / 16 + 16 u, column tid % 16) in a [rows x dv] matrix at column col0: tile_at +
  // u tile_pass.
  const int64_t tile_at = (tid / kTile) * dv + col0 + tid % kTile;
  const int64_t tile_pass = (kThreads / kTile) * dv;
  // Offset of this lane's X' accumulator element (q, p, e) in a [dk x dv] matrix:
  // x_at0 + x_row_off(q, e) * dv + x_col_off(p, e).
  const int64_t x_at0 = static_cast<int64_t>(x_row(0, 0)) * dv + col0 + x_col(0, 0);
  auto x_row_off = [](int q, int e) { return 16 * kWarpsPerColumnGroup * q + 8 * (e / 2); };
  auto x_col_off = [](int p, int e) { return 8 * p + e % 2; };

  // The carry, in the accumulator layout of this warp's X' tiles; put_carry publishes one
  // element to x_s and the x planes.
  float carry[kMt][kNt][4];
  auto put_carry = [&](int q, int p, int e, float x) {
    x_s[x_row(q, e) * kPX + x_col(p, e)] = x;
    put_split(x_big, x_small, x_at(x_row(q, e), x_col(p, e)), x);
  };
  // f(q, p, e) for every element of this lane's X' accumulators, in order.
  auto for_each_x_element = [](auto&& f) {
#pragma unroll
    for (int q = 0; q < kMt; ++q) {
#pragma unroll
      for (int p = 0; p < kNt; ++p) {
#pragma unroll
        for (int e = 0; e < 4; ++e) f(q, p, e);
      }
    }
  };
  for_each_x_element([&](int q, int p, int e) {
    carry[q][p][e] = args.carry_in
                         ? args.carry_in[bh * state_size + x_row(q, e) * dv + col0 + x_col(p, e)]
                         : 0.0f;
    put_carry(q, p, e, carry[q][p][e]);
  });
  if (args.chunks > 0) {
    stage(args.left, left_quads, chunk_of(0), left_of(0), kPL);
    if (kStages == 2) stage(args.right, right_quads, chunk_of(0), right_of(0), kPR);
  }

  // dot_with at the carries_out maps (element u: tile_at + u tile_pass of chunk bhn's
  // [dk x dv] matrix) and extra at this warp's X' tiles.
  auto load_dot_into = [&](int64_t bhn, float(&out)[kTileElems]) {
    int64_t at = bhn * state_size + tile_at;
#pragma unroll
    for (int u = 0; u < kTileElems; ++u) {
      out[u] = args.dot_with ? args.dot_with[at] : 0.0f;
      at += tile_pass;
    }
  };
  auto load_extra_into = [&](int64_t bhn, float(&out)[kMt][kNt][4]) {
    for_each_x_element([&](int q, int p, int e) {
      out[q][p][e] =
          args.extra ? args.extra[bhn * state_size + x_at0 + x_row_off(q, e) * dv + x_col_off(p, e)]
                     : 0.0f;
    });
  };
  // Note [Chunk state scan prefetch]: a chunk's global reads that feed its arithmetic
  // directly (base at R's elements, g_last, and with kEarly dot_with and extra) are issued
  // at the start of the chunk before, so their latency (HBM: they are read once) hides
  // behind a whole chunk instead of one mma loop; the operands themselves stream through
  // the cp.async stages. The values and the arithmetic are the same, so are the bits.
  struct ChunkValues {
    float base[4];
    float log_decay;
    float dot[kTileElems];     // with kEarly; else loaded into `current` where used
    float extra[kMt][kNt][4];  // the same
  } ahead;
  if constexpr (!kEarly) {  // never fetched ahead: defined values for the copies below
#pragma unroll
    for (int u = 0; u < kTileElems; ++u) ahead.dot[u] = 0.0f;
    for_each_x_element([&](int q, int p, int e) { ahead.extra[q][p][e] = 0.0f; });
  }
  auto fetch_ahead = [&](int64_t step) {
    const int64_t n = chunk_of(step);
    const int64_t bhn = bh * args.chunks + n;
    // base at R element e: rows r_row(0) + e % 2, columns r_col(0) + 8 (e / 2).
    const float* base = args.base.data + bh * args.base.stride_bh + n * args.base.stride_n +
                        r_row(0) * args.base.stride_row + col0 + r_col(0);
#pragma unroll
    for (int e = 0; e < 4; ++e) ahead.base[e] = base[(e % 2) * args.base.stride_row + 8 * (e / 2)];
    ahead.log_decay = args.g_last[bhn];
    if constexpr (kEarly) {
      load_dot_into(bhn, ahead.dot);
      load_extra_into(bhn, ahead.extra);
    }
  };
  if (args.chunks > 0) fetch_ahead(0);
  cp_async_wait_all();
  __syncthreads();

  for (int64_t step = 0; step < args.chunks; ++step) {
    const int64_t n = chunk_of(step);
    const int64_t bhn = bh * args.chunks + n;
    const int s = kStages == 2 ? static_cast<int>(step % 2) : 0;
    const float* const left_s = left_of(s);
    const float* const right_s = right_of(s);

    // ---- Phase A: R = base + left_sign * left @ X (reads left_s, the x planes; writes r_s,
    // the R planes).
    // Two stages: the next chunk's operands land in the other stage during this whole
    // chunk (its last reads were in the previous chunk, before the closing barrier). One
    // stage: this chunk's `right` lands during phase A, the next `left` during phase B.
    if (kStages == 2) {
      if (step + 1 < args.chunks) {
        stage(args.left, left_quads, chunk_of(step + 1), left_of(s ^ 1), kPL);
        stage(args.right, right_quads, chunk_of(step + 1), right_of(s ^ 1), kPR);
      }
    } else {
      stage(args.right, right_quads, n, right_of(0), kPR);
    }
    // This chunk's base, decay and (kEarly) dot_with and extra elements: read one chunk
    // ahead (Note [Chunk state scan prefetch]); then the next chunk's reads are issued.
    ChunkValues current = ahead;
    const float(&base_v)[4] = current.base;
    const float decay = expf(current.log_decay);
    float(&dot_v)[kTileElems] = current.dot;
    float(&extra_v)[kMt][kNt][4] = current.extra;
    if (step + 1 < args.chunks) fetch_ahead(step + 1);
    // Where kEarly is false (dk 256, no registers to spare for them one chunk ahead): dot_with
    // at the carries_out maps and extra at this warp's X' tiles, read where they are used.
    auto load_dot = [&]() { load_dot_into(bhn, dot_v); };
    auto load_extra = [&]() { load_extra_into(bhn, extra_v); };

    {
      Acc3 acc;
      zero(acc);
      // R^T = X^T @ left^T: A = X^T (A[j][k] = x[k][j]), B = left^T (B[k][c] =
      // left_s[c][k]), so each left element is split by the one warp that owns its row.
      const int a_at = x_at(t, g);  // a0 = X[k0 + t][g], a1 = X[k0 + t][g + 8]: adjacent
      const float* b_rows = left_s + (r_row0 + g) * kPL + t;
#pragma unroll 4
      for (int k0 = 0; k0 < DK; k0 += 8) {
        uint32_t a_big[4], a_small[4];
        load_u32x2(x_big, a_at + k0 * kPXP, a_big[0], a_big[1]);
        load_u32x2(x_big, a_at + (k0 + 4) * kPXP, a_big[2], a_big[3]);
        load_u32x2(x_small, a_at + k0 * kPXP, a_small[0], a_small[1]);
        load_u32x2(x_small, a_at + (k0 + 4) * kPXP, a_small[2], a_small[3]);
        uint32_t b_big[2], b_small[2];
        split_tf32(b_rows[k0], b_big[0], b_small[0]);
        split_tf32(b_rows[k0 + 4], b_big[1], b_small[1]);
        mma_3xtf32(acc, a_big, a_small, b_big, b_small);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float r = base_v[e] + args.left_sign * total(acc, e);
        r_s[r_row(e) * kPX + r_col(e)] = r;
        put_split(r_big, r_small, r_at(r_row(e), r_col(e)), r);
      }
    }

    // The carry entering chunk n to global memory (forward: S_n; backward: dS_{n+1}), and
    // the dGlast partials, with the SIMT kernel's maps (u in order). x_s is not written
    // before phase B's end.
    if (!kEarly) load_dot();
    {
      float dot = 0.0f;
      int64_t at = bhn * state_size + tile_at;
#pragma unroll
      for (int u = 0; u < kTileElems; ++u) {
        const int e = tid + u * kThreads, i = e / kTile, j = e % kTile;
        const float x = x_s[i * kPX + j];
        args.carries_out[at] = x;
        dot = fmaf(dot_v[u], x, dot);
        at += tile_pass;
      }
      if (args.dot_with) args.dot_out[(bhn * tiles + tile) * kThreads + tid] = decay * dot;
    }
    if (kStages == 1) cp_async_wait_all();
    __syncthreads();

    // ---- Phase B: X' = decay * X + extra + right_sign * right^T @ R (reads right_s,
    // the R planes; writes x_s, the x planes).
    if (kStages == 1 && step + 1 < args.chunks) {
      stage(args.left, left_quads, chunk_of(step + 1), left_of(0), kPL);
    }
    if (!kEarly) load_extra();  // read now, used after the mma loop
    {
      float* rows_out = args.rows_out + bhn * kC * dv;
      int64_t at = tile_at;
#pragma unroll
      for (int u = 0; u < kRowElems; ++u) {
        const int e = tid + u * kThreads, c = e / kTile, j = e % kTile;
        rows_out[at] = r_s[c * kPX + j];
        at += tile_pass;
      }
    }
    {
      Acc3 acc[kMt][kNt];
#pragma unroll
      for (int q = 0; q < kMt; ++q) {
#pragma unroll
        for (int p = 0; p < kNt; ++p) zero(acc[q][p]);
      }
#pragma unroll 2
      for (int c0 = 0; c0 < kC; c0 += 8) {
        uint32_t b_big[kNt][2], b_small[kNt][2];
#pragma unroll
        for (int p = 0; p < kNt; ++p) {
          // b0 = R[c0 + t][col], b1 = R[c0 + t + 4][col]: adjacent (c0 % 8 == 0).
          const int at = r_at(t, x_col0 + 8 * p + g) + c0 / 2 * kPRP;
          load_u32x2(r_big, at, b_big[p][0], b_big[p][1]);
          load_u32x2(r_small, at, b_small[p][0], b_small[p][1]);
        }
#pragma unroll
        for (int q = 0; q < kMt; ++q) {
          // A = right^T: A[i][c] = right_s[c][i].
          const float* a = right_s + (c0 + t) * kPR + x_row0 + 16 * kWarpsPerColumnGroup * q + g;
          uint32_t a_big[4], a_small[4];
          split_tf32(a[0], a_big[0], a_small[0]);
          split_tf32(a[8], a_big[1], a_small[1]);
          split_tf32(a[4 * kPR], a_big[2], a_small[2]);
          split_tf32(a[4 * kPR + 8], a_big[3], a_small[3]);
#pragma unroll
          for (int p = 0; p < kNt; ++p) {
            mma_3xtf32(acc[q][p], a_big, a_small, b_big[p], b_small[p]);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kMt; ++q) {
#pragma unroll
        for (int p = 0; p < kNt; ++p) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            carry[q][p][e] =
                decay * carry[q][p][e] + extra_v[q][p][e] + args.right_sign * total(acc[q][p], e);
            put_carry(q, p, e, carry[q][p][e]);
          }
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }

#pragma unroll
  for (int u = 0; u < kTileElems; ++u) {
    const int e = tid + u * kThreads, i = e / kTile, j = e % kTile;
    args.carry_final[bh * state_size + i * dv + col0 + j] = x_s[i * kPX + j];
  }
}

}  // namespace gdr::kernels::chunk_state_tc_detail
