// The chunk state scan kernel itself (device code only; see kernels/gdr_core/chunk_state.h for
// the recurrence and layouts). Included by kernels/gdr_core/chunk_state.cu, and by the CPU
// test //tests/ops:gdr_chunk_state_kernel_emulation_test, which supplies host stand-ins
// for the CUDA built-ins (__global__, __shared__, __syncthreads, threadIdx, blockIdx) and
// runs this very code with one host thread per CUDA thread, so the indexing and barriers
// are checked on machines without a GPU.
// NOTE: keep this file free of other includes and of CUDA APIs beyond those built-ins,
// __align__, float4 (braced initialisation, .x .. .w), fmaf and expf: the emulation test
// defines exactly those.
//
// Note [Chunk state scan determinism]
// One block owns one (batch*head, 16-column dv tile) and walks every chunk of it; the
// carry of that tile never leaves the block between chunks. The recurrence only
// contracts over dk (left @ X) and over the chunk rows (right^T @ R), never over dv, so
// dv tiles are independent: no cross-block reduction exists, hence no atomics and no
// scratch partials. Inside a block, each output element is accumulated by one thread in
// a fixed index order. The same inputs therefore give the same bits on every run,
// stream and load. Keep it that way: the products that need no carry (O, dW, dQd, dKend,
// dP) are batched matmuls in the op layer after the scan (ops/gdr_core/chunk_state_op.cc), and
// dGlast, which contracts over dv and so across blocks, leaves this kernel only as
// per-thread partials (each slot written once by one thread) that the op layer sums in a
// fixed order.
// The tensor-core variant (kernels/gdr_core/chunk_state_tc_kernel.cuh, the default where it
// applies) keeps all of this: the same grid and dv tiles, no cross-block or cross-warp
// reduction (each warp owns whole output tiles of R and X' and sums over the full
// contraction itself), and each output element is one warp's fixed sequence of mma.sync
// instructions (3xTF32: accumulators big = sum a_big b_big, lo_a = sum a_small b_big,
// lo_b = sum a_big b_small, each in increasing k, added once as big + (lo_a + lo_b)) whose
// internal summation order the hardware fixes for given inputs. Its dGlast partials use
// this kernel's slots and element sets. The two kernels round differently, so their bits
// differ from each other (the execution policy's chunk_scan_tensor_cores selects one;
// kernels/gdr_core/chunk_state.h), but each is bit-reproducible.
#pragma once

#include "kernels/gdr_core/chunk_state.h"

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

