// The chunk prep kernel bodies (device code only; see kernels/gdr_core/chunk_prep.h for the
// formulas and layouts). Included by kernels/gdr_core/chunk_prep.cu, which wraps each body in a
// __global__ kernel with dynamic shared memory, and by the CPU test
// //tests/ops:gdr_chunk_prep_kernel_emulation_test, which supplies host stand-ins for the
// CUDA built-ins and runs these very bodies with one host thread per CUDA thread.
// NOTE: keep this file free of includes (besides kernels/common/mma_tf32.cuh,
// kernels/common/cp_async.cuh and <type_traits>) and of CUDA APIs beyond __device__,
// __forceinline__, __syncthreads, threadIdx, blockIdx, __uint_as_float, __float_as_uint, expf, fmaf
// and rsqrtf, the tensor-core primitives of kernels/common/mma_tf32.cuh and cp_async_4 /
// cp_async_16 / cp_async_wait_all (device-only loads sit under #ifdef __CUDA_ARCH__): the emulation
// test defines exactly those (with GDR_MMA_TF32_HOST_HELPERS, GDR_CP_ASYNC_HOST_HELPERS,
// tests/ops/emulated_mma_tf32.h and emulated_cp_async.h).
//
// Note [Chunk prep determinism]
// One block owns one (batch, value head, chunk) and writes only that chunk's rows of every
// output (forward: its slice of u, w, qd, p, kend, g_last; backward: rows n*C .. n*C+C-1 of
// dq, dk, dv, dg, dbeta for its value head). Gradients never cross chunks: g reaches G only
// through the cumsum inside its own chunk, and the chunk state scan carries everything
// that does cross chunks. So there is no cross-block reduction inside the kernels, hence
// no atomics. The one sum across blocks is that of the head groups: when head_group > 1
// the value heads of one key head (different blocks) each write their own FP32 dq, dk
// partial row (every slot written once), and the op sums them in value-head order with
// elementwise adds on the same stream (Note [Head group gradient sum] in
// ops/gdr_core/chunk_prep_op.cc). Inside a block every output element is accumulated by one
// thread in a fixed index order (which thread owns which element depends only on the
// block size, a constant of each kernel: Note [Chunk prep tile maps]); the backward's
// row sums are eight fixed parts (each one thread's in-order sum over a fixed range,
// in shared memory) that one thread per row adds in part order, 0 to 7; the fused L2
// norm's sums of squares are one thread per row, columns in order,
// and its backward's row dots sixteen per-thread partials added in thread order by every
// thread of the row (Note [Fused q/k L2 norm]); the cumsums are one thread's sequential
// loop. In the tensor-core variant (Note [Chunk prep on tensor cores]) the converted
// products' elements are each one warp's fixed sequence of 3xTF32 mma instructions
// (every warp owns whole 16 x 8 output tiles and contracts the full depth itself: no
// cross-warp reduction), whose internal order the hardware fixes. The same inputs
// therefore give the same bits on every run, stream and load, in each variant (the two
// variants' bits differ from each other).
//
// Note [Fused q/k L2 norm]
// With l2_normalize_qk the kernels read q and k un-normalised (the causal conv's output,
// BF16 in training) and normalise each row of dk elements on load, which is what the ATen
// composite (ops/gdr_core/chunk_prep_op.h, chunk_prep_qk) does with x * rsqrt(sum(x^2) + eps):
//   r = rsqrtf(ss + eps), ss = sum_c x_c^2 as one thread's fmaf chain, c ascending;
//   xn = x * r;  Q = xn * scale (two roundings, as the composite's two multiplies).
// The composite's order of the sum of squares differs (ATen's reduction tree), and
// rsqrtf is the device's approximate reciprocal square root (what at::rsqrt runs on CUDA),
// so the normalised rows agree with the composite's to a few FP32 ulps, not bit for bit.
// The backward recomputes r and xn from the same inputs with the same code (the same
// bits), then maps the gradient dxn of the normalised row back:
//   dx = r * (dxn - xn * <xn, dxn>),
// the compact form of what autograd gives for the composite (dxn r - x <dxn, x> r^3: the
// same value since xn = x r, without r^3, which underflows for large rows). xn of k is
// K itself (shared memory); xn of q is recomputed from q reloaded from global memory
// (shared memory holds scale * xn, and dividing by scale would add a rounding).
//
// Note [Chunk prep on tensor cores]
// With TC (the backward's template parameter; its launcher picks it with
// chunk_prep_uses_tensor_cores, on unless the execution policy's chunk_prep_tensor_cores
// is false) the backward's two largest product phases run as warp-level mma.sync m16n8k8
// TF32 with the 3xTF32 split (Note [3xTF32 products] in kernels/common/mma_tf32.cuh:
// FP32-level accuracy): dM = -dR X^T (phase 3: C x C contracting over dv + dk, X = [U | W]
// streamed through the slab buffer) and phase 6 below; both phases are faster so
// (measured: docs/benchmarks.md, GDR core kernels: cycles per chunk). The Gram tiles K K^T
// and Q K^T (phase 1 here and in the forward) stay FP32 SIMT in both variants: on tensor
// cores they are no faster in the backward and slower in the forward (docs/benchmarks.md,
// Decisions), and one SIMT version keeps the backward's recomputed M the forward's bits.
// Only the lower triangle of dM is used: of the 4 x 8 grid of 16 x 8 tiles, the 20 with
// column block cb < 2 rb + 2 touch it; warp w of 16 owns lower tiles w and w + 16 (< 20:
// warps 0-3 two tiles, the others one) and keeps their accumulators across the slabs,
// c increasing. The tiles wholly above the diagonal are not computed; the consumers get 0
// there, as in the SIMT product.
// Phase 6 (dK = (dKK + dKK^T) K + dQK^T Q, dQ = dQK K: three C x C by C x dk products,
// ~3 MFLOP per block at dk = 128, the largest) runs in dkdq_tc:
// warp w = 4 cg + rb owns rows 16 rb .. + 15 and, in each of dk / 64 column passes p,
// the columns 64 p + 16 cg .. + 15 (two 16 x 8 tiles) of both dK and dQ: 4 Acc3, 48
// accumulator floats (8 tiles x 12 at once would not fit 128 registers). Every dK element
// is one chain over j = 0 .. C-1 of K, then j = 0 .. C-1 of Q (k0 ascending, a fixed
// order); every dQ element one chain over K; A1 and A3 share the K fragments. The k slots
// of an mma are the rows j = k0 + 2t (slot t) and k0 + 2t + 1 (slot t + 4), so that the
// B fragments (K, Q rows at pitch dk + 4 = 4 mod 32) hit banks 8t + g. The A operands
// (A1 = dKK + dKK^T, formed in place in d1 during phase 5, one thread per pair; A3 = dQK
// = d2; A2 = dQK^T = d2 read transposed) come from d1, d2 stored from phase 3 on at pitch
// C with the XOR swizzle cc_at (conflict-free both directly and transposed; the SIMT
// variant keeps pitch C + 1). Each pass's finished tiles go to shared memory (stage_at,
// a swizzled [C][64] per output): pass 0 to kl and pm (free once phase 5's part sums are
// read), pass 1 (dk = 128) to d1 and d2 after a barrier (every warp done reading them).
// After one more barrier every thread reads its SIMT (tr, tc) elements back and the
// epilogue runs unchanged: the row terms, the scale, the fused L2 norm's row dots (16
// per-thread partials added in thread order) and the stores, with the same formulas and
// order as the SIMT variant. So all phase-6 products are tensor-core products, with no
// cross-warp reduction and no atomics. The other products (the Gram tiles, the triangular
// solves, the row sums) are the FP32 SIMT code in both variants; the solves are
// sequential in the row index and stay SIMT.
#pragma once

#include <type_traits>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/mma_tf32.cuh"
#include "kernels/gdr_core/chunk_prep.h"

namespace gdr::kernels::chunk_prep_detail {

constexpr int kC = kChunkPrepChunk;
constexpr int kForwardThreads = kChunkPrepForwardThreads;    // 8 warps
constexpr int kBackwardThreads = kChunkPrepBackwardThreads;  // 16 warps
constexpr int kSlab = kChunkPrepSlab;

// Note [Chunk prep tile maps]
// The SIMT C x C products (the Gram tiles K K^T, Q K^T and the backward's dM = -dR X^T)
// split their outputs over the block's Threads as kRowThreads x 16 threads: thread
// (ti, tj) = (tid / 16, tid % 16) owns rows ti + kRowThreads a (a < kRows) and columns
// tj + 16 b (b < 4), and sums every one of them itself over the contraction index in
// order. Forward (256 threads): 16 x 16 threads, 4 x 4 elements each; backward (512):
// 32 x 16 threads, 2 x 4 each. A warp is two values of ti (broadcast reads) and sixteen
// of tj. Only the lower triangle (i >= j) is ever used: tile (a, b) lies wholly above
// the diagonal, and is skipped (left zero), when its largest i - j = kRowThreads (a + 1)
// - 1 - 16 b is negative (forward: a < b, 6 of 16; backward: b >= 2 a + 2, 2 of 8).
template <int Threads>
struct TileMap {
  static constexpr int kColThreads = 16;
  static constexpr int kRowThreads = Threads / kColThreads;
  static constexpr int kRows = kC / kRowThreads;
  static constexpr int kCols = kC / kColThreads;
  static_assert(Threads % kColThreads == 0 && kC % kRowThreads == 0 && kC % kColThreads == 0,
                "C x C products use every thread once, in whole tiles");
  static constexpr bool above(int a, int b) { return kRowThreads * (a + 1) <= kColThreads * b; }
};

// BF16 as stored by at::BFloat16: the high half of an FP32.
struct Bf16 {
  unsigned short bits;
};
__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const Bf16* p) {
  return __uint_as_float(static_cast<unsigned>(p->bits) << 16);
}
__device__ __forceinline__ void store_float(float* p, float x) { *p = x; }
// Round to nearest even with NaN kept a NaN: at::BFloat16's float conversion, so a BF16
// gradient written here has the bits an FP32 gradient cast by ATen would have.
__device__ __forceinline__ void store_float(Bf16* p, float x) {
  const unsigned u = __float_as_uint(x);
  p->bits = x != x ? static_cast<unsigned short>(0x7fc0)
                   : static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One element of dq or dk: in q's type, or an FP32 partial when the value heads of a key
// head are summed by the caller (head_group > 1).
template <typename TQK>
__device__ __forceinline__ void store_qk_grad(void* base, bool partials, long long at, float x) {
  if (partials) {
    store_float(static_cast<float*>(base) + at, x);
  } else {
    store_float(static_cast<TQK*>(base) + at, x);
  }
}

// Where a block's chunk lives.
struct ChunkPlace {
  long long block;  // (b * H + h) * N + n: index of the chunk in the [B, H, N] outputs
  long long row0;   // element offset of token n*C, head h in a contiguous [B, T, H] (the
                    // gradients' layout; times d for dq, dk, dv)
  long long b, h, t0;
  long long kh;  // the key head of q and k that value head h reads: h / head_group
  int rows;      // rows of the chunk inside the sequence (the rest are padding)
};

__device__ __forceinline__ ChunkPlace chunk_place(const ChunkPrepShape& s, unsigned block) {
  ChunkPlace place;
  place.block = block;
  const long long n = place.block % s.chunks;
  const long long bh = place.block / s.chunks;
  place.h = bh % s.heads;
  place.b = bh / s.heads;
  place.kh = place.h / s.head_group;
  place.t0 = n * kC;
  place.row0 = (place.b * s.tokens + place.t0) * s.heads + place.h;
  const long long left = s.tokens - place.t0;
  place.rows = left < kC ? static_cast<int>(left) : kC;
  return place;
}
__device__ __forceinline__ ChunkPlace chunk_place(const ChunkPrepShape& s) {
  return chunk_place(s, blockIdx.x);
}

// Element offset of row i of the chunk, head place.h, in dq / dk (d = dk) or dv (d = dv):
// ChunkPrepBackwardArgs::grad_token_stride, or the contiguous [B, T, H, d] layout.
__device__ __forceinline__ long long grad_row(const ChunkPrepShape& s, long long token_stride,
                                              const ChunkPlace& place, int i, int d) {
  const long long stride = token_stride != 0 ? token_stride : s.heads * static_cast<long long>(d);
  return (place.b * s.tokens + place.t0 + i) * stride + place.h * d;
}

// Element offset of row i of the chunk in an input with the given strides: v, g, beta
// (value heads), and q, k (key heads).
__device__ __forceinline__ long long input_row(const TokenStrides& st, const ChunkPlace& place,
                                               int i) {
  return place.b * st.batch + (place.t0 + i) * st.token + place.h * st.head;
}
__device__ __forceinline__ long long key_row(const TokenStrides& st, const ChunkPlace& place,
                                             int i) {
  return place.b * st.batch + (place.t0 + i) * st.token + place.kh * st.head;
}

// Four floats read as one 16-byte shared-memory load (the address must be 16-byte aligned:
// every region of the carve-ups starts at a multiple of 4 floats, every pitch is a multiple
// of 4 or, for the odd-pitch C x C matrices, never read this way, and the reads start at
// multiples of 4 columns).
//
// Note [Chunk prep shared pitches]
// The rows that inner loops read along their contraction index (K, Q: dk + 4; [dU | dW]:
// dv + dk + 4; the X slab: 32 + 4; M^T: C) have pitches that are multiples of 4, so those
// loops take 16-byte loads of 4 consecutive elements and still walk the index one fmaf at
// a time in order (the bits of the one-float loads). A pitch of 4 or 20 mod 32 also spreads
// the 8 rows that one quarter-warp (the unit of a 16-byte access) reads when each thread
// owns a row (the L2 norm's sums of squares, phase 5's row sums) over the 32 banks. The C x
// C matrices that are also read down columns keep pitch C + 1.
struct alignas(16) Vec4 {
  float v[4];
};
__device__ __forceinline__ Vec4 load_vec4(const float* p) {
#ifdef __CUDA_ARCH__
  // One ld.shared.v4 by hand: nvcc splits a plain 16-byte load (of this struct or of a
  // float4) into four scalar loads here. volatile + "memory": never moved across the
  // barrier that publishes M (ptxas still schedules it among the FMAs).
  Vec4 r;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(r.v[0]), "=f"(r.v[1]), "=f"(r.v[2]), "=f"(r.v[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p)))
               : "memory");
  return r;
