// Host stand-ins for the CUDA built-ins that the kernel bodies in kernels/*_kernel.cuh use,
// for the *_kernel_emulation_test binaries: one std::thread per CUDA thread, a barrier for
// __syncthreads, a per-warp exchange slot and barrier for __shfl_xor_sync, and run_grid,
// which runs a 1-D grid one block at a time. Include before the kernel header; each test
// binary is one translation unit, so these globals are its own.
#pragma once

#include <pthread.h>

#include <cstdint>
#include <thread>
#include <vector>

struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmulatedIndex threadIdx, blockIdx, blockDim;
inline pthread_barrier_t g_block_barrier;
constexpr int kMaxWarps = 16;
inline pthread_barrier_t g_warp_barrier[kMaxWarps];
inline float g_warp_slot[kMaxWarps][32];

inline void __syncthreads() { pthread_barrier_wait(&g_block_barrier); }

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  g_warp_slot[warp][lane] = v;
  pthread_barrier_wait(&g_warp_barrier[warp]);
  const float other = g_warp_slot[warp][lane ^ static_cast<unsigned>(lane_mask)];
  pthread_barrier_wait(&g_warp_barrier[warp]);
  return other;
}

namespace gdr::test_support {

// Runs `body(block)` as `blocks` blocks of `threads` host threads (a multiple of 32, at
// most kMaxWarps warps), one block at a time.
template <typename Body>
void run_grid(int64_t blocks, int threads, const Body& body) {
  pthread_barrier_init(&g_block_barrier, nullptr, threads);
  for (int w = 0; w < threads / 32; ++w) pthread_barrier_init(&g_warp_barrier[w], nullptr, 32);
  for (int64_t b = 0; b < blocks; ++b) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&body, b, t, threads] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        blockDim.x = static_cast<unsigned>(threads);
        body(b);
      });
    }
    for (std::thread& thread : pool) thread.join();
  }
  for (int w = 0; w < threads / 32; ++w) pthread_barrier_destroy(&g_warp_barrier[w]);
  pthread_barrier_destroy(&g_block_barrier);
}

}  // namespace gdr::test_support
