// Warpgroup-level TF32 tensor-core products (Hopper wgmma, sm_90a) with both operands in
// shared memory: what the chunk GEMM (kernels/gdr_core/chunk_gemm_kernel.cuh) runs its 3xTF32
// products on where the architecture has them. mma.sync (kernels/common/mma_tf32.cuh) makes every
// warp load its fragments from shared memory with ordinary loads, which on the chunk GEMM
// keeps the L1/TEX pipe busy and the tensor pipe mostly idle (profiled: docs/benchmarks.md,
// Decisions); wgmma reads the operands itself, asynchronously, one instruction per
// 64 x 64 x 8 step of a 128-thread warpgroup.
// NOTE: keep this file free of includes and of CUDA APIs beyond __device__,
// __forceinline__ and the inline PTX under #if: with GDR_WGMMA_TF32_HOST_HELPERS defined
// the primitives (shared_address, fence_operands_for_wgmma, wgmma_fence, wgmma_commit,
// wgmma_wait, fence_accumulators, wgmma_m64n64k8_tf32) are not defined here and the
// CPU emulation test supplies host stand-ins (tests/ops/emulated_wgmma_tf32.h).
//
// Note [wgmma K-major operand layout]
// TF32 wgmma takes A (M x K) and B (K x N) from shared memory K-major only: A as rows of
// k, B as B^T (row n holds B[.][n]). A 64-row by 8-k operand of one k-step, in the
// canonical layout without swizzle, is 16 "core matrices" of 8 rows x 4 k (8 x 16 bytes,
// contiguous, row after row): core matrix (strip, kc) holds rows 8 strip .. + 7 and
// k = 4 kc .. + 3, and sits at ((2 strip + kc) * 32) words. The matrix descriptor gives
// the distance between the two core matrices along k (the leading byte offset, 128) and
// between strips (the stride byte offset, 256), so element (row, k) is word
// kmajor_word(row, k) below, and one k-step's operand is 512 words (2 KiB).
// The accumulator of m64nNk8 with FP32 accumulation is the mma.sync m16n8 layout repeated:
// warp w of the warpgroup (w = threadIdx.x / 32 % 4) holds rows 16 w + g and 16 w + g + 8
// (g = lane / 4) and, for each 8-column tile c, columns 8 c + 2 t and + 1 (t = lane % 4):
// register 4 c + 2 h + e is row 16 w + g + 8 h, column 8 c + 2 t + e.
// Ordering: the stores that fill an operand are generic-proxy writes and wgmma reads
// through the async proxy, so every writer runs fence_operands_for_wgmma before the
// barrier that precedes the wgmma; wgmma_fence orders the accumulator registers written
// by ordinary code before the first wgmma of a batch; the wgmmas of a batch run
// asynchronously until wgmma_commit + a wgmma_wait that covers their batch, and only then
// may the operands be overwritten (by any warp: a barrier after every warp's wait) or the
// accumulators read (fence_accumulators keeps the compiler from moving
// accumulator reads or writes across those points).
#pragma once

namespace gdr::kernels::wgmma_tf32 {

constexpr int kLeadingBytes = 128;  // between the two core matrices along k
constexpr int kStrideBytes = 256;   // between 8-row strips
constexpr int kOperandWords = 512;  // one 64 x 8 k-step operand

// Word of element (row, k) of a 64 x 8 K-major operand (Note [wgmma K-major operand
// layout]).
__device__ __forceinline__ constexpr int kmajor_word(int row, int k) {
  return ((row >> 3) * 2 + (k >> 2)) * 32 + (row & 7) * 4 + (k & 3);
}

// The matrix descriptor of a K-major operand without swizzle at shared-memory byte
// address `shared_addr` (16-byte aligned): bits 0-13 address / 16, 16-29 leading byte
// offset / 16, 32-45 stride byte offset / 16, base offset 0, swizzle mode 0.
__device__ __forceinline__ constexpr uint64_t kmajor_descriptor(uint32_t shared_addr) {
  return static_cast<uint64_t>((shared_addr >> 4) & 0x3fffu) |
         (static_cast<uint64_t>((kLeadingBytes >> 4) & 0x3fff) << 16) |
         (static_cast<uint64_t>((kStrideBytes >> 4) & 0x3fff) << 32);
}

#ifndef GDR_WGMMA_TF32_HOST_HELPERS
__device__ __forceinline__ uint32_t shared_address(const void* smem) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#else
  return 0;
#endif
}

// The path exists where the compiler targets sm_90a (arch-specific features).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GDR_WGMMA_TF32_ASM 1
#endif

__device__ __forceinline__ void fence_operands_for_wgmma() {
#ifdef GDR_WGMMA_TF32_ASM
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef GDR_WGMMA_TF32_ASM
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef GDR_WGMMA_TF32_ASM
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most `kPending` of this warp's committed batches are still running (the
// older ones are complete: their operands may be rewritten, their accumulators read).
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef GDR_WGMMA_TF32_ASM
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// An empty asm that "reads and writes" every accumulator register, so that the compiler
// keeps ordinary accesses to them on their side of the wgmma batch.
__device__ __forceinline__ void fence_accumulators(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d += A B for the warpgroup: A 64 x 8 and B 8 x 64 (as B^T), both K-major in shared
// memory (descriptors from kmajor_descriptor), FP32 accumulators in the layout of Note
// [wgmma K-major operand layout]. Asynchronous: see the Note's ordering rules.
__device__ __forceinline__ void wgmma_m64n64k8_tf32(float (&d)[32], uint64_t a, uint64_t b) {
#ifdef GDR_WGMMA_TF32_ASM
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b));
#endif
}
#endif  // GDR_WGMMA_TF32_HOST_HELPERS

}  // namespace gdr::kernels::wgmma_tf32