#else
  return *reinterpret_cast<const Vec4*>(p);
#endif
}
// The same from global memory: the wide-head backward's panel (Note [Chunk prep wide-head
// backward]), written by this block earlier (so no read-only cache path).
__device__ __forceinline__ Vec4 load_vec4_global(const float* p) {
#ifdef __CUDA_ARCH__
  Vec4 r;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(r.v[0]), "=f"(r.v[1]), "=f"(r.v[2]), "=f"(r.v[3])
               : "l"(__cvta_generic_to_global(p))
               : "memory");
  return r;
#else
  return *reinterpret_cast<const Vec4*>(p);
#endif
}

// Four consecutive values of a read-only input in global memory (FP32: 16-byte aligned;
// BF16: 8-byte aligned), as one load: the rows that one thread reads along their length
// while a warp's threads read 32 different rows (phase 5 of the backward) otherwise cost
// one L1 wavefront per thread and value.
__device__ __forceinline__ Vec4 load4_input(const float* p) {
  Vec4 r;
#ifdef __CUDA_ARCH__
  asm("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(r.v[0]), "=f"(r.v[1]), "=f"(r.v[2]), "=f"(r.v[3])
      : "l"(__cvta_generic_to_global(p)));
#else
  for (int u = 0; u < 4; ++u) r.v[u] = p[u];
#endif
  return r;
}
__device__ __forceinline__ Vec4 load4_input(const Bf16* p) {
  Vec4 r;
#ifdef __CUDA_ARCH__
  unsigned lo, hi;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];"
      : "=r"(lo), "=r"(hi)
      : "l"(__cvta_generic_to_global(p)));
  r.v[0] = __uint_as_float(lo << 16);
  r.v[1] = __uint_as_float(lo & 0xffff0000u);
  r.v[2] = __uint_as_float(hi << 16);
  r.v[3] = __uint_as_float(hi & 0xffff0000u);
#else
  for (int u = 0; u < 4; ++u) r.v[u] = load_float(p + u);
#endif
  return r;
}

// x, as a value the compiler cannot see through: what derives from it is computed afresh.
// The backward's triangular solve stores its column through row addresses i * pitch;
// with the load's pitch the compiler keeps all C addresses of the loads live across the
// solve to reuse them (C registers more than the column itself) and spills at 128.
template <typename T>  // a 32-bit integer type
__device__ __forceinline__ T opaque(T x) {
  static_assert(sizeof(T) == 4, "one 32-bit register");
#ifdef __CUDA_ARCH__
  asm volatile("" : "+r"(x));
#endif
  return x;
}

// Loads g and beta of the chunk (zeros past the end) and forms G = cumsum(g) and exp(G).
// One thread does the cumsum: 64 sequential adds, a fixed order (the ATen composite's
// scan order differs, which only moves the last bits).
template <typename Args>
__device__ __forceinline__ void load_decays(const Args& args, const ChunkPlace& place, float* gs,
                                            float* bs, float* es) {
  const int tid = threadIdx.x;
  if (tid < kC) {
    const bool real = tid < place.rows;
    gs[tid] = real ? args.g[input_row(args.g_strides, place, tid)] : 0.0f;
    bs[tid] = real ? args.beta[input_row(args.beta_strides, place, tid)] : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {
    float acc = 0.0f;
    for (int i = 0; i < kC; ++i) {
      acc += gs[i];
      gs[i] = acc;
      es[i] = expf(acc);
    }
  }
}

// Note [Batched global loads]
// A loop that alternates a global load with a shared store runs one load at a time: the
// load goes through a generic pointer that might alias the shared array, so neither nvcc
// nor ptxas moves the next load above the store, and each iteration waits the full global
// latency (with few warps per SM nothing else hides it). The copies below load kLoadBatch
// values per thread into registers first and store them after. Pure data movement: the
// values and bits are those of the one-at-a-time loops.
constexpr int kLoadBatch = 8;

// Whether every row of an input with these strides may be read in aligned groups of
// kGroup elements from multiples of kGroup (kGroup * sizeof(T) bytes per access): 4 for
// load4_input, 2 and 8 for the forward's BF16 v staging (4- and 16-byte cp.async).
template <int kGroup, typename T>
__device__ __forceinline__ bool rows_aligned(const T* base, const TokenStrides& st) {
  return reinterpret_cast<unsigned long long>(base) % (kGroup * sizeof(T)) == 0 &&
         st.batch % kGroup == 0 && st.token % kGroup == 0 && st.head % kGroup == 0;
}

// Whether two pointers are both 16-byte aligned (16-byte copies and loads of FP32 rows
// whose widths are multiples of 4).
__device__ __forceinline__ bool both_16_byte_aligned(const void* a, const void* b) {
  return ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b)) &
          15ull) == 0;
}

// K (and scale * Q) of the chunk into shared rows of the given pitches; zeros past the end.
// With the fused L2 norm both are loaded raw and normalize_qk finishes them. Threads: the
// block's thread count (here and in the helpers below; each element is one thread's).
// Where both inputs' rows allow it (rows_aligned<4>; dk is a multiple of 16), four consecutive
// values per load (load4_input: 8 bytes of BF16, 16 of FP32), kQuadBatch loads per thread
// and input in flight: a BF16 chunk at dk = 128 then takes 4 x 8-byte loads per thread and
// input in two round trips (256 threads) or one (512), instead of 32 or 16 2-byte loads in
// four or two. Pure data movement: the values (each q value still times q_mul) and bits are
// those of the one-value path below.
constexpr int kQuadBatch = 4;
template <typename TIn, int Threads, typename Args>
__device__ __forceinline__ void load_qk(const Args& args, const ChunkPlace& place, float* qs,
                                        int q_pitch, float* ks, int k_pitch) {
  const ChunkPrepShape& s = args.shape;
  const TIn* q = static_cast<const TIn*>(args.q);
  const TIn* k = static_cast<const TIn*>(args.k);
  const float q_mul = s.l2_normalize_qk ? 1.0f : s.scale;
  const int dk = s.dk, n = kC * dk, tid = threadIdx.x;
  if (rows_aligned<4>(q, args.q_strides) && rows_aligned<4>(k, args.k_strides)) {
    for (int e0 = 0; e0 < n; e0 += 4 * Threads * kQuadBatch) {
      Vec4 qv[kQuadBatch], kv[kQuadBatch];
#pragma unroll
      for (int m = 0; m < kQuadBatch; ++m) {
        const int e = e0 + 4 * (tid + Threads * m), i = e / dk, c = e % dk;
        qv[m] = kv[m] = Vec4{{0.0f, 0.0f, 0.0f, 0.0f}};
        if (e < n && i < place.rows) {
          qv[m] = load4_input(q + key_row(args.q_strides, place, i) + c);
          kv[m] = load4_input(k + key_row(args.k_strides, place, i) + c);
        }
      }
#pragma unroll
      for (int m = 0; m < kQuadBatch; ++m) {
        const int e = e0 + 4 * (tid + Threads * m), i = e / dk, c = e % dk;
        if (e < n) {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            qs[i * q_pitch + c + u] = qv[m].v[u] * q_mul;
            ks[i * k_pitch + c + u] = kv[m].v[u];
          }
        }
      }
    }
    return;
  }
  for (int e0 = 0; e0 < n; e0 += Threads * kLoadBatch) {
    float qv[kLoadBatch], kv[kLoadBatch];
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const int e = e0 + tid + Threads * m, i = e / dk, c = e % dk;
      qv[m] = kv[m] = 0.0f;
      if (e < n && i < place.rows) {
        qv[m] = load_float(q + key_row(args.q_strides, place, i) + c) * q_mul;
        kv[m] = load_float(k + key_row(args.k_strides, place, i) + c);
      }
    }
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const int e = e0 + tid + Threads * m, i = e / dk, c = e % dk;
      if (e < n) {
        qs[i * q_pitch + c] = qv[m];
        ks[i * k_pitch + c] = kv[m];
      }
    }
  }
}

// The fused L2 norm of the raw rows load_qk left in qs and ks (Note [Fused q/k L2 norm]):
// rq[i], rk[i] = rsqrt(sum of squares + eps), one thread per row (threads C .. 3C-1, so
// that thread 0's cumsum in load_decays runs alongside), then Q = (q r) scale, K = k r in
// place. Starts after a barrier that published the raw rows; the caller's next barrier
// publishes the result. Padded rows are zero and stay zero (r = rsqrt(eps) is finite).
template <int Threads>
__device__ __forceinline__ void normalize_qk(const ChunkPrepShape& s, float* qs, int q_pitch,
                                             float* ks, int k_pitch, float* rq, float* rk) {
  const int tid = threadIdx.x, dk = s.dk;
  static_assert(3 * kC <= Threads, "one thread per q row and per k row besides thread 0");
  if (tid >= kC && tid < 3 * kC) {
    const int i = (tid - kC) % kC;
    const bool is_q = tid < 2 * kC;
    const float* row = is_q ? qs + i * q_pitch : ks + i * k_pitch;
    float ss = 0.0f;
    for (int c = 0; c < dk; c += 4) {  // 16-byte loads, c still in order
      const Vec4 x = load_vec4(row + c);
#pragma unroll
      for (int u = 0; u < 4; ++u) ss = fmaf(x.v[u], x.v[u], ss);
    }
    (is_q ? rq : rk)[i] = rsqrtf(ss + kChunkPrepL2Eps);
  }
  __syncthreads();
  for (int e = tid; e < kC * dk; e += Threads) {
    const int i = e / dk, c = e % dk;
    qs[i * q_pitch + c] = (qs[i * q_pitch + c] * rq[i]) * s.scale;
    ks[i * k_pitch + c] = ks[i * k_pitch + c] * rk[i];
  }
}

// A contiguous [C][width] global array (nullptr: zeros) into shared rows of the given
// pitch, kLoadBatch loads in flight per thread (Note [Batched global loads]).
template <int Threads>
__device__ __forceinline__ void copy_rows(const float* src, int width, float* dst, int pitch) {
  const int n = kC * width, tid = threadIdx.x;
  for (int e0 = 0; e0 < n; e0 += Threads * kLoadBatch) {
    float r[kLoadBatch];
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const int e = e0 + tid + Threads * m;
      r[m] = src && e < n ? src[e] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const int e = e0 + tid + Threads * m;
      if (e < n) dst[(e / width) * pitch + e % width] = r[m];
    }
  }
}

