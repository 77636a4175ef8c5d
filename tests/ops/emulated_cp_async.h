// Host stand-ins for the cp.async helpers of kernels/cp_async.cuh, for the
// *_kernel_emulation_test binaries that run kernel code using them on the CPU: plain
// synchronous copies, so the wait is a no-op. Define GDR_CP_ASYNC_HOST_HELPERS (or a
// kernel's macro that implies it) before including the kernel header.
#pragma once

#include <cstring>

inline void cp_async_16(float* dst, const float* src) { std::memcpy(dst, src, 16); }
inline void cp_async_4(float* dst, const float* src) { *dst = *src; }
inline void cp_async_wait_all() {}
