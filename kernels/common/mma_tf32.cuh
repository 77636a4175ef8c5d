// Warp-level TF32 tensor-core products at FP32-level accuracy (3xTF32), shared by the
// tensor-core chunk state scan (kernels/gdr_core/chunk_state_tc_kernel.cuh) and the tensor-core
// paths of the chunk prep kernels (kernels/gdr_core/chunk_prep_kernel.cuh). Device code only.
// NOTE: keep this file free of includes (besides <cstdint> types, which every includer
// already has) and of CUDA APIs beyond __device__, __forceinline__ and __uint_as_float: the
// CPU emulation tests (//tests/ops:gdr_chunk_state_kernel_emulation_test,
// //tests/ops:gdr_chunk_prep_kernel_emulation_test) compile it as host code. With
// GDR_MMA_TF32_HOST_HELPERS defined, the three primitives below (tf32_round, tf32_as_float,
// mma_m16n8k8_tf32) are not defined here: the test supplies host stand-ins (the mma as a
// warp-collective exchange through a per-warp scratch and barrier; tests/ops/
// emulated_mma_tf32.h), found by unqualified lookup from this namespace.
//
// Note [3xTF32 products]
// mma.sync m16n8k8 TF32 with FP32 accumulation. TF32 keeps 10 mantissa bits, so each FP32
// operand x is split into big = tf32(x) (cvt.rna) and small = tf32(x - big) (x - big is
// exact in FP32), and a product a * b is taken as a_big b_big + a_big b_small +
// a_small b_big (the dropped a_small b_small and the rounding of small are ~2^-22
// relative): FP32-level accuracy. Per 16 x 8 output tile a warp keeps three FP32
// accumulators (Acc3), `big` (a_big b_big), `lo_a` (a_small b_big) and `lo_b`
// (a_big b_small), each walking k in increasing order (three independent mma chains), and
// adds them once at the end as big + (lo_a + lo_b): every output element is one warp's
// fixed sequence of mma instructions on fixed inputs, whose internal order the hardware
// fixes, so the bits do not depend on scheduling.
#pragma once

namespace gdr::kernels::mma_tf32 {

#ifndef GDR_MMA_TF32_HOST_HELPERS
// TF32 bits of x, rounded to nearest with ties away from zero (cvt.rna), low 13 bits 0.
__device__ __forceinline__ uint32_t tf32_round(float x) {
  uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
#endif
  return bits & 0xffffe000u;  // the mma ignores them; x - big below needs them zero
}

__device__ __forceinline__ float tf32_as_float(uint32_t bits) { return __uint_as_float(bits); }

// d += a @ b for one warp: a 16 x 8 (row), b 8 x 8 (col), d 16 x 8, FP32 accumulate.
// Fragments (g = lane / 4, t = lane % 4): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]; d0 = D[g][2t], d1 = D[g][2t+1],
// d2 = D[g+8][2t], d3 = D[g+8][2t+1].
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#endif  // GDR_MMA_TF32_HOST_HELPERS

// One operand's big / small TF32 parts.
__device__ __forceinline__ void split_tf32(float x, uint32_t& big, uint32_t& small) {
  big = tf32_round(x);
  small = tf32_round(x - tf32_as_float(big));
}

// The three accumulators of one 16 x 8 output tile (Note [3xTF32 products]).
struct Acc3 {
  float big[4], lo_a[4], lo_b[4];
};

__device__ __forceinline__ void zero(Acc3& acc) {
#pragma unroll
  for (int e = 0; e < 4; ++e) acc.big[e] = acc.lo_a[e] = acc.lo_b[e] = 0.0f;
}

// The 3xTF32 step of one k-slice (Note [3xTF32 products]).
__device__ __forceinline__ void mma_3xtf32(Acc3& acc, const uint32_t (&a_big)[4],
                                           const uint32_t (&a_small)[4], const uint32_t (&b_big)[2],
                                           const uint32_t (&b_small)[2]) {
  mma_m16n8k8_tf32(acc.lo_a, a_small, b_big);
  mma_m16n8k8_tf32(acc.lo_b, a_big, b_small);
  mma_m16n8k8_tf32(acc.big, a_big, b_big);
}

// Element e of the tile's product.
__device__ __forceinline__ float total(const Acc3& acc, int e) {
  return acc.big[e] + (acc.lo_a[e] + acc.lo_b[e]);
}

// The k-slice k0 .. k0 + 7 of one 16 x 8 tile with both operands as FP32 rows in shared
// memory (A row-major with pitch a_pitch, B stored as B^T: row n holds B[.][n]), split at
// the reader. a_rows points at A's row g, column t of the tile, b_rows at B^T's row g,
// column t (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void mma_3xtf32_rows(Acc3& acc, const float* a_rows, int a_pitch,
                                                const float* b_rows, int k0) {
  uint32_t a_big[4], a_small[4], b_big[2], b_small[2];
  split_tf32(a_rows[k0], a_big[0], a_small[0]);
  split_tf32(a_rows[8 * a_pitch + k0], a_big[1], a_small[1]);
  split_tf32(a_rows[k0 + 4], a_big[2], a_small[2]);
  split_tf32(a_rows[8 * a_pitch + k0 + 4], a_big[3], a_small[3]);
  split_tf32(b_rows[k0], b_big[0], b_small[0]);
  split_tf32(b_rows[k0 + 4], b_big[1], b_small[1]);
  mma_3xtf32(acc, a_big, a_small, b_big, b_small);
}

}  // namespace gdr::kernels::mma_tf32