// Thread t owns column j = t % 16 of the tile, with rg = t / 16: rows rg, rg + 16, rg + 32,
// rg + 48 of R, and the kRowsCarry consecutive rows rg * kRowsCarry + m of the carry. A
// warp thus covers two row groups and 16 consecutive columns, so its global loads and
// stores of R, the carry and the per-element operands are 16 consecutive words per row.
//
// The inner loops are shared-load bound, so every operand they read is laid out for
// 16-byte (float4) loads along the contraction index, with each output's fmaf chain
// still walking that index one element at a time in increasing order:
//   left @ X:     left_s[c][kk] (row-major, pitch kSlabK + 4) and carry_t_s[j][i] (the
//                 carry transposed, pitch DK + 4): per 4 kk, one float4 of the carry and
//                 one per R row, i.e. 5 loads for 16 fmaf;
//   right^T @ R:  r_t_s[j][c] (R transposed, pitch C + 4) and right_s[cc][i] (row-major):
//                 per 4 cc, one float4 of R and kRowsCarry / 4 per cc, as a thread's
//                 carry rows are consecutive.
// The +4 pitches keep float4 alignment and put the rows that one quarter-warp (the unit
// of a 16-byte shared access) reads, those of 8 consecutive columns j, on 8 distinct
// 4-bank groups; the two row groups of a warp read two distinct addresses of left_s or
// right_s, each a broadcast to 16 threads.
//
// The operands stream through shared memory in slabs: per chunk DK/32 slabs of `left`
// (all C rows, 32 of the dk columns), then C/16 slabs of `right` (16 rows, all dk
// columns). The chunk walk is latency-bound (one block per SM at the training shape), so
// every slab's global load is issued into registers one slab ahead (the next chunk's
// first left slab during the last right slab) and only stored to shared memory after the
// barrier that ends the previous slab's use; base and extra, which need no staging, are
// loaded at the top of the chunk. When an operand's base pointer is 16-byte aligned and
// its strides are multiples of 4 floats, the slab loads and stores are float4 (the same
// values land in the same shared slots; only the load width differs). Barriers: one after
// each slab's store (its data is visible, and for the first right slab also R in r_t_s)
// and one after each slab's use (the buffers and, at a phase's end, carry_t_s / r_t_s
// may be overwritten).
template <int DK>
__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(const ChunkStateScanArgs args) {
  constexpr int kRowsR = kC / kRowGroups;      // rows of R per thread (4)
  constexpr int kRowsCarry = DK / kRowGroups;  // rows of the carry per thread (4, 8, 16)
  constexpr int kLeftSlabs = DK / kSlabK;
  constexpr int kRightSlabs = kC / kSlabC;
  constexpr int kLeftLoads = kC * kSlabK / kThreads;   // floats per thread per left slab (8)
  constexpr int kRightLoads = kSlabC * DK / kThreads;  // per right slab (4, 8, 16)
  constexpr int kStaged = kLeftLoads > kRightLoads ? kLeftLoads : kRightLoads;
  constexpr int kLeftQuads = kSlabK / 4;  // float4s per left slab row (8)
  constexpr int kRightQuads = DK / 4;     // float4s per right slab row
  static_assert(DK % kSlabK == 0, "dk must split into whole slabs");
  static_assert((kSlabC * DK) % kThreads == 0, "right slab load must split evenly");
  static_assert(kLeftLoads % 4 == 0 && kRightLoads % 4 == 0, "slab loads must split in float4s");
  static_assert(kRowsCarry % 4 == 0 && kSlabK % 4 == 0 && kSlabC % 4 == 0, "float4 steps");

  __shared__ __align__(16) float carry_t_s[kTile][DK + 4];  // [j][i]: the carry, transposed
  __shared__ __align__(16) float r_t_s[kTile][kC + 4];      // [j][c]: R, transposed
  __shared__ __align__(16) float left_s[kC][kSlabK + 4];
  __shared__ __align__(16) float right_s[kSlabC][DK];

  const int tiles = args.dv / kTile;
  const int64_t bh = blockIdx.x / tiles;
  const int col0 = (blockIdx.x % tiles) * kTile;
  const int tid = threadIdx.x;
  const int j = tid % kTile;
  const int rg = tid / kTile;
  const int i0 = rg * kRowsCarry;  // the thread's first carry row
  const int64_t dv = args.dv;
  const int64_t state_size = static_cast<int64_t>(DK) * dv;

  auto quad_ok = [](const ChunkOperand& op) {
    return reinterpret_cast<uintptr_t>(op.data) % 16 == 0 && op.stride_bh % 4 == 0 &&
           op.stride_n % 4 == 0 && op.stride_row % 4 == 0;
  };
  const bool left_quads = quad_ok(args.left);
  const bool right_quads = quad_ok(args.right);

  // Scalar path: slab element e = tid + t * kThreads of a left slab is (row e / 32,
  // column k0 + e % 32); of a right slab (row c0 + e / DK, column e % DK): consecutive
  // threads read consecutive floats of a row. float4 path: quad q = tid + t * kThreads
  // covers the 4 elements from 4 * q on, staged[4 * t .. 4 * t + 3].
  float staged[kStaged];
  auto chunk_of = [&](int64_t step) { return args.reverse ? args.chunks - 1 - step : step; };
  auto load_left = [&](int64_t n, int k0) {
    const float* left = args.left.data + bh * args.left.stride_bh + n * args.left.stride_n;
    if (left_quads) {
#pragma unroll
      for (int t = 0; t < kLeftLoads / 4; ++t) {
        const int q = tid + t * kThreads;
        const float4 v = *reinterpret_cast<const float4*>(
            left + (q / kLeftQuads) * args.left.stride_row + k0 + (q % kLeftQuads) * 4);
        staged[4 * t] = v.x;
        staged[4 * t + 1] = v.y;
        staged[4 * t + 2] = v.z;
        staged[4 * t + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int t = 0; t < kLeftLoads; ++t) {
        const int e = tid + t * kThreads;
        staged[t] = left[(e / kSlabK) * args.left.stride_row + k0 + e % kSlabK];
      }
    }
  };
  auto store_left = [&]() {
    if (left_quads) {
#pragma unroll
      for (int t = 0; t < kLeftLoads / 4; ++t) {
        const int q = tid + t * kThreads;
        const float4 v = {staged[4 * t], staged[4 * t + 1], staged[4 * t + 2], staged[4 * t + 3]};
        *reinterpret_cast<float4*>(&left_s[q / kLeftQuads][(q % kLeftQuads) * 4]) = v;
      }
    } else {
#pragma unroll
      for (int t = 0; t < kLeftLoads; ++t) {
        const int e = tid + t * kThreads;
        left_s[e / kSlabK][e % kSlabK] = staged[t];
      }
    }
  };
  auto load_right = [&](int64_t n, int c0) {
    const float* right = args.right.data + bh * args.right.stride_bh + n * args.right.stride_n;
    if (right_quads) {
#pragma unroll
      for (int t = 0; t < kRightLoads / 4; ++t) {
        const int q = tid + t * kThreads;
        const float4 v = *reinterpret_cast<const float4*>(
            right + (c0 + q / kRightQuads) * args.right.stride_row + (q % kRightQuads) * 4);
        staged[4 * t] = v.x;
        staged[4 * t + 1] = v.y;
        staged[4 * t + 2] = v.z;
        staged[4 * t + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int t = 0; t < kRightLoads; ++t) {
        const int e = tid + t * kThreads;
        staged[t] = right[(c0 + e / DK) * args.right.stride_row + e % DK];
      }
    }
  };
  auto store_right = [&]() {
    if (right_quads) {
#pragma unroll
      for (int t = 0; t < kRightLoads / 4; ++t) {
        const int q = tid + t * kThreads;
        const float4 v = {staged[4 * t], staged[4 * t + 1], staged[4 * t + 2], staged[4 * t + 3]};
        *reinterpret_cast<float4*>(&right_s[q / kRightQuads][(q % kRightQuads) * 4]) = v;
      }
    } else {
#pragma unroll
      for (int t = 0; t < kRightLoads; ++t) {
        const int e = tid + t * kThreads;
        right_s[e / DK][e % DK] = staged[t];
      }
    }
  };

  float carry[kRowsCarry];
#pragma unroll
  for (int m = 0; m < kRowsCarry; ++m) {
    carry[m] = args.carry_in ? args.carry_in[bh * state_size + (i0 + m) * dv + col0 + j] : 0.0f;
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
      extra_v[m] = args.extra ? args.extra[bhn * state_size + (i0 + m) * dv + col0 + j] : 0.0f;
    }
    const float decay = expf(args.g_last[bhn]);
    // dGlast partials keep their own element set per thread, rows rg + 16 m of column j
    // (the slots the op layer sums in a fixed order), read back from carry_t_s below.
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
    for (int m = 0; m < kRowsCarry; m += 4) {
      const float4 v = {carry[m], carry[m + 1], carry[m + 2], carry[m + 3]};
      *reinterpret_cast<float4*>(&carry_t_s[j][i0 + m]) = v;
    }
#pragma unroll
    for (int m = 0; m < kRowsCarry; ++m) {
      args.carries_out[bhn * state_size + (i0 + m) * dv + col0 + j] = carry[m];
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
      if (s == 0 && args.dot_with) {
        // m in order; the op layer sums the partials of (bh, n) in a fixed order.
        float dot = 0.0f;
#pragma unroll
        for (int m = 0; m < kRowsCarry; ++m) {
          dot = fmaf(dot_v[m], carry_t_s[j][rg + m * kRowGroups], dot);
        }
        args.dot_out[(bhn * tiles + blockIdx.x % tiles) * kThreads + tid] = decay * dot;
      }
      const int k0 = s * kSlabK;
#pragma unroll
      for (int kk = 0; kk < kSlabK; kk += 4) {
        const float4 x = *reinterpret_cast<const float4*>(&carry_t_s[j][k0 + kk]);
#pragma unroll
        for (int m = 0; m < kRowsR; ++m) {
          const float4 l = *reinterpret_cast<const float4*>(&left_s[rg + m * kRowGroups][kk]);
          acc[m] = fmaf(l.x, x.x, acc[m]);
          acc[m] = fmaf(l.y, x.y, acc[m]);
          acc[m] = fmaf(l.z, x.z, acc[m]);
          acc[m] = fmaf(l.w, x.w, acc[m]);
        }
      }
      __syncthreads();
    }
    float* rows_out = args.rows_out + bhn * kC * dv;
#pragma unroll
    for (int m = 0; m < kRowsR; ++m) {
      const int c = rg + m * kRowGroups;
      const float r = base_v[m] + args.left_sign * acc[m];
      r_t_s[j][c] = r;
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
#pragma unroll
      for (int cc = 0; cc < kSlabC; cc += 4) {
        const float4 r4 = *reinterpret_cast<const float4*>(&r_t_s[j][c0 + cc]);
        const float r[4] = {r4.x, r4.y, r4.z, r4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
          for (int m = 0; m < kRowsCarry; m += 4) {
            const float4 w = *reinterpret_cast<const float4*>(&right_s[cc + u][i0 + m]);
            upd[m] = fmaf(w.x, r[u], upd[m]);
            upd[m + 1] = fmaf(w.y, r[u], upd[m + 1]);
            upd[m + 2] = fmaf(w.z, r[u], upd[m + 2]);
            upd[m + 3] = fmaf(w.w, r[u], upd[m + 3]);
          }
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
    args.carry_final[bh * state_size + (i0 + m) * dv + col0 + j] = carry[m];
  }
}

}  // namespace gdr::kernels::chunk_state_detail
