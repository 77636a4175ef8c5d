// Host stand-ins for the TF32 tensor-core primitives of kernels/common/mma_tf32.cuh (tf32_round,
// tf32_as_float, mma_m16n8k8_tf32), for the *_kernel_emulation_test binaries that run
// tensor-core kernel code on the CPU: include after tests/ops/emulated_cuda.h (the mma is a
// warp-collective exchange through its per-warp barriers) and define
// GDR_MMA_TF32_HOST_HELPERS (or a kernel's macro that implies it) before including the
// kernel header. Each test binary is one translation unit, so these globals are its own.
#pragma once

#include <cstdint>
#include <cstring>

#include "tests/ops/emulated_cuda.h"

// cvt.rna.tf32.f32: round to nearest, ties away from zero, on the 13 low mantissa bits
// (adding half an ulp to the sign-magnitude pattern rounds the magnitude half-up); the
// low 13 bits of the result are zero.
inline uint32_t tf32_round(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u) return bits & 0xffffe000u;  // inf / nan: as is
  return (bits + 0x1000u) & 0xffffe000u;
}

inline float tf32_as_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// The warp-collective mma.sync m16n8k8 row.col f32.tf32.tf32.f32: every lane publishes its
// fragments, a warp barrier, every lane computes its four D elements from the whole
// 16 x 8 x 8 product (FP64 sum of the exact TF32 products, rounded once to FP32), a warp
// barrier before the scratch is reused. As the hardware, it reads only the TF32 bits of
// the operands (the low 13 bits are ignored), so a missing tf32_round shows up.
struct MmaFragments {
  uint32_t a[4], b[2];
};
inline MmaFragments g_mma_scratch[kMaxWarps][32];
inline int64_t g_mma_count = 0;  // by lane 0 of warp 0 (one writer)

inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  MmaFragments& mine = g_mma_scratch[warp][lane];
  for (int r = 0; r < 4; ++r) mine.a[r] = a[r];
  for (int r = 0; r < 2; ++r) mine.b[r] = b[r];
  pthread_barrier_wait(&g_warp_barrier[warp]);
  const MmaFragments* frag = g_mma_scratch[warp];
  auto value = [](uint32_t bits) { return double{tf32_as_float(bits & 0xffffe000u)}; };
  // A[r][k]: lane 4 (r % 8) + k % 4, register r / 8 + 2 (k / 4); B[k][n]: lane 4 n + k % 4,
  // register k / 4.
  auto A = [&](int r, int k) { return value(frag[4 * (r % 8) + k % 4].a[r / 8 + 2 * (k / 4)]); };
  auto B = [&](int k, int n) { return value(frag[4 * n + k % 4].b[k / 4]); };
  const int g = static_cast<int>(lane) / 4, t = static_cast<int>(lane) % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    double acc = d[e];
    for (int k = 0; k < 8; ++k) acc += A(row, k) * B(k, col);
    d[e] = static_cast<float>(acc);
  }
  if (warp == 0 && lane == 0) ++g_mma_count;
  pthread_barrier_wait(&g_warp_barrier[warp]);
}
