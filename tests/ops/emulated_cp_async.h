// Host stand-ins for the cp.async helpers of kernels/common/cp_async.cuh, for the
// *_kernel_emulation_test binaries that run kernel code using them on the CPU. A copy is
// deferred until this thread's next cp_async_wait_all (each emulated CUDA thread keeps its
// own queue): the latest moment the hardware may complete it, so kernel code that reads a
// buffer before waiting for the copies into it (or that never waits) reads stale data here
// and fails its test. Define GDR_CP_ASYNC_HOST_HELPERS (or a kernel's macro that implies
// it) before including the kernel header.
#pragma once

#include <cstring>
#include <vector>

namespace emulated_cp_async {

struct Copy {
  float* dst;
  const float* src;
  int floats;
};

// This emulated CUDA thread's copies not yet waited for, oldest first.
inline std::vector<Copy>& pending() {
  thread_local std::vector<Copy> copies;
  return copies;
}

}  // namespace emulated_cp_async

inline void cp_async_16(float* dst, const float* src) {
  emulated_cp_async::pending().push_back({dst, src, 4});
}
inline void cp_async_4(float* dst, const float* src) {
  emulated_cp_async::pending().push_back({dst, src, 1});
}
inline void cp_async_wait_all() {
  for (const emulated_cp_async::Copy& c : emulated_cp_async::pending()) {
    std::memcpy(c.dst, c.src, sizeof(float) * c.floats);
  }
  emulated_cp_async::pending().clear();
}