// Thread (ti, tj) computes its tiles (Note [Chunk prep tile maps]) of K K^T and Q K^T, dk
// summed in order. The rows come in 16-byte loads of 4 consecutive c (pitches multiples
// of 4, = 4 mod 32: Note [Chunk prep shared pitches]) and every product still sums c = 0,
// 1, 2, ... one fmaf at a time: per 4 c, 12 loads for 80 fmaf (forward), 8 for 48
// (backward). Within a warp ti takes two values (two broadcast addresses) and tj sixteen
// rows, those of one quarter-warp on 8 distinct 4-bank groups.
template <int Threads>
__device__ __forceinline__ void gram_tiles(
    const float* qs, int q_pitch, const float* ks, int k_pitch, int dk,
    float (&kk)[TileMap<Threads>::kRows][TileMap<Threads>::kCols],
    float (&qk)[TileMap<Threads>::kRows][TileMap<Threads>::kCols]) {
  using Map = TileMap<Threads>;
  const int ti = threadIdx.x / Map::kColThreads, tj = threadIdx.x % Map::kColThreads;
  for (int a = 0; a < Map::kRows; ++a) {
    for (int b = 0; b < Map::kCols; ++b) kk[a][b] = qk[a][b] = 0.0f;
  }
  for (int c = 0; c < dk; c += 4) {
    Vec4 kr[Map::kRows], qr[Map::kRows], kc[Map::kCols];
#pragma unroll
    for (int a = 0; a < Map::kRows; ++a) {
      kr[a] = load_vec4(ks + (ti + Map::kRowThreads * a) * k_pitch + c);
      qr[a] = load_vec4(qs + (ti + Map::kRowThreads * a) * q_pitch + c);
    }
#pragma unroll
    for (int b = 0; b < Map::kCols; ++b) {
      kc[b] = load_vec4(ks + (tj + Map::kColThreads * b) * k_pitch + c);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int a = 0; a < Map::kRows; ++a) {
#pragma unroll
        for (int b = 0; b < Map::kCols; ++b) {
          if (Map::above(a, b)) continue;
          kk[a][b] = fmaf(kr[a].v[u], kc[b].v[u], kk[a][b]);
          qk[a][b] = fmaf(qr[a].v[u], kc[b].v[u], qk[a][b]);
        }
      }
    }
  }
}

// The 16 x 8 tiles of a C x C product that touch its lower triangle (i >= j): of the
// 4 x 8 grid, row block rb holds column blocks cb = 0 .. 2 rb + 1, 20 tiles in all,
// numbered row block by row block. Tiles with cb >= 2 rb + 2 lie wholly above the diagonal.
constexpr int kLowerTiles = 20;
__device__ __forceinline__ void lower_tile(int x, int& rb, int& cb) {
  rb = 0;
  while (x >= 2 * rb + 2) {
    x -= 2 * rb + 2;
    ++rb;
  }
  cb = x;
}
__device__ __forceinline__ bool above_lower_tiles(int i, int j) {
  return j / 8 >= 2 * (i / 16) + 2;
}

// The backward's C x C matrices d1, d2 from phase 3 on, in the tensor-core variant: pitch
// C with an XOR swizzle of the column's low five bits, element (i, j) at
// i C + (j ^ cc_swizzle(i)) (a permutation inside each aligned 32-column half, so a warp's
// row-wise accesses stay conflict-free). Phase 6 reads them as mma A fragments both
// directly (rows 16 rb + g (+ 8), columns k0 + 2t (+ 1)) and transposed (rows k0 + 2t
// (+ 1), columns 16 rb + g (+ 8)); with this swizzle both hit 32 distinct banks, as do
// phase 3's fragment stores (Note [Chunk prep on tensor cores]).
__device__ __forceinline__ int cc_swizzle(int i) { return (i & 1) | (((i >> 1) & 3) << 3); }
__device__ __forceinline__ int cc_at(int i, int j) { return i * kC + (j ^ cc_swizzle(i)); }

// Phase 6's staging of one 64-column pass of dK (or dQ) in the tensor-core variant:
// [C][64] with element (i, c) at i 64 + (c ^ stage_swizzle(i)). The fragment stores (rows
// g (+ 8), columns 2t + e) and the epilogue's reads (rows tr, tr + 1 of one warp, columns
// tc + 16 b) both hit 32 distinct banks.
constexpr int kStageCols = 64;
__device__ __forceinline__ int stage_swizzle(int i) {
  return ((i & 1) << 4) | (((i >> 1) & 1) << 3) | ((i >> 2) & 1);
}
__device__ __forceinline__ int stage_at(int i, int c) {
  return i * kStageCols + (c ^ stage_swizzle(i));
}

// Phase 6's products on tensor cores (Note [Chunk prep on tensor cores]):
//   dK = A1 K + A2 Q, A1 = dKK + dKK^T (d1, symmetrised in place), A2 = dQK^T (d2 read
//   transposed); dQ = A3 K, A3 = dQK (d2), the sums over j (the mma's k) in C x DK outputs.
// Warp w = 4 cg + rb owns rows 16 rb .. 16 rb + 15 and, in pass p (DK / 64 passes),
// columns 64 p + 16 cg .. + 15 (two 16 x 8 tiles) of both dK and dQ: 4 Acc3 (48 floats).
// Each dK element is one chain: j = 0 .. C-1 over K (k0 ascending), then j = 0 .. C-1 over
// Q; each dQ element one chain over K. The k slots of one mma map to rows j = k0 + 2t
// (slot t) and k0 + 2t + 1 (slot t + 4), so that B[k][n] = K[j][c] (pitch DK + 4 = 4 mod
// 32) hits banks 8t + g: conflict-free. A1 and A3 share the K-row B fragments. Pass p's
// finished tiles go to stage[p] (dK at stage[p], dQ at stage[p] + C 64, stage_at);
// stage[1] overlays d1 and d2, so pass 1 stores after a barrier. Ends with a barrier.
template <int DK>
__device__ __forceinline__ void dkdq_tc(const float* d1, const float* d2, const float* ks,
                                        const float* qs, float* stage0, float* stage1) {
  using namespace mma_tf32;
  constexpr int kp = DK + 4;
  static_assert(kC == 64 && DK % kStageCols == 0 && kBackwardThreads == 512,
                "16 warps: 4 row blocks x 4 column groups of 16 per 64-column pass");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int rb = warp % 4, cg = warp / 4;
  const int i0 = 16 * rb;
#pragma unroll 1
  for (int pass = 0; pass < DK / kStageCols; ++pass) {
    const int c0 = kStageCols * pass + 16 * cg;
    Acc3 kacc[2], qacc[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      zero(kacc[n]);
      zero(qacc[n]);
    }
    // j over K: dK += A1 K, dQ += A3 K.
#pragma unroll 2
    for (int k0 = 0; k0 < kC; k0 += 8) {
      uint32_t a1_big[4], a1_small[4], a3_big[4], a3_small[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + g + 8 * (e & 1), j = k0 + 2 * t + (e >> 1);
        split_tf32(d1[cc_at(i, j)], a1_big[e], a1_small[e]);
        split_tf32(d2[cc_at(i, j)], a3_big[e], a3_small[e]);
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t b_big[2], b_small[2];
        const float* b = ks + (k0 + 2 * t) * kp + c0 + 8 * n + g;
        split_tf32(b[0], b_big[0], b_small[0]);
        split_tf32(b[kp], b_big[1], b_small[1]);
        mma_3xtf32(kacc[n], a1_big, a1_small, b_big, b_small);
        mma_3xtf32(qacc[n], a3_big, a3_small, b_big, b_small);
      }
    }
    // j over Q: dK += A2 Q, A2_ij = dQK_ji.
#pragma unroll 2
    for (int k0 = 0; k0 < kC; k0 += 8) {
      uint32_t a2_big[4], a2_small[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + g + 8 * (e & 1), j = k0 + 2 * t + (e >> 1);
        split_tf32(d2[cc_at(j, i)], a2_big[e], a2_small[e]);
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t b_big[2], b_small[2];
        const float* b = qs + (k0 + 2 * t) * kp + c0 + 8 * n + g;
        split_tf32(b[0], b_big[0], b_small[0]);
        split_tf32(b[kp], b_big[1], b_small[1]);
        mma_3xtf32(kacc[n], a2_big, a2_small, b_big, b_small);
      }
    }
    if (pass > 0) __syncthreads();  // every warp done with d1, d2, which stage1 overlays
    float* stage = pass == 0 ? stage0 : stage1;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + g + 8 * (e / 2), c = 16 * cg + 8 * n + 2 * t + e % 2;
        stage[stage_at(i, c)] = total(kacc[n], e);
        stage[kC * kStageCols + stage_at(i, c)] = total(qacc[n], e);
      }
    }
  }
  __syncthreads();
}

// Note [Register-resident substitution]
// The triangular solves run one thread per column of the right-hand side, with the column
// in registers (x[C], every index a compile-time constant once the loops are unrolled),
// and the row of M a step needs comes in 16-byte broadcast loads of a pitch-C copy. A step is
// then one FMA and a quarter of a load instead of two or three loads, and the sums of a row
// are still one thread's fixed-order FP32 chain.
// Forward: row i of X is x_i - sum_{j<i} M_ij X_j, j ascending (the order of the
// original loop, so the same bits); m[i * C + j] = M_ij.
__device__ __forceinline__ void forward_substitute(const float* m, float (&x)[kC]) {
#pragma unroll
  for (int i = 1; i < kC; ++i) {
    float y = x[i];
#pragma unroll
    for (int j4 = 0; j4 < kC; j4 += 4) {
      if (j4 < i) {
        const Vec4 mv = load_vec4(m + i * kC + j4);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if (j4 + jj < i) y = fmaf(-mv.v[jj], x[j4 + jj], y);
        }
      }
    }
    x[i] = y;
  }
}

// Backward: (I + M)^T is unit upper triangular; row i of the solution is
// x_i - sum_{j>i} M_ji Y_j with j DESCENDING from C-1: the oldest results come first, so
// the chains of successive rows overlap instead of each waiting for the row before it to
// finish (ascending j made the whole solve one dependent chain of C(C-1)/2 FMAs).
// mt[i * C + j] = M_ji (M transposed).
__device__ __forceinline__ void back_substitute(const float* mt, float (&x)[kC]) {
#pragma unroll
  for (int i = kC - 2; i >= 0; --i) {
    float y = x[i];
#pragma unroll
    for (int j4 = kC - 4; j4 >= 0; j4 -= 4) {
      if (j4 + 3 > i) {
        const Vec4 mv = load_vec4(mt + i * kC + j4);
#pragma unroll
        for (int jj = 3; jj >= 0; --jj) {
          if (j4 + jj > i) y = fmaf(-mv.v[jj], x[j4 + jj], y);
        }
      }
    }
    x[i] = y;
  }
}

