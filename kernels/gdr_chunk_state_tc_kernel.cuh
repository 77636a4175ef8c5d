// The tensor-core variant of the chunk state scan kernel (device code only; see
// kernels/gdr_chunk_state.h for the recurrence and layouts, and
// kernels/gdr_chunk_state_kernel.cuh for the FP32 SIMT kernel it replaces where it
// applies). Included by kernels/gdr_chunk_state.cu, and by the CPU test
// //tests/ops:gdr_chunk_state_kernel_emulation_test, which runs this very code with one
// host thread per CUDA thread.
// NOTE: keep this file free of other includes (besides kernels/mma_tf32.cuh) and of CUDA
// APIs beyond __global__, __device__, __forceinline__, __launch_bounds__, __syncthreads,
// threadIdx, blockIdx, fmaf and expf, and of the helpers below and in kernels/mma_tf32.cuh
// (tf32_round, tf32_as_float, mma_m16n8k8_tf32, cp_async_16, cp_async_4,
// cp_async_wait_all, chunk_state_tc_shared): the emulation test defines the built-ins,
// defines GDR_CHUNK_STATE_TC_HOST_HELPERS (which implies GDR_MMA_TF32_HOST_HELPERS) and
// supplies host stand-ins for the helpers (the mma as a warp-collective exchange through a
// per-warp scratch and barrier).
//
// Note [Chunk state scan on tensor cores (3xTF32)]
// Both per-chunk products, R = left @ X ([64 x dk] @ [dk x 16]) and
// U = right^T @ R ([dk x 64] @ [64 x 16]), run as warp-level mma.sync m16n8k8 TF32 with
// FP32 accumulation, each FP32 operand split into big and small TF32 parts and three
// accumulators per output tile (Note [3xTF32 products] in kernels/mma_tf32.cuh; the three
// chains are independent, so the chain is DK / 8 mma long, not 3 DK / 8): FP32-level
// accuracy, and every output element is one warp's fixed sequence of mma instructions on
// fixed inputs, so the bits do not depend on scheduling.
//
// Block: one (batch*head, 16-column dv tile), 256 threads = 8 warps, the same grid and
// dv tiles as the SIMT kernel (128 blocks at B=1, H=16, dv=128). Work split, no
// cross-warp reduction anywhere:
//   R [64 x 16]:  warp w owns the 16 x 8 tile at rows 16 (w % 4), columns 8 (w / 4),
//                 summing over all of dk (DK / 8 k-steps, 3 mma each);
//   X' [dk x 16]: warp w owns kMt x kNt 16 x 8 tiles (dk 64: 1 x 1, 128: 1 x 2,
//                 256: 2 x 2), summing over the 64 chunk rows (8 k-steps). The carry X
//                 lives in those warps' registers in the mma accumulator layout (FP32,
//                 never rounded to TF32), and is copied to shared memory x_s once per
//                 chunk for the next R product, carries_out and the dGlast partials.
// Shared memory (dynamic, FP32): left_s [64][DK + 4] and right_s [64][DK + 8] (a whole
// chunk of each operand), x_s [DK][24], r_s [64][24]. The pitches make every fragment load
// conflict-free: A from left_s reads rows g, columns t (bank 4 g + t), A from right_s
// (right^T) reads rows t, columns g (bank 8 t + g), B from x_s / r_s rows t, columns g
// (bank 24 t + g mod 32), with g = lane / 4 and t = lane % 4.
// Per chunk: phase A (R) reads left_s and x_s while the chunk's `right` streams from
// global memory into right_s (cp.async), then stores R to r_s; wait + barrier; phase B
// (X') reads right_s and r_s while the next chunk's `left` streams into left_s, then
// stores the new carry to x_s; wait + barrier. So two barriers per chunk, and every
// global operand load overlaps the other phase's mma work without holding registers.
// Outputs: carries_out, rows_out, carry_final and the dGlast partials are written from
// x_s / r_s with the SIMT kernel's element-to-thread maps (element e = tid + 256 u of the
// [rows x 16] tile, row e / 16, column e % 16), so dot_out keeps its exact slot layout
// (kernels/gdr_chunk_state.h): thread tid's partial is decay * sum over u in order of
// dot_with * X at row tid / 16 + 16 u, column tid % 16.
#pragma once

#include "kernels/gdr_chunk_state.h"

#ifdef GDR_CHUNK_STATE_TC_HOST_HELPERS
#define GDR_MMA_TF32_HOST_HELPERS
#endif
#include "kernels/mma_tf32.cuh"

