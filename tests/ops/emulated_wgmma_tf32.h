// Host stand-ins for the warpgroup primitives of kernels/common/wgmma_tf32.cuh (shared_address,
// fence_operands_for_wgmma, wgmma_fence, wgmma_commit, wgmma_wait, fence_accumulators,
// wgmma_m64n64k8_tf32), for the *_kernel_emulation_test binaries: include after
// tests/ops/emulated_cuda.h and tests/ops/emulated_mma_tf32.h and define
// GDR_WGMMA_TF32_HOST_HELPERS (or a kernel's macro that implies it) before including the
// kernel header. Each test binary is one translation unit, so these globals are its own.
//
// The emulated wgmma decodes its matrix descriptors as the hardware does for the
// no-swizzle K-major layout (Note [wgmma K-major operand layout]): start address, leading
// byte offset (between core matrices along k) and stride byte offset (between 8-row
// strips), relative to the block's shared-memory window (g_shared_window, set by the test
// to the block's dynamic shared memory). Each thread computes its own 32 accumulator
// elements, as the hardware's layout assigns them, with the arithmetic of the emulated
// mma.sync (an FP64 sum of the eight exact TF32 products added to the accumulator, then
// one rounding to FP32), so a kernel that feeds both paths the same operands gets the
// same bits from both.
// Asynchrony: a wgmma reads its operands at some point between its issue and the
// wgmma_wait_all after its commit, and writes the accumulators by then. The stand-in
// copies the operands at issue and computes at the wait from the operands as they are
// then, failing the test when they changed in between (a kernel that rewrites an operand
// while a wgmma may still read it); a kernel that reads its accumulators before the wait
// reads values the batch has not updated yet.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/ops/emulated_cuda.h"
#include "tests/ops/emulated_mma_tf32.h"

inline const char* g_shared_window = nullptr;  // the block's shared memory, byte 0
inline int64_t g_wgmma_count = 0;              // by thread 0 of the block (one writer)

inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(static_cast<const char*>(p) - g_shared_window);
}

inline void fence_operands_for_wgmma() {}
inline void wgmma_fence() {}
inline void fence_accumulators(float (&)[32]) {}

namespace gdr::test_support {

// The 64 x 8 operand words a descriptor names, [row][k].
struct WgmmaOperand {
  uint32_t words[64][8];
};

inline WgmmaOperand read_wgmma_operand(uint64_t descriptor) {
  EXPECT_EQ(descriptor >> 49, 0u) << "only base offset 0 and the no-swizzle mode are emulated";
  const uint32_t start = static_cast<uint32_t>(descriptor & 0x3fffu) << 4;
  const uint32_t leading = static_cast<uint32_t>((descriptor >> 16) & 0x3fffu) << 4;
  const uint32_t stride = static_cast<uint32_t>((descriptor >> 32) & 0x3fffu) << 4;
  WgmmaOperand x;
  for (int row = 0; row < 64; ++row) {
    for (int k = 0; k < 8; ++k) {
      const uint32_t byte =
          start + (row / 8) * stride + (k / 4) * leading + (row % 8) * 16 + (k % 4) * 4;
      std::memcpy(&x.words[row][k], g_shared_window + byte, 4);
    }
  }
  return x;
}

struct PendingWgmma {
  float* d;
  uint64_t a, b;
  WgmmaOperand a_at_issue, b_at_issue;
};
using WgmmaBatch = std::vector<PendingWgmma>;
inline thread_local WgmmaBatch t_issued_wgmma;
inline thread_local std::vector<WgmmaBatch> t_committed_wgmma;  // oldest first

// One wgmma at its latest moment: from the operands as they are now, which must be as they
// were at its issue.
inline void complete_wgmma(const PendingWgmma& w) {
  const int warp = static_cast<int>(threadIdx.x / 32 % 4),
            lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;
  auto value = [](uint32_t bits) { return double{tf32_as_float(bits & 0xffffe000u)}; };
  const WgmmaOperand a = read_wgmma_operand(w.a), b = read_wgmma_operand(w.b);
  EXPECT_EQ(std::memcmp(&a, &w.a_at_issue, sizeof a), 0)
      << "an A operand changed between a wgmma's issue and the wait that completes it";
  EXPECT_EQ(std::memcmp(&b, &w.b_at_issue, sizeof b), 0)
      << "a B operand changed between a wgmma's issue and the wait that completes it";
  // Register 4 c + 2 h + e: row 16 warp + g + 8 h, column 8 c + 2 t + e.
  for (int reg = 0; reg < 32; ++reg) {
    const int c = reg / 4, h = reg % 4 / 2, e = reg % 2;
    const int row = 16 * warp + g + 8 * h, col = 8 * c + 2 * t + e;
    double acc = w.d[reg];
    for (int k = 0; k < 8; ++k) acc += value(a.words[row][k]) * value(b.words[col][k]);
    w.d[reg] = static_cast<float>(acc);
  }
}

}  // namespace gdr::test_support

inline void wgmma_m64n64k8_tf32(float (&d)[32], uint64_t a, uint64_t b) {
  using namespace gdr::test_support;
  t_issued_wgmma.push_back({d, a, b, read_wgmma_operand(a), read_wgmma_operand(b)});
  if (threadIdx.x == 0) ++g_wgmma_count;
}

inline void wgmma_commit() {
  using namespace gdr::test_support;
  t_committed_wgmma.push_back(std::move(t_issued_wgmma));
  t_issued_wgmma.clear();
}

// Completes every committed batch but the newest kPending, oldest first.
template <int kPending>
void wgmma_wait() {
  using namespace gdr::test_support;
  while (t_committed_wgmma.size() > static_cast<size_t>(kPending)) {
    for (const PendingWgmma& w : t_committed_wgmma.front()) complete_wgmma(w);
    t_committed_wgmma.erase(t_committed_wgmma.begin());
  }
}