// Note [Blocked back substitution]
// back_substitute unrolls into one straight run of ~5,600 instructions (90 KB of SASS: 2016
// FMAs and 504 loads of M, every x index a constant), which the backward's solve phase
// runs once per chunk with the rest of the kernel's code in between, so it streams
// through the instruction cache every time: ncu showed "no instruction" stalls, and code
// changes elsewhere in the kernel moved the phase's time a lot with its SASS unchanged
// (figures: docs/benchmarks.md).
// back_substitute_blocked runs the same FMAs in the same order per row on a column that
// stays in place (shared memory, `pitch` floats between rows): 16 rows at a time in
// registers, block by block from the bottom; a block first takes the terms of the later
// rows (final, stored) in a rolled loop over chunks of 4 later rows, j descending, all 16
// rows' chains interleaved, then its own triangle as back_substitute does, and stores.
// Row i still sums j = C-1, C-2, .., i+1, one fmaf each in that order, so the bits are
// back_substitute's; the code is ~450 instructions.
__device__ __forceinline__ void back_substitute_blocked(const float* mt, float* col, int pitch) {
  constexpr int kB = 16;
#pragma unroll 1
  for (int r0 = kC - kB; r0 >= 0; r0 -= kB) {
    float y[kB];
#pragma unroll
    for (int r = 0; r < kB; ++r) y[r] = col[(r0 + r) * pitch];
#pragma unroll 1
    for (int j4 = kC - 4; j4 >= r0 + kB; j4 -= 4) {
      float xj[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) xj[jj] = col[(j4 + jj) * pitch];
#pragma unroll
      for (int r = 0; r < kB; ++r) {
        const Vec4 mv = load_vec4(mt + (r0 + r) * kC + j4);
#pragma unroll
        for (int jj = 3; jj >= 0; --jj) y[r] = fmaf(-mv.v[jj], xj[jj], y[r]);
      }
    }
#pragma unroll
    for (int r = kB - 2; r >= 0; --r) {
#pragma unroll
      for (int j4 = kB - 4; j4 >= 0; j4 -= 4) {
        if (j4 + 3 > r) {
          const Vec4 mv = load_vec4(mt + (r0 + r) * kC + r0 + j4);
#pragma unroll
          for (int jj = 3; jj >= 0; --jj) {
            if (j4 + jj > r) y[r] = fmaf(-mv.v[jj], y[j4 + jj], y[r]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kB; ++r) col[(r0 + r) * pitch] = y[r];
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels (bodies; the __global__ wrappers are in kernels/gdr_core/chunk_prep.cu)

// Forward. Phases: 0 decays and Q, K (normalised in place with the fused L2 norm), a BF16 v
// staged -> (sync) 1 Gram tiles -> M, P; Qd, Kend, G_last -> (sync) 2 forward
// substitution, one thread per column of [U | W] held in registers (Note
// [Register-resident substitution]): the thread forms its column of the right-hand side
// [beta V | beta K exp(G)], then row i is rhs_i - sum_{j<i} M_ij X_j, j in order. Columns
// are independent, so the substitution needs no barrier at all.
//
// The forward's shared memory (floats; the size is chunk_prep_forward_smem_floats in
// kernels/gdr_core/chunk_prep.h): ks, qs [C][dk+4] K and scale*Q (Note [Chunk prep shared
// pitches]); ms [C][C] M (pitch C: 16-byte aligned rows for the substitution's loads); gs,
// bs, es [C] G, beta, exp(G); rq, rk [C] the fused L2 norm's reciprocal row norms; vstage
// C x dv BF16, a BF16 v chunk (Note [Chunk prep BF16 value staging]). 2 C (dk + 4) + C^2 +
// 5 C floats besides vstage, 83 KiB at dk = 128 whatever dv: two blocks fit an H100 / H200
// SM (the right-hand side does not sit in shared memory). forward_smem derives it from the
// shape; every phase reads its regions from it.
struct ForwardSmem {
  int dk, dv, cols, kp;  // the pitch of ks, qs: dk + 4
  float *ks, *qs, *ms;
  float *gs, *bs, *es, *rq, *rk;
  float* vstage;
};

__device__ __forceinline__ ForwardSmem forward_smem(const ChunkPrepShape& s, float* smem) {
  ForwardSmem m;
  m.dk = s.dk;
  m.dv = s.dv;
  m.cols = m.dv + m.dk;
  m.kp = m.dk + 4;
  m.ks = smem;
  m.qs = m.ks + kC * m.kp;
  m.ms = m.qs + kC * m.kp;
  m.gs = m.ms + kC * kC;
  m.bs = m.gs + kC;
  m.es = m.bs + kC;
  m.rq = m.es + kC;
  m.rk = m.rq + kC;
  m.vstage = m.rk + kC;
  return m;
}

// Note [Chunk prep BF16 value staging]
// The forward's value columns are read one thread per column, 64 rows each, as the
// triangular solve's right-hand side. For a BF16 v those 2-byte loads (64 bytes per warp
// and row, strided by the token pitch) stalled the block on L1TEX scoreboards, far longer
// than the same kernel reading an FP32 copy of v (ncu figures: docs/benchmarks.md). So a
// BF16 v chunk is first copied into shared memory with cp.async (16-byte copies of eight
// values where the rows are 16-byte aligned, else 4-byte copies of two; all in flight at
// once and overlapping the Q / K loads), and the columns are read from there: the same
// values, so the same bits. v rows that are not 4-byte aligned are staged one value at a
// time (one code path for the solve either way: a second one made ptxas spill more).
//
// Phase 0, BF16 v: the chunk's v into vstage (zeros past the end), waited for at the end
// of phase 1.
template <int Threads>
__device__ __forceinline__ void stage_bf16_values(const ChunkPrepForwardArgs& args,
                                                  const ForwardSmem& sm, const ChunkPlace& place) {
  constexpr int kThreads = Threads;
  const int tid = threadIdx.x;
  const Bf16* v = static_cast<const Bf16*>(args.v);
  float* vstage = sm.vstage;
  const int pairs = sm.dv / 2;  // dv is a multiple of 16
  const bool aligned = rows_aligned<2>(static_cast<const Bf16*>(args.v), args.v_strides);
  // Rows in whole 16-byte pieces: eight values per copy (a quarter of the copies).
  const TokenStrides& st = args.v_strides;
  const bool aligned16 = rows_aligned<8>(static_cast<const Bf16*>(args.v), st);
  for (int e = 4 * tid; aligned16 && e < kC * pairs; e += 4 * kThreads) {
    const int i = e / pairs, w = e % pairs;
    if (i >= place.rows) {
      for (int u = 0; u < 4; ++u) vstage[e + u] = 0.0f;
    } else {
      cp_async_16(vstage + e, reinterpret_cast<const float*>(v + input_row(st, place, i) + 2 * w));
    }
  }
  for (int e = tid; !aligned16 && e < kC * pairs; e += kThreads) {
    const int i = e / pairs, w = e % pairs;
    const Bf16* src = v + input_row(args.v_strides, place, i) + 2 * w;
    if (i >= place.rows) {
      vstage[e] = 0.0f;  // two BF16 zeros
    } else if (aligned) {
      cp_async_4(vstage + e, reinterpret_cast<const float*>(src));
    } else {  // odd strides or base: the two values one at a time
      Bf16* dst = reinterpret_cast<Bf16*>(vstage + e);
      dst[0] = src[0];
      dst[1] = src[1];
    }
  }
}

// Phase 1: the Gram tiles of the chunk, decayed: M = beta_i (K K^T) * L strictly below the
// diagonal into ms, P = (Q K^T) * L into the output p.
template <int Threads>
__device__ __forceinline__ void forward_decayed_gram(const ChunkPrepForwardArgs& args,
                                                     const ForwardSmem& sm,
                                                     const ChunkPlace& place) {
  constexpr int kThreads = Threads;
  const int tid = threadIdx.x;
  const float* gs = sm.gs;
  float* p = args.p + place.block * kC * kC;
  // exp only where i >= j: above the diagonal G_i - G_j > 0 could overflow.
  auto decay = [&](int i, int j) { return i >= j ? expf(gs[i] - gs[j]) : 0.0f; };
  auto m_out = [&](int i, int j, float kk) {
    sm.ms[i * kC + j] = i > j ? sm.bs[i] * (kk * decay(i, j)) : 0.0f;
  };
  auto p_out = [&](int i, int j, float qk) { p[i * kC + j] = qk * decay(i, j); };
  using Map = TileMap<kThreads>;
  float kk[Map::kRows][Map::kCols], qk[Map::kRows][Map::kCols];
  gram_tiles<kThreads>(sm.qs, sm.kp, sm.ks, sm.kp, sm.dk, kk, qk);
  const int ti = tid / Map::kColThreads, tj = tid % Map::kColThreads;
  for (int a = 0; a < Map::kRows; ++a) {
    for (int b = 0; b < Map::kCols; ++b) {
      const int i = ti + Map::kRowThreads * a, j = tj + Map::kColThreads * b;
      m_out(i, j, kk[a][b]);
      p_out(i, j, qk[a][b]);
    }
  }
}

// Phase 1: the rows the state scan reads, Qd = Q exp(G_i) and Kend = K exp(G_last - G_i),
// and G_last.
template <int Threads>
__device__ __forceinline__ void store_decayed_rows(const ChunkPrepForwardArgs& args,
                                                   const ForwardSmem& sm, const ChunkPlace& place) {
  const int tid = threadIdx.x, dk = sm.dk, kp = sm.kp;
  const float* gs = sm.gs;
  const float g_last = gs[kC - 1];
  float* qd = args.qd + place.block * kC * dk;
  float* kend = args.kend + place.block * kC * dk;
  for (int e = tid; e < kC * dk; e += Threads) {
    const int i = e / dk, c = e % dk;
    qd[e] = sm.qs[i * kp + c] * sm.es[i];
    kend[e] = sm.ks[i * kp + c] * expf(g_last - gs[i]);
  }
  if (tid == 0) args.g_last[place.block] = g_last;
}

// Phase 2: [U | W] = (I + M)^-1 [beta V | beta K exp(G)], one thread per column, the column
// in registers (forward_substitute), stored to u and w.
// With a staged (BF16) v, one call site of the unrolled solve (~2,500 instructions) serves
// the value and the key columns: with one copy per branch both copies are live at once
// (warps of both kinds run side by side), twice the instruction-cache footprint, and the
// solve took over twice as long (clock64 marks: docs/benchmarks.md; Note [Blocked back
// substitution] has the backward's case). With an FP32 v (read from global memory inside
// the branch, coalesced across the warp) one call site made ptxas spill more, so that path
// keeps a copy per branch. Same FMAs in the same order either way: the same bits.
template <typename TV, int Threads>
__device__ __forceinline__ void solve_forward_columns(const ChunkPrepForwardArgs& args,
                                                      const ForwardSmem& sm,
                                                      const ChunkPlace& place) {
  constexpr int kThreads = Threads;
  constexpr bool kStaged = std::is_same<TV, Bf16>::value;
  const int tid = threadIdx.x, dk = sm.dk, dv = sm.dv, kp = sm.kp;
  const float* ks = sm.ks;
  const float* bs = sm.bs;
  const float* es = sm.es;
  const TV* v = static_cast<const TV*>(args.v);
  float* u = args.u + place.block * kC * dv;
  float* w = args.w + place.block * kC * dk;
  auto store_column = [&](int c, const float(&x)[kC]) {
    if (c < dv) {
#pragma unroll
      for (int i = 0; i < kC; ++i) u[i * dv + c] = x[i];
    } else {
#pragma unroll
      for (int i = 0; i < kC; ++i) w[i * dk + c - dv] = x[i];
    }
  };
  auto key_rhs = [&](int c, float(&x)[kC]) {
#pragma unroll
    for (int i = 0; i < kC; ++i) x[i] = (ks[i * kp + c - dv] * bs[i]) * es[i];
  };
  for (int c = tid; c < sm.cols; c += kThreads) {
    float x[kC];
    if constexpr (kStaged) {
      if (c < dv) {
        const Bf16* vs = reinterpret_cast<const Bf16*>(sm.vstage) + c;
#pragma unroll
        for (int i = 0; i < kC; ++i) x[i] = load_float(vs + i * dv) * bs[i];
      } else {
        key_rhs(c, x);
      }
      forward_substitute(sm.ms, x);
      store_column(c, x);
    } else {
      if (c < dv) {
        const TV* vc = v + input_row(args.v_strides, place, 0) + c;
        const long long token = args.v_strides.token;
#pragma unroll
        for (int i = 0; i < kC; ++i) {
          const float vv = i < place.rows ? load_float(vc + i * token) : 0.0f;
          x[i] = vv * bs[i];
        }
        forward_substitute(sm.ms, x);
      } else {
        key_rhs(c, x);
        forward_substitute(sm.ms, x);
      }
      store_column(c, x);
    }
  }
}

// The forward of one chunk (the phases and the layout: above ForwardSmem). Each phase takes
// the layout afresh from the shape (kernel parameters and integer arithmetic) instead of
// keeping one copy live across the barriers: with one copy ptxas, at its 128 registers,
// spills inside the solve.
template <typename TQK, typename TV, int Threads = kForwardThreads>
__device__ void chunk_prep_forward_block(const ChunkPrepForwardArgs& args, float* smem) {
  constexpr bool kStaged = std::is_same<TV, Bf16>::value;
  const ChunkPrepShape& s = args.shape;
  const ChunkPlace place = chunk_place(s);

  // Phase 0: a BF16 v issued into vstage, Q, K, the decays, the fused L2 norm.
  {
    const ForwardSmem sm = forward_smem(s, smem);
    if constexpr (kStaged) stage_bf16_values<Threads>(args, sm, place);
    load_qk<TQK, Threads>(args, place, sm.qs, sm.kp, sm.ks, sm.kp);
    load_decays(args, place, sm.gs, sm.bs, sm.es);  // a barrier, then the cumsum
    if (s.l2_normalize_qk) normalize_qk<Threads>(s, sm.qs, sm.kp, sm.ks, sm.kp, sm.rq, sm.rk);
  }
  __syncthreads();

  // Phase 1: M, P; Qd, Kend, G_last.
  {
    const ForwardSmem sm = forward_smem(s, smem);
    forward_decayed_gram<Threads>(args, sm, place);
    store_decayed_rows<Threads>(args, sm, place);
    if constexpr (kStaged) cp_async_wait_all();
  }
  __syncthreads();  // M complete (and the staged v)

  // Phase 2: U and W.
  solve_forward_columns<TV, Threads>(args, forward_smem(s, smem), place);
}

// Backward (the formulas: Note [Chunk prep backward] in ops/gdr_core/chunk_prep_op.h), 512
// threads (16 warps, one block per SM, at most 128 registers: kernels/gdr_core/chunk_prep.cu).
// Phases, each ended by a barrier: 0 decays, Q, K (with the fused L2 norm, normalised
// exactly as in the forward), then [dU | dW] issued into rs by cp.async (dk <= 128); 1
// Gram tiles (32 x 16 threads, 2 x 4 elements each: Note [Chunk prep tile maps]) -> kl,
// M^T, pm, and the wait for rs; 2 back substitution, one thread per column (dv + dk <= 464
// columns, the other threads idle; row i of dR is dX_i - sum_{j>i} M_ji dR_j, j
// descending: in place, 16 rows at a time in registers, Note [Blocked back substitution];
// dk = 256: the whole column in registers, Note [Register-resident substitution]); 3 dM =
// -dR X^T below the diagonal (the tile map of phase 1; tensor cores: 20 tiles over 16
// warps), X streamed through xs 4 floats per thread; 4 elementwise C x C (8 elements per
// thread): E, dM .* kl, dKK, dQK; 5 eight threads per row, each an eighth of every row
// sum, then (a barrier, as the partials overwrite kl and pm) one thread per row adds the
// eight parts in order: dbeta and the row part of dG (thread 0 then adds the G_last terms
// and runs the reverse cumsum into dg); 6 dk, dq as register tiles (32 x 16 threads, 2
// rows x DK/16 columns each; with the fused L2 norm, mapped back through it with one more
// barrier for the row dots), and dv. With TC, d1 and d2 are swizzled at pitch C from phase
// 3 on (cc_at), phase 5 also symmetrises d1, and phase 6's products run on tensor cores
// (dkdq_tc), staged through kl / pm and d1 / d2 into the same register tiles (Note [Chunk
// prep on tensor cores]).
//
// The backward's shared memory (floats, in this order; pitches: Note [Chunk prep shared
// pitches]; the size is chunk_prep_backward_smem_floats in kernels/gdr_core/chunk_prep.h):
// kl [C][C+1] (K K^T) * L strictly below the diagonal (M = beta_i kl), later dM .* kl;
// pm [C][C+1] P, later E (kl and pm then take phase 5's partial sums); d1 [C][C+1] first
// M^T at pitch C (phases 1-2), then dM, later dKK; d2 [C][C+1] dQK; xs [C][36] a
// 32-column slab of X = [U | W], later the phase 6 row dots; gs, bs, es, dgs, fs, rq, rk
// [C] (fs[0] also parks the block index through phase 2); ks, qs [C][dk+4] K and scale*Q;
// rs [C][dv+dk+4] [dU | dW] solved in place into dR = (I + M)^-T [dU | dW]. dk = 256 (Note
// [Chunk prep wide-head backward]): rs is the block's global scratch slot (`scratch`),
// qstash after it, and the shared region past qs holds phase 3's dR slab (rslab). rs, the
// one region whose size depends on dv, comes last: every other region then starts at a
// compile-time offset (no base registers to keep live under the 128-register budget).
// Built once per block; every phase reads its regions from here.
template <int DK>
struct BackwardSmem {
  static constexpr bool kPanelInScratch = chunk_prep_backward_uses_scratch(DK);
  static constexpr int kp = DK + 4;     // ks, qs
  static constexpr int mp = kC + 1;     // kl, pm; d1, d2 in the SIMT variant
  static constexpr int xp = kSlab + 4;  // xs, rslab
  int dv, cols, rp;                     // dv; the panel's dv + dk columns and its pitch
  float *kl, *pm, *d1, *d2, *xs;
  float *gs, *bs, *es, *dgs, *fs, *rq, *rk;
  float *ks, *qs;
  float* rs;
  // The wide-head backward's phase 3 stages the dR slab it multiplies here, as X in xs,
  // so its inner loop reads shared memory only (Note [Chunk prep wide-head backward]).
  float* rslab;

  // Row loads of rs, from shared memory or from the scratch slot.
  static __device__ __forceinline__ Vec4 load_rs4(const float* p) {
    if constexpr (kPanelInScratch) {
      return load_vec4_global(p);
    } else {
      return load_vec4(p);
    }
  }
};

template <int DK>
__device__ __forceinline__ BackwardSmem<DK> backward_smem(const ChunkPrepShape& s, float* smem,
                                                          float* scratch) {
  using Smem = BackwardSmem<DK>;
  Smem m;
  m.dv = s.dv;
  m.cols = m.dv + DK;
  m.rp = m.cols + 4;
  m.kl = smem;
  m.pm = m.kl + kC * Smem::mp;  // right after kl: phase 5's partials span both
  m.d1 = m.pm + kC * Smem::mp;
  m.d2 = m.d1 + kC * Smem::mp;
  m.xs = m.d2 + kC * Smem::mp;
  m.gs = m.xs + kC * Smem::xp;
  m.bs = m.gs + kC;
  m.es = m.bs + kC;
  m.dgs = m.es + kC;
  m.fs = m.dgs + kC;
  m.rq = m.fs + kC;
  m.rk = m.rq + kC;
  m.ks = m.rk + kC;
  m.qs = m.ks + kC * Smem::kp;
  m.rs = Smem::kPanelInScratch ? scratch : m.qs + kC * Smem::kp;
  m.rslab = m.qs + kC * Smem::kp;
  return m;
}

// Phase 0, dk <= 128: [dU | dW] straight into rs with cp.async, waited for at the end of
// phase 1 (finish_grad_panel): its latency passes under the decays, the L2 norm and the
// Gram tiles instead of being paid after them. 16-byte copies where both bases are 16-byte
// aligned (rows are: dv and dk are multiples of 16), else 4-byte ones; zeros for a missing
// gradient.
template <int DK>
__device__ __forceinline__ void issue_grad_panel(const ChunkPrepBackwardArgs& args,
                                                 const BackwardSmem<DK>& sm, long long chunk_dv,
                                                 long long chunk_dk) {
  constexpr int kThreads = kBackwardThreads;
  const int tid = threadIdx.x, dv = sm.dv;
  const bool aligned16 = both_16_byte_aligned(args.grad_u, args.grad_w);
  const int row_pieces = sm.cols / 4;
  for (int e = tid; e < kC * row_pieces; e += kThreads) {
    const int i = e / row_pieces, c = 4 * (e % row_pieces);
    const float* src = c < dv ? (args.grad_u ? args.grad_u + chunk_dv + i * dv + c : nullptr)
                              : (args.grad_w ? args.grad_w + chunk_dk + i * DK + c - dv : nullptr);
    float* dst = sm.rs + i * sm.rp + c;
    if (src == nullptr) {
      for (int u = 0; u < 4; ++u) dst[u] = 0.0f;
    } else if (aligned16) {
      cp_async_16(dst, src);
    } else {
      for (int u = 0; u < 4; ++u) cp_async_4(dst + u, src + u);
    }
  }
}

// Phase 1: the Gram tiles of the chunk, decayed: kl = (K K^T) * L strictly below the
// diagonal, M^T into d1 at pitch C (M_ij = beta_i kl_ij, phase 2's matrix), P = (Q K^T) * L
// into pm.
template <int DK>
__device__ __forceinline__ void backward_decayed_gram(const BackwardSmem<DK>& sm) {
  constexpr int kThreads = kBackwardThreads;
  using Map = TileMap<kThreads>;
  constexpr int mp = BackwardSmem<DK>::mp, kp = BackwardSmem<DK>::kp;
  const int tid = threadIdx.x;
  const float* gs = sm.gs;
  auto decay = [&](int i, int j) { return i >= j ? expf(gs[i] - gs[j]) : 0.0f; };
  auto kl_out = [&](int i, int j, float kk) {
    const float klv = i > j ? kk * decay(i, j) : 0.0f;
    sm.kl[i * mp + j] = klv;
    sm.d1[j * kC + i] = sm.bs[i] * klv;  // M^T: M_ij = beta_i kl_ij
  };
  auto p_out = [&](int i, int j, float qk) { sm.pm[i * mp + j] = qk * decay(i, j); };
  float kk[Map::kRows][Map::kCols], qk[Map::kRows][Map::kCols];
  gram_tiles<kThreads>(sm.qs, kp, sm.ks, kp, DK, kk, qk);
  const int ti = tid / Map::kColThreads, tj = tid % Map::kColThreads;
  for (int a = 0; a < Map::kRows; ++a) {
    for (int b = 0; b < Map::kCols; ++b) {
      const int i = ti + Map::kRowThreads * a, j = tj + Map::kColThreads * b;
      kl_out(i, j, kk[a][b]);
      p_out(i, j, qk[a][b]);
    }
  }
}

// End of phase 1: the panel [dU | dW] complete in rs (the wait for phase 0's copies, or at
// dk = 256 the copy into the scratch slot).
template <int DK>
__device__ __forceinline__ void finish_grad_panel(const ChunkPrepBackwardArgs& args,
                                                  const BackwardSmem<DK>& sm, long long chunk_dv,
                                                  long long chunk_dk) {
  constexpr int kThreads = kBackwardThreads;
  if constexpr (BackwardSmem<DK>::kPanelInScratch) {
    copy_rows<kThreads>(args.grad_u ? args.grad_u + chunk_dv : nullptr, sm.dv, sm.rs, sm.rp);
    copy_rows<kThreads>(args.grad_w ? args.grad_w + chunk_dk : nullptr, DK, sm.rs + sm.dv, sm.rp);
  } else {
    cp_async_wait_all();  // the panel issued in phase 0
  }
}

// Phase 2: dR = (I + M)^-T [dU | dW] in place in rs. (I + M)^T is unit upper triangular;
// M_ji = beta_j kl_ji, the forward's value (d1 holds M^T). One thread per column: cols =
// dv + dk <= 464 < 512 for every supported shape with dk <= 128 (chunk_prep_supports: dv <=
// 400 at dk = 64, dv <= 208 at dk = 128), so the threads past cols idle here; at dk = 256,
// cols = dv + 256 <= 880 and the threads take a second column past 512. A column's rows
// form one sequential chain.
template <int DK>
__device__ __forceinline__ void solve_grad_panel(const BackwardSmem<DK>& sm) {
  constexpr int kThreads = kBackwardThreads;
  const int rp = sm.rp;
  float* rs = sm.rs;
  for (int c = threadIdx.x; c < sm.cols; c += kThreads) {
    if constexpr (BackwardSmem<DK>::kPanelInScratch) {
      float x[kC];
#pragma unroll
      for (int i = 0; i < kC; ++i) x[i] = rs[i * rp + c];
      back_substitute(sm.d1, x);
      const int pitch = opaque(rp);  // the store addresses anew (see opaque)
#pragma unroll
      for (int i = 0; i < kC; ++i) rs[i * pitch + c] = x[i];
    } else {
      back_substitute_blocked(sm.d1, rs + c, rp);  // Note [Blocked back substitution]
    }
  }
}

// Phase 3: dM_ij = -sum_c dR_ic X_jc for i > j, c in order over X = [U | W], streamed slab
// by slab (kSlab columns) through xs. The next slab of X is fetched into registers before
// the current one is multiplied, so its global latency hides behind the FMAs. SIMT: tiles
// above the diagonal (a < b) are skipped, as in gram_tiles, and as there the rows come in
// 16-byte loads of 4 consecutive c (slab widths are multiples of 16 as dv is): the tile map
// of gram_tiles (Note [Chunk prep tile maps]), per 4 c 6 loads for 24 fmaf. The slab is 4
// floats per thread. Tensor-core variant (Note [Chunk prep on tensor cores]): warp w owns
// the lower tiles w, w + 16 (< 20) of dM and keeps their 3xTF32 accumulators across the
// slabs, each walking c in increasing order. A[r][k] = dR[16 rb + r][c0 + k] (rs, pitch dv
// + dk + 4 = 4 or 20 mod 32: banks 4 g + t or 20 g + t, distinct over the warp), B[k][n] =
// X[8 cb + n][k] (xs, pitch 36: bank 4 g + t). Conflict-free loads.
struct DmProduct {
  using Map = TileMap<kBackwardThreads>;
  static constexpr int kWarps = kBackwardThreads / 32;
  static constexpr int kTcTiles = (kLowerTiles + kWarps - 1) / kWarps;
  static constexpr int kSlabLoads = kC * kSlab / kBackwardThreads;
  static_assert(kC * kSlab % kBackwardThreads == 0, "slabs split evenly over the threads");
};

// One thread's accumulators of dM: the SIMT tiles, or the tensor-core variant's 3xTF32 ones.
struct DmAccumulators {
  float acc[DmProduct::Map::kRows][DmProduct::Map::kCols];
  mma_tf32::Acc3 tc_acc[DmProduct::kTcTiles];
};

// The thread's values of one X slab (and, at dk = 256, of the dR slab) in flight.
template <int DK>
struct DmSlab {
  float next[DmProduct::kSlabLoads];
  float next_r[BackwardSmem<DK>::kPanelInScratch ? DmProduct::kSlabLoads : 1];
};

__device__ __forceinline__ void zero_dm(DmAccumulators& acc) {
  using Map = DmProduct::Map;
  for (int a = 0; a < Map::kRows; ++a) {
    for (int b = 0; b < Map::kCols; ++b) acc.acc[a][b] = 0.0f;
  }
#pragma unroll
  for (int u = 0; u < DmProduct::kTcTiles; ++u) mma_tf32::zero(acc.tc_acc[u]);
}

// The thread's values of the slab at columns c0 .. c0 + kSlab - 1 (zeros past cols) into
// registers.
template <int DK>
__device__ __forceinline__ void fetch_x_slab(const ChunkPrepBackwardArgs& args,
                                             const BackwardSmem<DK>& sm, long long chunk_dv,
                                             long long chunk_dk, int c0, DmSlab<DK>& slab) {
  const int tid = threadIdx.x, dv = sm.dv, cols = sm.cols;
#pragma unroll
  for (int m = 0; m < DmProduct::kSlabLoads; ++m) {
    const int e = tid + kBackwardThreads * m;
    const int j = e / kSlab, c = c0 + e % kSlab;
    slab.next[m] = c >= cols ? 0.0f
                   : c < dv  ? args.u[chunk_dv + j * dv + c]
                             : args.w[chunk_dk + j * DK + c - dv];
    if constexpr (BackwardSmem<DK>::kPanelInScratch) {
      slab.next_r[m] = c >= cols ? 0.0f : sm.rs[j * sm.rp + c];
    }
  }
}

// The fetched slab into xs (and rslab); the caller's barrier publishes it.
template <int DK>
__device__ __forceinline__ void store_x_slab(const BackwardSmem<DK>& sm, const DmSlab<DK>& slab) {
  constexpr int xp = BackwardSmem<DK>::xp;
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 0; m < DmProduct::kSlabLoads; ++m) {
    const int e = tid + kBackwardThreads * m;
    sm.xs[(e / kSlab) * xp + e % kSlab] = slab.next[m];
    if constexpr (BackwardSmem<DK>::kPanelInScratch) {
      sm.rslab[(e / kSlab) * xp + e % kSlab] = slab.next_r[m];
    }
  }
}

// The slab at c0's terms of dM, added to the thread's accumulators.
template <int DK, bool TC>
__device__ __forceinline__ void accumulate_dm_slab(const BackwardSmem<DK>& sm, int c0,
                                                   DmAccumulators& acc) {
  using Map = DmProduct::Map;
  constexpr bool kPanelInScratch = BackwardSmem<DK>::kPanelInScratch;
  constexpr int xp = BackwardSmem<DK>::xp;
  const int tid = threadIdx.x, cols = sm.cols, rp = sm.rp;
  const float* rs = sm.rs;
  const float* xs = sm.xs;
  const int width = cols - c0 < kSlab ? cols - c0 : kSlab;
  if constexpr (TC) {
    using namespace mma_tf32;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int u = 0; u < DmProduct::kTcTiles; ++u) {
      const int x = warp + DmProduct::kWarps * u;
      if (x >= kLowerTiles) continue;
      int rb, cb;
      lower_tile(x, rb, cb);
      const float* a_rows = rs + (16 * rb + g) * rp + c0 + t;
      const float* b_rows = xs + (8 * cb + g) * xp + t;
      for (int k0 = 0; k0 < width; k0 += 8) {
        mma_tf32::mma_3xtf32_rows(acc.tc_acc[u], a_rows, rp, b_rows, k0);
      }
    }
  } else {
    const int ti = tid / Map::kColThreads, tj = tid % Map::kColThreads;
    // Unrolled by 2 only: unrolled further, ptxas hoists so many loads of the next
    // steps that the 128-register budget spills.
#pragma unroll 2
    for (int cc = 0; cc < width; cc += 4) {
      Vec4 dr[Map::kRows], x[Map::kCols];
#pragma unroll
      for (int a = 0; a < Map::kRows; ++a) {
        const int i = ti + Map::kRowThreads * a;
        dr[a] =
            kPanelInScratch ? load_vec4(sm.rslab + i * xp + cc) : load_vec4(rs + i * rp + c0 + cc);
      }
#pragma unroll
      for (int b = 0; b < Map::kCols; ++b) {
        x[b] = load_vec4(xs + (tj + Map::kColThreads * b) * xp + cc);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int a = 0; a < Map::kRows; ++a) {
#pragma unroll
          for (int b = 0; b < Map::kCols; ++b) {
            if (!Map::above(a, b)) acc.acc[a][b] = fmaf(dr[a].v[u], x[b].v[u], acc.acc[a][b]);
          }
        }
      }
    }
  }
}

// dM into d1 (zeros on and above the diagonal): swizzled at pitch C (cc_at) with TC, else
// at pitch C + 1.
template <int DK, bool TC>
__device__ __forceinline__ void store_dm(const BackwardSmem<DK>& sm, const DmAccumulators& acc) {
  using Map = DmProduct::Map;
  const int tid = threadIdx.x;
  float* d1 = sm.d1;
  if constexpr (TC) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int u = 0; u < DmProduct::kTcTiles; ++u) {
      const int x = warp + DmProduct::kWarps * u;
      if (x >= kLowerTiles) continue;
      int rb, cb;
      lower_tile(x, rb, cb);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * rb + g + 8 * (e / 2), j = 8 * cb + 2 * t + e % 2;
        d1[cc_at(i, j)] = i > j ? -mma_tf32::total(acc.tc_acc[u], e) : 0.0f;
      }
    }
    for (int e = tid; e < kC * kC; e += kBackwardThreads) {
      const int i = e / kC, j = e % kC;
      if (above_lower_tiles(i, j)) d1[cc_at(i, j)] = 0.0f;
    }
  } else {
    const int ti = tid / Map::kColThreads, tj = tid % Map::kColThreads;
    for (int a = 0; a < Map::kRows; ++a) {
      for (int b = 0; b < Map::kCols; ++b) {
        const int i = ti + Map::kRowThreads * a, j = tj + Map::kColThreads * b;
        d1[i * BackwardSmem<DK>::mp + j] = i > j ? -acc.acc[a][b] : 0.0f;
      }
    }
  }
}

