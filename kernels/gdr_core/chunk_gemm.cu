// The batched 3xTF32 tensor-core GEMM of the chunk state pass: the __global__ wrapper
// around the block body in kernels/gdr_core/chunk_gemm_kernel.cuh (Note [Chunk GEMM tiling])
// and its launcher; the contract, Note [Chunk GEMM determinism] and the roofline are in
// kernels/gdr_core/chunk_gemm.h.
#include <cuda_runtime.h>

#include <atomic>

#include "kernels/gdr_core/chunk_gemm.h"
#include "kernels/gdr_core/chunk_gemm_kernel.cuh"

namespace gdr::kernels {
namespace chunk_gemm_detail {
namespace {

std::atomic<int64_t> g_launches{0};

// ----------------------------------------------------------------------------
// CUDA kernels

// Three blocks per SM (68 KiB of shared memory each): at most 168 registers. W: wgmma
// where this pass has it (kWgmmaPass, sm_90a), mma.sync otherwise.
template <bool TA, bool TB, bool W>
__global__ void __launch_bounds__(kThreads, 3) chunk_gemm_kernel(const ChunkGemmArgs args) {
  extern __shared__ __align__(16) float chunk_gemm_smem[];
  chunk_gemm_block<TA, TB, W && kWgmmaPass>(args, chunk_gemm_smem);
}

// Grants the kernel its dynamic shared memory (above the 48 KiB default) and the largest
// shared-memory carveout (three blocks per SM), once per device: cudaFuncSetAttribute is
// per device and not a stream operation, so this is also safe while a stream is being
// captured. Returns the error of a refusal (then every launch on that device fails).
template <bool TA, bool TB, bool W>
cudaError_t prepare_kernel() {
  constexpr int kMaxDevices = 64;
  // 0: not tried yet; else 1 + the outcome (a cudaError_t).
  static std::atomic<int> state[kMaxDevices];
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int s = state[device].load(std::memory_order_acquire);
  if (s == 0) {
    error =
        cudaFuncSetAttribute(chunk_gemm_kernel<TA, TB, W>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, kChunkGemmSharedBytes);
    if (error == cudaSuccess) {
      error = cudaFuncSetAttribute(chunk_gemm_kernel<TA, TB, W>,
                                   cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared);
    }
    if (error != cudaSuccess) cudaGetLastError();  // not sticky: clear it
    s = 1 + static_cast<int>(error);
    state[device].store(s, std::memory_order_release);
  }
  return static_cast<cudaError_t>(s - 1);
}

template <bool TA, bool TB, bool W>
int launch(const ChunkGemmArgs& args, int64_t blocks, CUstream_st* stream) {
  const cudaError_t prepared = prepare_kernel<TA, TB, W>();
  if (prepared != cudaSuccess) return static_cast<int>(prepared);
  chunk_gemm_kernel<TA, TB, W>
      <<<static_cast<unsigned int>(blocks), kThreads, kChunkGemmSharedBytes, stream>>>(args);
  return static_cast<int>(cudaGetLastError());
}

template <bool TA, bool TB>
int launch(const ChunkGemmArgs& args, int64_t blocks, CUstream_st* stream) {
  return args.allow_wgmma ? launch<TA, TB, true>(args, blocks, stream)
                          : launch<TA, TB, false>(args, blocks, stream);
}

}  // namespace
}  // namespace chunk_gemm_detail

// ----------------------------------------------------------------------------
// kernel launcher

int launch_chunk_gemm(const ChunkGemmArgs& args, CUstream_st* stream) {
  using namespace chunk_gemm_detail;
  if (!chunk_gemm_supports(args) || args.c == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  for (int p = 0; p < args.products; ++p) {
    if (args.product[p].a.data == nullptr || args.product[p].b.data == nullptr) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  // One block per (z, 64 x 64 tile of C): at T = 16384, H = 16 (4096 chunks) and
  // dk = dv = 128, 8192 blocks for the [64 x 128] products, ~20 waves of 396 resident
  // blocks (3 per SM on 132 SMs).
  const int64_t blocks = chunk_gemm_blocks(args);
  if (blocks == 0) return static_cast<int>(cudaSuccess);
  int error = 0;
  if (args.transpose_a) {
    error = args.transpose_b ? launch<true, true>(args, blocks, stream)
                             : launch<true, false>(args, blocks, stream);
  } else {
    error = args.transpose_b ? launch<false, true>(args, blocks, stream)
                             : launch<false, false>(args, blocks, stream);
  }
  if (error == static_cast<int>(cudaSuccess)) g_launches.fetch_add(1, std::memory_order_relaxed);
  return error;
}

int64_t chunk_gemm_launch_count() {
  return chunk_gemm_detail::g_launches.load(std::memory_order_relaxed);
}

}  // namespace gdr::kernels