namespace gdr::kernels::chunk_state_tc_detail {

using mma_tf32::Acc3;
using mma_tf32::mma_3xtf32;
using mma_tf32::split_tf32;
using mma_tf32::total;
using mma_tf32::zero;

#ifndef GDR_CHUNK_STATE_TC_HOST_HELPERS
// Asynchronous global -> shared copies (sm_80+ cp.async, no registers involved) of 16
// bytes (both addresses 16-byte aligned) or 4 bytes, and the wait for all of this thread's
// copies; a __syncthreads after the wait makes them visible to the block.
__device__ __forceinline__ void cp_async_16(float* smem_dst, const float* gmem_src) {
#if defined(__CUDA_ARCH__)
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_4(float* smem_dst, const float* gmem_src) {
#if defined(__CUDA_ARCH__)
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem_src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

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
constexpr int kPitchTile = kTile + 8;  // x_s and r_s rows (24: B loads conflict-free)
static_assert(kC == 64 && kTile == 16 && kThreads == 256, "the warp split assumes these");

// Shared memory layout, in floats (every offset a multiple of 4 floats).
template <int DK>
struct TcLayout {
  static constexpr int kPitchLeft = DK + 4;
  static constexpr int kPitchRight = DK + 8;
  static constexpr int kLeft = 0;
  static constexpr int kRight = kLeft + kC * kPitchLeft;
  static constexpr int kX = kRight + kC * kPitchRight;
  static constexpr int kR = kX + DK * kPitchTile;
  static constexpr int kFloats = kR + kC * kPitchTile;
  static constexpr int kBytes = kFloats * 4;
};

// ----------------------------------------------------------------------------
// CUDA kernels

template <int DK>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_state_scan_tc_kernel(const ChunkStateScanArgs args) {
  using L = TcLayout<DK>;
  constexpr int kPL = L::kPitchLeft, kPR = L::kPitchRight, kPX = kPitchTile;
  // X' split: kNt n-tiles (8 columns) and kMt m-tiles (16 rows) per warp.
  constexpr int kNt = DK >= 128 ? 2 : 1;
  constexpr int kWarpsPerColumnGroup = kWarps * kNt / 2;  // warps sharing x_col0
  constexpr int kMt = DK / 16 / kWarpsPerColumnGroup;
  constexpr int kLoads = kC * DK / kThreads;  // floats per thread per staged operand
  constexpr int kQuadsPerRow = DK / 4;
  constexpr int kTileElems = DK * kTile / kThreads;  // carry elements per thread (x_s maps)
  constexpr int kRowElems = kC * kTile / kThreads;   // R elements per thread (r_s maps)
  static_assert(kMt >= 1 && kMt * kWarpsPerColumnGroup * 16 == DK, "X' rows split over warps");
  static_assert(kLoads % 4 == 0 && kTileElems >= 1 && kRowElems >= 1, "even splits");

  float* const smem = chunk_state_tc_shared();
  float* const left_s = smem + L::kLeft;    // [c][k]
  float* const right_s = smem + L::kRight;  // [c][i]
  float* const x_s = smem + L::kX;          // [i][j]: the carry entering the chunk
  float* const r_s = smem + L::kR;          // [c][j]: R

  const int tiles = args.dv / kTile;
  const int64_t bh = blockIdx.x / tiles;
  const int tile = blockIdx.x % tiles;
  const int col0 = tile * kTile;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t dv = args.dv;
  const int64_t state_size = static_cast<int64_t>(DK) * dv;
  // R tile of this warp; X' tiles: rows x_row0 + 16 kWarpsPerColumnGroup q + [0, 16),
  // columns x_col0 + 8 p + [0, 8).
  const int r_row0 = 16 * (warp % 4), r_col0 = 8 * (warp / 4);
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
  // copies run while the warps do mma work; cp_async_wait_all + the phase's closing
  // barrier publish them). float4 path: quad q = tid + u * kThreads is row q / (DK / 4),
  // columns 4 (q % (DK / 4)) ..; scalar path: element e = tid + u * kThreads is row
  // e / DK, column e % DK.
  auto stage = [&](const ChunkOperand& op, bool quads, int64_t n, float* dst, int pitch) {
    const float* src = op.data + bh * op.stride_bh + n * op.stride_n;
    if (quads) {
#pragma unroll
      for (int u = 0; u < kLoads / 4; ++u) {
        const int q = tid + u * kThreads, row = q / kQuadsPerRow, col = (q % kQuadsPerRow) * 4;
        cp_async_16(dst + row * pitch + col, src + row * op.stride_row + col);
      }
    } else {
#pragma unroll 8
      for (int u = 0; u < kLoads; ++u) {
        const int e = tid + u * kThreads, row = e / DK, col = e % DK;
        cp_async_4(dst + row * pitch + col, src + row * op.stride_row + col);
      }
    }
  };

  // The carry, in the accumulator layout of this warp's X' tiles.
  float carry[kMt][kNt][4];
#pragma unroll
  for (int q = 0; q < kMt; ++q) {
#pragma unroll
    for (int p = 0; p < kNt; ++p) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        carry[q][p][e] =
            args.carry_in ? args.carry_in[bh * state_size + x_row(q, e) * dv + col0 + x_col(p, e)]
                          : 0.0f;
        x_s[x_row(q, e) * kPX + x_col(p, e)] = carry[q][p][e];
      }
    }
  }
  if (args.chunks > 0) stage(args.left, left_quads, chunk_of(0), left_s, kPL);
  cp_async_wait_all();
  __syncthreads();

  for (int64_t step = 0; step < args.chunks; ++step) {
    const int64_t n = chunk_of(step);
    const int64_t bhn = bh * args.chunks + n;

    // ---- Phase A: R = base + left_sign * left @ X (reads left_s, x_s; writes r_s).
    stage(args.right, right_quads, n, right_s, kPR);  // lands during the mma work below
    const float* base = args.base.data + bh * args.base.stride_bh + n * args.base.stride_n;
    float base_v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      base_v[e] =
          base[(r_row0 + g + 8 * (e / 2)) * args.base.stride_row + col0 + r_col0 + 2 * t + e % 2];
    }
    const float decay = expf(args.g_last[bhn]);

    // The carry entering chunk n to global memory (forward: S_n; backward: dS_{n+1}), and
    // the dGlast partials, with the SIMT kernel's maps (u in order).
    {
      float dot = 0.0f;
#pragma unroll
      for (int u = 0; u < kTileElems; ++u) {
        const int e = tid + u * kThreads, i = e / kTile, j = e % kTile;
        const float x = x_s[i * kPX + j];
        const int64_t at = bhn * state_size + i * dv + col0 + j;
        args.carries_out[at] = x;
        if (args.dot_with) dot = fmaf(args.dot_with[at], x, dot);
      }
      if (args.dot_with) args.dot_out[(bhn * tiles + tile) * kThreads + tid] = decay * dot;
    }

    {
      Acc3 acc;
      zero(acc);
      const float* a_rows = left_s + (r_row0 + g) * kPL + t;
      const float* b_rows = x_s + t * kPX + r_col0 + g;
#pragma unroll 4
      for (int k0 = 0; k0 < DK; k0 += 8) {
        uint32_t a_big[4], a_small[4], b_big[2], b_small[2];
        split_tf32(a_rows[k0], a_big[0], a_small[0]);
        split_tf32(a_rows[8 * kPL + k0], a_big[1], a_small[1]);
        split_tf32(a_rows[k0 + 4], a_big[2], a_small[2]);
        split_tf32(a_rows[8 * kPL + k0 + 4], a_big[3], a_small[3]);
        split_tf32(b_rows[k0 * kPX], b_big[0], b_small[0]);
        split_tf32(b_rows[(k0 + 4) * kPX], b_big[1], b_small[1]);
        mma_3xtf32(acc, a_big, a_small, b_big, b_small);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        r_s[(r_row0 + g + 8 * (e / 2)) * kPX + r_col0 + 2 * t + e % 2] =
            base_v[e] + args.left_sign * total(acc, e);
      }
    }
    cp_async_wait_all();
    __syncthreads();

    // ---- Phase B: X' = decay * X + extra + right_sign * right^T @ R (reads right_s,
    // r_s; writes x_s).
    if (step + 1 < args.chunks) stage(args.left, left_quads, chunk_of(step + 1), left_s, kPL);
    // Read now, used after the mma loop.
    float extra_v[kMt][kNt][4];
#pragma unroll
    for (int q = 0; q < kMt; ++q) {
#pragma unroll
      for (int p = 0; p < kNt; ++p) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          extra_v[q][p][e] =
              args.extra ? args.extra[bhn * state_size + x_row(q, e) * dv + col0 + x_col(p, e)]
                         : 0.0f;
        }
      }
    }
    {
      float* rows_out = args.rows_out + bhn * kC * dv;
#pragma unroll
      for (int u = 0; u < kRowElems; ++u) {
        const int e = tid + u * kThreads, c = e / kTile, j = e % kTile;
        rows_out[c * dv + col0 + j] = r_s[c * kPX + j];
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
          const float* b = r_s + (c0 + t) * kPX + x_col0 + 8 * p + g;
          split_tf32(b[0], b_big[p][0], b_small[p][0]);
          split_tf32(b[4 * kPX], b_big[p][1], b_small[p][1]);
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
            x_s[x_row(q, e) * kPX + x_col(p, e)] = carry[q][p][e];
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