// Phase 4: E_ij = dL_ij L_ij for i > j (the diagonal's G_i - G_i cancels), with
// dL = dM beta_i (K K^T) + dP (Q K^T); dKK = dM beta_i L; dQK = dP L (diagonal kept).
// E into pm, dM .* kl into kl, dKK into d1, dQK into d2. dP is read into registers first
// (Note [Batched global loads]).
template <int DK, bool TC>
__device__ __forceinline__ void backward_decay_grads(const ChunkPrepBackwardArgs& args,
                                                     const BackwardSmem<DK>& sm,
                                                     const ChunkPlace& place) {
  constexpr int kThreads = kBackwardThreads, mp = BackwardSmem<DK>::mp;
  const int tid = threadIdx.x;
  const float* gs = sm.gs;
  const float* bs = sm.bs;
  float* kl = sm.kl;
  float* pm = sm.pm;
  float* d1 = sm.d1;
  float* d2 = sm.d2;
  const float* grad_p = args.grad_p ? args.grad_p + place.block * kC * kC : nullptr;
  constexpr int kPerThread = kC * kC / kThreads;
  static_assert(kC * kC % kThreads == 0, "C x C splits evenly over the threads");
  float dps[kPerThread];
#pragma unroll
  for (int m = 0; m < kPerThread; ++m) dps[m] = grad_p ? grad_p[tid + kThreads * m] : 0.0f;
#pragma unroll
  for (int m = 0; m < kPerThread; ++m) {
    const int e = tid + kThreads * m;
    const int i = e / kC, j = e % kC;
    const float l = i >= j ? expf(gs[i] - gs[j]) : 0.0f;
    const int at = TC ? cc_at(i, j) : i * mp + j;  // d1, d2 (cc_at: tensor cores only)
    const float dm = d1[at];
    const float dp = dps[m];
    const float klv = kl[i * mp + j];
    pm[i * mp + j] = i > j ? bs[i] * dm * klv + dp * pm[i * mp + j] : 0.0f;
    kl[i * mp + j] = dm * klv;
    d1[at] = dm * bs[i] * l;
    d2[at] = dp * l;
  }
}

