// Asynchronous global -> shared copies (sm_80+ cp.async: no registers involved) for the
// kernels that stream operands through shared memory while they compute: the tensor-core
// chunk state scan (kernels/gdr_core/chunk_state_tc_kernel.cuh) and the chunk GEMM
// (kernels/gdr_core/chunk_gemm_kernel.cuh). Device code only.
// NOTE: the CPU emulation tests compile their includers as host code: with
// GDR_CP_ASYNC_HOST_HELPERS defined nothing is defined here, and the test's host
// stand-ins (synchronous copies, a no-op wait) are found by unqualified lookup.
#pragma once

namespace gdr::kernels {

#ifndef GDR_CP_ASYNC_HOST_HELPERS
// 16 bytes (both addresses 16-byte aligned) or 4 bytes; cp_async_wait_all waits for all of
// this thread's copies, and a __syncthreads after it makes them visible to the block.
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
#endif  // GDR_CP_ASYNC_HOST_HELPERS

}  // namespace gdr::kernels