// Phase 5: row sums in eight parts. Thread (i = tid % C, part = tid / C) sums its part
// of the c and j ranges in order; a warp is 32 consecutive rows of one part: row i of a
// pitch-odd matrix starts in bank i, so its one-float reads hit 32 banks, and rs, ks, qs
// come in 16-byte loads of 4 consecutive c (Note [Chunk prep shared pitches]). The c
// ranges split into whole groups of 4 columns, part p taking groups [p n / 8, (p + 1)
// n / 8) of n (dv / 4 is a multiple of 4 but not always of 8, so parts of v may differ
// by a group or be empty); a batch's loads past its range stay inside the row (the next
// columns or the row's padding) and go unused. The partials go to kl and pm once every
// thread has read them (one more barrier: xs is too small for 8 x 7 x C partials), then
// one thread per row adds the eight parts in part order (a fixed order, so the same bits
// every run).
struct RowParts {
  static constexpr int kParts = kBackwardThreads / kC;
  static constexpr int kSums = 7;
  // su = <v, dRu>, sk = <K, dRw>, sq = <dQd, Q>, sf = <dKend, K>, sb = sum_j (dM .* kl)_ij,
  // row_e = sum_j E_ij, col_e = sum_j E_ji: the thread's part of each.
  float su, sk, sq, sf, sb, row_e, col_e;
};

// The thread's part of row tid % C's sums (Note above), in registers.
template <typename TV, int DK>
__device__ __forceinline__ RowParts row_part_sums(const ChunkPrepBackwardArgs& args,
                                                  const BackwardSmem<DK>& sm,
                                                  const ChunkPlace& place, const float* grad_qd,
                                                  const float* grad_kend) {
  using Smem = BackwardSmem<DK>;
  constexpr int kParts = RowParts::kParts;
  constexpr int kp = Smem::kp, mp = Smem::mp;
  static_assert(kParts == 8 && kC % kParts == 0 && DK % (4 * kParts) == 0,
                "eight threads per row, whole parts of j and of dk");
  const int tid = threadIdx.x, dv = sm.dv, rp = sm.rp;
  const float* rs = sm.rs;
  const TV* v = static_cast<const TV*>(args.v);
  const int i = tid % kC, p = tid / kC;
  const bool real = i < place.rows;
  const long long v_row = input_row(args.v_strides, place, i);
  float su = 0.0f, sk = 0.0f, sq = 0.0f, sf = 0.0f, sb = 0.0f, row_e = 0.0f, col_e = 0.0f;
  const int v_groups = dv / 4, k_width = DK / kParts, j_width = kC / kParts;
  // Global operands come kLoadBatch at a time (Note [Batched global loads]), four values
  // per load where the rows allow (load4_input: a warp's threads read 32 different rows,
  // so one-value loads cost a wavefront per thread and value); the ranges are whole
  // groups of four (dk's part is a multiple of 8), so a group is wholly inside or wholly
  // past its range. Every sum still runs over c in order.
  auto fetch4 = [](auto* src, bool vec, float* dst) {
    if (src == nullptr) {
      for (int u = 0; u < 4; ++u) dst[u] = 0.0f;
    } else if (vec) {
      const Vec4 x = load4_input(src);
      for (int u = 0; u < 4; ++u) dst[u] = x.v[u];
    } else {
      for (int u = 0; u < 4; ++u) dst[u] = load_float(src + u);
    }
  };
  const bool v_vec = rows_aligned<4>(v, args.v_strides);
  const bool grad_vec = both_16_byte_aligned(args.grad_qd, args.grad_kend);
  const int v_begin = 4 * (p * v_groups / kParts), v_end = 4 * ((p + 1) * v_groups / kParts);
  const int k_end = (p + 1) * k_width;
  for (int c0 = v_begin; c0 < v_end; c0 += kLoadBatch) {
    float vv[kLoadBatch];
#pragma unroll
    for (int h = 0; h < kLoadBatch; h += 4) {
      const int c = c0 + h;
      fetch4(real && c < v_end ? v + v_row + c : nullptr, v_vec, vv + h);
    }
    static_assert(kLoadBatch == 8, "two 16-byte loads per batch");
    const Vec4 r_lo = Smem::load_rs4(rs + i * rp + c0);
    const Vec4 r_hi = Smem::load_rs4(rs + i * rp + c0 + 4);
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const float r = m < 4 ? r_lo.v[m] : r_hi.v[m - 4];
      if (real && c0 + m < v_end) su = fmaf(vv[m], r, su);
    }
  }
  for (int c0 = p * k_width; c0 < k_end; c0 += kLoadBatch) {
    float gq[kLoadBatch], gk[kLoadBatch];
#pragma unroll
    for (int h = 0; h < kLoadBatch; h += 4) {
      fetch4(grad_qd ? grad_qd + i * DK + c0 + h : nullptr, grad_vec, gq + h);
      fetch4(grad_kend ? grad_kend + i * DK + c0 + h : nullptr, grad_vec, gk + h);
    }
    const Vec4 k_lo = load_vec4(sm.ks + i * kp + c0), k_hi = load_vec4(sm.ks + i * kp + c0 + 4);
    const Vec4 r_lo = Smem::load_rs4(rs + i * rp + dv + c0);
    const Vec4 r_hi = Smem::load_rs4(rs + i * rp + dv + c0 + 4);
    const Vec4 q_lo = load_vec4(sm.qs + i * kp + c0), q_hi = load_vec4(sm.qs + i * kp + c0 + 4);
#pragma unroll
    for (int m = 0; m < kLoadBatch; ++m) {
      const int c = c0 + m;
      if (c >= k_end) continue;
      const float kv = m < 4 ? k_lo.v[m] : k_hi.v[m - 4];
      sk = fmaf(kv, m < 4 ? r_lo.v[m] : r_hi.v[m - 4], sk);
      if (grad_qd) sq = fmaf(gq[m], m < 4 ? q_lo.v[m] : q_hi.v[m - 4], sq);
      if (grad_kend) sf = fmaf(gk[m], kv, sf);
    }
  }
  for (int j = p * j_width; j < (p + 1) * j_width; ++j) {
    sb += sm.kl[i * mp + j];
    row_e += sm.pm[i * mp + j];
    col_e += sm.pm[j * mp + i];
  }
  return RowParts{su, sk, sq, sf, sb, row_e, col_e};
}

// Tensor-core variant, phase 5: phase 6's A1 = dKK + dKK^T, in place in d1 (read only by
// phase 6, after phase 5's barriers): one thread per pair i >= j reads both and writes both,
// with phase 6's SIMT sum dKK_ij + dKK_ji.
template <int DK>
__device__ __forceinline__ void symmetrize_dkk(const BackwardSmem<DK>& sm) {
  float* d1 = sm.d1;
  for (int e = threadIdx.x; e < kC * kC; e += kBackwardThreads) {
    const int a = e / kC, b = e % kC;
    if (a < b) continue;
    const float sym = d1[cc_at(a, b)] + d1[cc_at(b, a)];
    d1[cc_at(a, b)] = sym;
    d1[cc_at(b, a)] = sym;
  }
}

// The thread's partials into [part][sum][C] over kl and pm (free once every thread has
// read them: after a barrier).
template <int DK>
__device__ __forceinline__ void store_row_parts(const BackwardSmem<DK>& sm, const RowParts& parts) {
  constexpr int kSums = RowParts::kSums;
  static_assert(RowParts::kParts * kSums * kC <= 2 * kC * (kC + 1), "partials fit kl and pm");
  const int tid = threadIdx.x, i = tid % kC, p = tid / kC;
  float* out = sm.kl + p * kSums * kC + i;
  out[0 * kC] = parts.su;
  out[1 * kC] = parts.sk;
  out[2 * kC] = parts.sq;
  out[3 * kC] = parts.sf;
  out[4 * kC] = parts.sb;
  out[5 * kC] = parts.row_e;
  out[6 * kC] = parts.col_e;
}

// One thread per row adds the eight parts in part order: dbeta (stored), the row part of
// dG into dgs, and f_i = exp(G_last - G_i) <dKend_i, K_i> into fs (the G_last terms).
template <int DK>
__device__ __forceinline__ void row_sums_dbeta(const ChunkPrepBackwardArgs& args,
                                               const BackwardSmem<DK>& sm, const ChunkPlace& place,
                                               float g_last) {
  constexpr int kParts = RowParts::kParts, kSums = RowParts::kSums;
  const ChunkPrepShape& s = args.shape;
  const float* part = sm.kl;
  const float* bs = sm.bs;
  const float* es = sm.es;
  const int tid = threadIdx.x;
  if (tid < kC) {
    const int i = tid;
    float sum[kSums];
#pragma unroll
    for (int n = 0; n < kSums; ++n) {
      sum[n] = part[n * kC + i];
      for (int q = 1; q < kParts; ++q) sum[n] += part[(q * kSums + n) * kC + i];
    }
    const float su = sum[0], sk = sum[1], sq = sum[2], sf = sum[3], sb = sum[4];
    const float row_e = sum[5], col_e = sum[6];
    const float f = expf(g_last - sm.gs[i]) * sf;
    sm.fs[i] = f;
    sm.dgs[i] = bs[i] * es[i] * sk + es[i] * sq - f + row_e - col_e;
    if (i < place.rows) {
      args.dbeta[place.row0 + static_cast<long long>(i) * s.heads] = su + es[i] * sk + sb;
    }
  }
}

// Thread 0: the G_last terms, then dg_t = sum_{t' >= t in the chunk} dG_t' (stored).
template <int DK>
__device__ __forceinline__ void reverse_cumsum_dg(const ChunkPrepBackwardArgs& args,
                                                  const BackwardSmem<DK>& sm,
                                                  const ChunkPlace& place) {
  const ChunkPrepShape& s = args.shape;
  if (threadIdx.x == 0) {
    // G_last = G_{C-1} feeds Kend (through exp(G_last - G_i)) and the state scan.
    float f_total = 0.0f;
    for (int i = 0; i < kC; ++i) f_total += sm.fs[i];
    const float dg_last = args.grad_g_last ? args.grad_g_last[place.block] : 0.0f;
    sm.dgs[kC - 1] += dg_last + f_total;
    float acc = 0.0f;  // dg_t = sum_{t' >= t in the chunk} dG_t'
    for (int i = kC - 1; i >= 0; --i) {
      acc += sm.dgs[i];
      if (i < place.rows) args.dg[place.row0 + static_cast<long long>(i) * s.heads] = acc;
    }
  }
}

// Phase 6: dK_ic = sum_j (dKK_ij + dKK_ji) K_jc + dQK_ji Q_jc + beta_i exp(G_i) dRw_ic
// + dKend_ic exp(G_last - G_i);  dQ_ic = sum_j dQK_ij K_jc + dQd_ic exp(G_i);
// dq = scale dQ, j in order for every element. Thread (tr, tc) = (tid / 16, tid % 16)
// owns rows tr + 32a (a < 2) and, in each column pass p (one pass of dk columns up to
// dk = 128, two of 128 at dk = 256), columns 128 p + tc + 16b (b < kCols): per j it loads
// 8 C x C values and 2 kCols of K, Q for 6 kCols FMAs (acc_k, acc_q: 2 x 2 kCols
// registers). A warp is two rows of threads: its K, Q reads are 16 consecutive words
// (broadcast to both rows), its C x C reads two words.
template <int DK>
struct DkDqTiles {
  static constexpr int kColThreads = 16;
  static constexpr int kRowThreads = kBackwardThreads / kColThreads;
  static constexpr int kRows = kC / kRowThreads;
  static constexpr int kPassCols = DK < 128 ? DK : 128;
  static constexpr int kPasses = DK / kPassCols;
  static constexpr int kCols = kPassCols / kColThreads;
  static_assert(kBackwardThreads % kColThreads == 0 && kC % kRowThreads == 0 &&
                    kPassCols % kColThreads == 0 && DK % kPassCols == 0,
                "dk, dq tiles cover the chunk");
  static_assert(kPasses == 1 || BackwardSmem<DK>::kPanelInScratch,
                "column passes park raw rows in the scratch slot");
  // One thread's tiles of a pass: dK and scale dQ (acc_k, acc_q), and the L2 norm's
  // per-thread row dots over all passes.
  float acc_k[kRows][kCols], acc_q[kRows][kCols];
  float dot_q_part[kRows], dot_k_part[kRows];
};

// The SIMT products of one pass: acc_k = sum_j (dKK_ij + dKK_ji) K_jc + dQK_ji Q_jc,
// acc_q = sum_j dQK_ij K_jc, j in order.
template <int DK>
__device__ __forceinline__ void dkdq_simt(const BackwardSmem<DK>& sm, int c0, DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  constexpr int kp = BackwardSmem<DK>::kp, mp = BackwardSmem<DK>::mp;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  const float* d1 = sm.d1;
  const float* d2 = sm.d2;
  for (int j = 0; j < kC; ++j) {
    float kj[T::kCols], qj[T::kCols], skk[T::kRows], dqk_ji[T::kRows], dqk_ij[T::kRows];
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      kj[b] = sm.ks[j * kp + c0 + tc + T::kColThreads * b];
      qj[b] = sm.qs[j * kp + c0 + tc + T::kColThreads * b];
    }
#pragma unroll
    for (int a = 0; a < T::kRows; ++a) {
      const int i = tr + T::kRowThreads * a;
      skk[a] = d1[i * mp + j] + d1[j * mp + i];
      dqk_ji[a] = d2[j * mp + i];
      dqk_ij[a] = d2[i * mp + j];
    }
#pragma unroll
    for (int a = 0; a < T::kRows; ++a) {
#pragma unroll
      for (int b = 0; b < T::kCols; ++b) {
        t.acc_k[a][b] = fmaf(skk[a], kj[b], t.acc_k[a][b]);
        t.acc_k[a][b] = fmaf(dqk_ji[a], qj[b], t.acc_k[a][b]);
        t.acc_q[a][b] = fmaf(dqk_ij[a], kj[b], t.acc_q[a][b]);
      }
    }
  }
}

// The same products on tensor cores (dkdq_tc), staged in shared memory (kl and pm: free
// since phase 5's part sums; then d1 and d2) and read back into the SIMT layout.
template <int DK>
__device__ __forceinline__ void dkdq_tensor_cores(const BackwardSmem<DK>& sm, DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  float* stage0 = sm.kl;
  float* stage1 = sm.d1;
  dkdq_tc<DK>(sm.d1, sm.d2, sm.ks, sm.qs, stage0, stage1);
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int i = tr + T::kRowThreads * a, c = tc + T::kColThreads * b;
      const float* stage = c < kStageCols ? stage0 : stage1;
      t.acc_k[a][b] = stage[stage_at(i, c % kStageCols)];
      t.acc_q[a][b] = stage[kC * kStageCols + stage_at(i, c % kStageCols)];
    }
  }
}

// acc_k, acc_q become dK and scale dQ: the products plus the row terms, the gradients of
// the rows as steps 1-6 use them (after the fused L2 norm, when it is on). Padded rows are
// formed too but never stored, so that every thread can take part in the L2 norm's row
// dots.
template <int DK>
__device__ __forceinline__ void add_dkdq_row_terms(const ChunkPrepShape& s,
                                                   const BackwardSmem<DK>& sm,
                                                   const ChunkPlace& place, int c0, float g_last,
                                                   const float* grad_qd, const float* grad_kend,
                                                   DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  const float* bs = sm.bs;
  const float* es = sm.es;
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
    const int i = tr + T::kRowThreads * a;
    const bool real = i < place.rows;
    const float decay_end = expf(g_last - sm.gs[i]);
    float dkend[T::kCols], dqd[T::kCols];  // loaded before use: Note [Batched global loads]
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int c = c0 + tc + T::kColThreads * b;
      dkend[b] = grad_kend && real ? grad_kend[i * DK + c] : 0.0f;
      dqd[b] = grad_qd && real ? grad_qd[i * DK + c] : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int c = c0 + tc + T::kColThreads * b;
      t.acc_k[a][b] =
          t.acc_k[a][b] + bs[i] * es[i] * sm.rs[i * sm.rp + sm.dv + c] + dkend[b] * decay_end;
      t.acc_q[a][b] = (t.acc_q[a][b] + dqd[b] * es[i]) * s.scale;
    }
  }
}

// The fused L2 norm's backward, dx = r (dxn - xn <xn, dxn>) (Note [Fused q/k L2 norm]).
// Row i's columns belong to the 16 threads with this tr: each adds its products, columns
// ascending over the passes, into one partial per row; after the passes every thread of the
// row adds the 16 partials in tc order (the same bits on all 16). With column passes the
// raw rows park until then: dK in rs's dW columns (which the same thread has just read),
// dQ in qstash after rs.
template <typename TQK, int DK>
__device__ __forceinline__ void l2_norm_row_dot_parts(const ChunkPrepBackwardArgs& args,
                                                      const BackwardSmem<DK>& sm,
                                                      const ChunkPlace& place, int c0,
                                                      DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  constexpr int kp = BackwardSmem<DK>::kp;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  const TQK* q = static_cast<const TQK*>(args.q);
  float* qstash = sm.rs + kC * sm.rp;  // kPasses > 1 only
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
    const int i = tr + T::kRowThreads * a;
    const bool real = i < place.rows;
    const long long q_row = key_row(args.q_strides, place, i);
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int c = c0 + tc + T::kColThreads * b;
      const float xq = real ? load_float(q + q_row + c) * sm.rq[i] : 0.0f;
      t.dot_q_part[a] = fmaf(xq, t.acc_q[a][b], t.dot_q_part[a]);
      t.dot_k_part[a] = fmaf(sm.ks[i * kp + c], t.acc_k[a][b], t.dot_k_part[a]);
      if constexpr (T::kPasses > 1) {
        sm.rs[i * sm.rp + sm.dv + c] = t.acc_k[a][b];
        qstash[i * DK + c] = t.acc_q[a][b];
      }
    }
  }
}

// The row dots' per-thread partials into xs (free since phase 3): [2][C][16], q's, then k's.
template <int DK>
__device__ __forceinline__ void store_row_dot_parts(const BackwardSmem<DK>& sm,
                                                    const DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  static_assert(2 * kC * T::kColThreads <= kC * (kSlab + 1), "row dots fit the slab buffer");
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  float* dots = sm.xs;
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
    const int i = tr + T::kRowThreads * a;
    dots[i * T::kColThreads + tc] = t.dot_q_part[a];
    dots[(kC + i) * T::kColThreads + tc] = t.dot_k_part[a];
  }
}

// Once the partials are published: the row dots (16 partials in tc order) and the pass's
// gradients mapped back through the norm, dx = r (dxn - xn <xn, dxn>).
template <typename TQK, int DK>
__device__ __forceinline__ void l2_norm_backward(const ChunkPrepBackwardArgs& args,
                                                 const BackwardSmem<DK>& sm,
                                                 const ChunkPlace& place, int c0,
                                                 DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  constexpr int kp = BackwardSmem<DK>::kp;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  const TQK* q = static_cast<const TQK*>(args.q);
  const float* dots = sm.xs;
  const float* qstash = sm.rs + kC * sm.rp;  // kPasses > 1 only
  const float* rq = sm.rq;
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
    const int i = tr + T::kRowThreads * a;
    if (i >= place.rows) continue;
    const long long q_row = key_row(args.q_strides, place, i);
    float dot_q = 0.0f, dot_k = 0.0f;
    for (int u = 0; u < T::kColThreads; ++u) {
      dot_q += dots[i * T::kColThreads + u];
      dot_k += dots[(kC + i) * T::kColThreads + u];
    }
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int c = c0 + tc + T::kColThreads * b;
      if constexpr (T::kPasses > 1) {
        t.acc_k[a][b] = sm.rs[i * sm.rp + sm.dv + c];
        t.acc_q[a][b] = qstash[i * DK + c];
      }
      const float xq = load_float(q + q_row + c) * rq[i];
      t.acc_q[a][b] = rq[i] * fmaf(-xq, dot_q, t.acc_q[a][b]);
      t.acc_k[a][b] = sm.rk[i] * fmaf(-sm.ks[i * kp + c], dot_k, t.acc_k[a][b]);
    }
  }
}

// The pass's dk and dq (rows of the chunk only), in q's type or as FP32 partials
// (head_group > 1).
template <typename TQK, int DK>
__device__ __forceinline__ void store_dkdq(const ChunkPrepBackwardArgs& args,
                                           const ChunkPlace& place, int c0,
                                           const DkDqTiles<DK>& t) {
  using T = DkDqTiles<DK>;
  const ChunkPrepShape& s = args.shape;
  const int tid = threadIdx.x, tr = tid / T::kColThreads, tc = tid % T::kColThreads;
  const bool partials = s.head_group > 1;
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) {
    const int i = tr + T::kRowThreads * a;
    if (i >= place.rows) continue;
#pragma unroll
    for (int b = 0; b < T::kCols; ++b) {
      const int c = c0 + tc + T::kColThreads * b;
      // Partials (head_group > 1) always take the contiguous layout (stride 0).
      const long long at = grad_row(s, args.grad_token_stride, place, i, DK) + c;
      store_qk_grad<TQK>(args.dk, partials, at, t.acc_k[a][b]);
      store_qk_grad<TQK>(args.dq, partials, at, t.acc_q[a][b]);
    }
  }
}

// Phase 6 (see above DkDqTiles): dk and dq of the chunk, pass by pass, with the fused L2
// norm's barrier for the row dots.
template <typename TQK, int DK, bool TC>
__device__ __forceinline__ void dk_dq_gradients(const ChunkPrepBackwardArgs& args,
                                                const BackwardSmem<DK>& sm, const ChunkPlace& place,
                                                float g_last, const float* grad_qd,
                                                const float* grad_kend) {
  using T = DkDqTiles<DK>;
  static_assert(T::kPasses == 1 || !TC, "the wide-head backward is SIMT only");
  const ChunkPrepShape& s = args.shape;
  T t;
#pragma unroll
  for (int a = 0; a < T::kRows; ++a) t.dot_q_part[a] = t.dot_k_part[a] = 0.0f;
#pragma unroll 1
  for (int pass = 0; pass < T::kPasses; ++pass) {
    const int c0 = T::kPassCols * pass;
#pragma unroll
    for (int a = 0; a < T::kRows; ++a) {
#pragma unroll
      for (int b = 0; b < T::kCols; ++b) t.acc_k[a][b] = t.acc_q[a][b] = 0.0f;
    }
    if constexpr (TC) {
      dkdq_tensor_cores(sm, t);  // barriers inside (dkdq_tc)
    } else {
      dkdq_simt(sm, c0, t);
    }
    add_dkdq_row_terms(s, sm, place, c0, g_last, grad_qd, grad_kend, t);
    if (!s.l2_normalize_qk) {
      if constexpr (T::kPasses > 1) store_dkdq<TQK>(args, place, c0, t);
      continue;
    }
    l2_norm_row_dot_parts<TQK>(args, sm, place, c0, t);
  }
  if (s.l2_normalize_qk) {
    store_row_dot_parts(sm, t);
    __syncthreads();
#pragma unroll 1
    for (int pass = 0; pass < T::kPasses; ++pass) {
      const int c0 = T::kPassCols * pass;
      l2_norm_backward<TQK>(args, sm, place, c0, t);
      if constexpr (T::kPasses > 1) store_dkdq<TQK>(args, place, c0, t);
    }
  }
  if constexpr (T::kPasses == 1) store_dkdq<TQK>(args, place, 0, t);
}

// The end of phase 6: dv = beta_i dRu (rows of the chunk only).
template <typename TV, int DK>
__device__ __forceinline__ void store_dv(const ChunkPrepBackwardArgs& args,
                                         const BackwardSmem<DK>& sm, const ChunkPlace& place) {
  const ChunkPrepShape& s = args.shape;
  const int dv = sm.dv;
  for (int e = threadIdx.x; e < kC * dv; e += kBackwardThreads) {
    const int i = e / dv, c = e % dv;
    if (i < place.rows) {
      store_float(static_cast<TV*>(args.dv) + grad_row(s, args.grad_token_stride, place, i, dv) + c,
                  sm.bs[i] * sm.rs[i * sm.rp + c]);
    }
  }
}

// The backward of one chunk (the phases and the layout: above BackwardSmem).
template <typename TQK, typename TV, int DK, bool TC>
__device__ void chunk_prep_backward_block(const ChunkPrepBackwardArgs& args, float* smem,
                                          unsigned block, float* scratch) {
  using Smem = BackwardSmem<DK>;
  static_assert(!(Smem::kPanelInScratch && TC), "the wide-head backward is SIMT only");
  constexpr int kThreads = kBackwardThreads;
  const ChunkPrepShape& s = args.shape;
  const Smem sm = backward_smem<DK>(s, smem, scratch);
  const int tid = threadIdx.x;
  ChunkPlace place = chunk_place(s, block);
  long long chunk_dv = place.block * kC * sm.dv, chunk_dk = place.block * kC * DK;

  // Phase 0: Q, K, the panel [dU | dW] issued, the decays, the fused L2 norm.
  load_qk<TQK, kThreads>(args, place, sm.qs, Smem::kp, sm.ks, Smem::kp);
  if constexpr (!Smem::kPanelInScratch) issue_grad_panel(args, sm, chunk_dv, chunk_dk);
  load_decays(args, place, sm.gs, sm.bs, sm.es);  // a barrier inside, then the cumsum
  if (s.l2_normalize_qk) normalize_qk<kThreads>(s, sm.qs, Smem::kp, sm.ks, Smem::kp, sm.rq, sm.rk);
  __syncthreads();

  // Phase 1: kl, M^T, P; the panel complete.
  backward_decayed_gram(sm);
  if (tid == 0) sm.fs[0] = __uint_as_float(block);  // its bits, for after phase 2
  finish_grad_panel(args, sm, chunk_dv, chunk_dk);
  __syncthreads();

  // Phase 2: dR in place of the panel.
  solve_grad_panel(sm);
  __syncthreads();
  // The same place again, from the chunk index parked in fs (free until phase 5):
  // otherwise its 64-bit fields (or blockIdx.x, whose read ptxas hoists) stay live in
  // registers, or spilled, through the solve above, whose column alone takes C.
  place = chunk_place(s, __float_as_uint(sm.fs[0]));
  chunk_dv = place.block * kC * sm.dv;
  chunk_dk = place.block * kC * DK;

  // Phase 3: dM = -dR X^T into d1, X slab by slab through xs (each slab published by a
  // barrier and kept until every thread has multiplied it).
  {
    DmAccumulators acc;
    DmSlab<DK> slab;
    zero_dm(acc);
    fetch_x_slab(args, sm, chunk_dv, chunk_dk, 0, slab);
    for (int c0 = 0; c0 < sm.cols; c0 += kSlab) {
      store_x_slab(sm, slab);
      __syncthreads();
      if (c0 + kSlab < sm.cols) fetch_x_slab(args, sm, chunk_dv, chunk_dk, c0 + kSlab, slab);
      accumulate_dm_slab<DK, TC>(sm, c0, acc);
      __syncthreads();
    }
    store_dm<DK, TC>(sm, acc);
  }
  __syncthreads();

  // Phase 4: E, dM .* kl, dKK, dQK.
  backward_decay_grads<DK, TC>(args, sm, place);
  __syncthreads();

  // Phase 5: the row sums: dbeta, dG, dg.
  const float g_last = sm.gs[kC - 1];
  const float* grad_qd = args.grad_qd ? args.grad_qd + chunk_dk : nullptr;
  const float* grad_kend = args.grad_kend ? args.grad_kend + chunk_dk : nullptr;
  {
    const RowParts parts = row_part_sums<TV>(args, sm, place, grad_qd, grad_kend);
    if constexpr (TC) symmetrize_dkk(sm);
    __syncthreads();  // every read of kl and pm done
    store_row_parts(sm, parts);
  }
  __syncthreads();
  row_sums_dbeta(args, sm, place, g_last);
  __syncthreads();
  reverse_cumsum_dg(args, sm, place);

  // Phase 6: dk, dq; dv.
  dk_dq_gradients<TQK, DK, TC>(args, sm, place, g_last, grad_qd, grad_kend);
  store_dv<TV>(args, sm, place);
}

// The backward over the grid: block b runs chunk b; the wide-head backward (Note [Chunk prep
// wide-head backward]) runs args.scratch_slots blocks, block b taking chunks b, b + slots,
// ... in turn in its own scratch slot (chunk_prep_backward_scratch_floats floats).
template <typename TQK, typename TV, int DK, bool TC>
__device__ void chunk_prep_backward_grid(const ChunkPrepBackwardArgs& args, float* smem) {
  if constexpr (chunk_prep_backward_uses_scratch(DK)) {
    const ChunkPrepShape& s = args.shape;
    const long long chunks = s.batch * s.heads * s.chunks;
    float* scratch = args.scratch + blockIdx.x * chunk_prep_backward_scratch_floats(DK, s.dv);
    for (long long chunk = blockIdx.x; chunk < chunks; chunk += args.scratch_slots) {
      chunk_prep_backward_block<TQK, TV, DK, TC>(args, smem, static_cast<unsigned>(chunk), scratch);
      __syncthreads();  // the next chunk rewrites the shared memory and the slot
    }
  } else {
    chunk_prep_backward_block<TQK, TV, DK, TC>(args, smem, blockIdx.x, nullptr);
  }
}

}  // namespace gdr::kernels::chunk_prep_detail
