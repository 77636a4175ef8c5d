// The chunk prep kernels of the chunked gated delta rule (steps 1-6, forward and
// backward): __global__ wrappers around the bodies in kernels/gdr_core/chunk_prep_kernel.cuh
// (see Note [Chunk prep determinism] there) and their launchers; the contract is in
// kernels/gdr_core/chunk_prep.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/gdr_core/chunk_prep.h"
#include "kernels/gdr_core/chunk_prep_kernel.cuh"

namespace gdr::kernels {
namespace chunk_prep_detail {

std::atomic<bool> g_last_used_tensor_cores{false};

// Records the variant of a successful launch (chunk_prep_last_used_tensor_cores).
int record(int error, bool tensor_cores) {
  if (error == static_cast<int>(cudaSuccess)) {
    g_last_used_tensor_cores.store(tensor_cores, std::memory_order_relaxed);
  }
  return error;
}

// ----------------------------------------------------------------------------
// CUDA kernels

// Two blocks per SM (83 KiB of shared memory each at dk = 128), or one of 512 threads
// (chunk_prep_forward_threads): at most 128 registers either way.
template <typename TQK, typename TV, int Threads>
__global__ void __launch_bounds__(Threads, 2 * kForwardThreads / Threads)
    chunk_prep_forward_kernel(const ChunkPrepForwardArgs args) {
  extern __shared__ float smem[];
  chunk_prep_forward_block<TQK, TV, Threads>(args, smem);
}

// One block per SM (up to 227 KiB of shared memory): 16 warps, so at most 128 registers.
// TC: the tensor-core variant (Note [Chunk prep on tensor cores]).
template <typename TQK, typename TV, int DK, bool TC>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    chunk_prep_backward_kernel(const ChunkPrepBackwardArgs args) {
  extern __shared__ float smem[];
  chunk_prep_backward_grid<TQK, TV, DK, TC>(args, smem);
}

// ----------------------------------------------------------------------------
// kernel launcher

// One block per (batch, head, chunk): B=1, T=2048, H=16 gives 512 blocks (the wide-head
// backward: args.scratch_slots blocks, see below). The matrices of
// a chunk (K, Q, the C x C products, the [U | W] panel) live in dynamic shared memory
// (forward ~83 KiB, backward ~207 KiB at dk = dv = 128), above the 48 KiB default, so
// each launch raises the kernel's limit first, and asks for the largest shared-memory
// carveout so that two forward blocks share an SM. Threads: the kernel's block size.
// The wide-head backward (Note [Chunk prep wide-head backward]) runs args.scratch_slots
// blocks instead, each walking the chunks.
template <int Threads, typename Kernel, typename Args>
int launch(Kernel kernel, const Args& args, int64_t smem_floats, CUstream_st* stream,
           int64_t grid_blocks = 0) {
  const int64_t chunks = args.shape.batch * args.shape.heads * args.shape.chunks;
  if (chunks <= 0) return static_cast<int>(cudaSuccess);
  // Chunk indices are 32-bit in the kernels (a block's index, or the wide-head walk's).
  if (chunks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const int64_t blocks = grid_blocks > 0 ? std::min(grid_blocks, chunks) : chunks;
  const int bytes = static_cast<int>(smem_floats * sizeof(float));
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (error != cudaSuccess) return static_cast<int>(error);
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (error != cudaSuccess) return static_cast<int>(error);
  kernel<<<static_cast<unsigned int>(blocks), Threads, bytes, stream>>>(args);
  return static_cast<int>(cudaGetLastError());
}

// The launch arguments the kernels cannot handle, refused without launching.
bool valid_shape(const ChunkPrepShape& s) {
  return chunk_prep_supports(s.dk, s.dv) && chunk_prep_supports_inputs(s.qk_input, s.v_input) &&
         s.head_group >= 1 && s.heads % s.head_group == 0;
}

template <int Threads>
int launch_forward(const ChunkPrepForwardArgs& args, int64_t floats, CUstream_st* stream) {
  const ChunkPrepShape& s = args.shape;
  if (s.qk_input == ChunkPrepInput::kFloat) {
    return launch<Threads>(chunk_prep_forward_kernel<float, float, Threads>, args, floats, stream);
  }
  if (s.v_input == ChunkPrepInput::kFloat) {
    return launch<Threads>(chunk_prep_forward_kernel<Bf16, float, Threads>, args, floats, stream);
  }
  return launch<Threads>(chunk_prep_forward_kernel<Bf16, Bf16, Threads>, args, floats, stream);
}

template <int DK, bool TC>
int launch_backward_dk(const ChunkPrepBackwardArgs& args, int64_t floats, CUstream_st* stream) {
  const ChunkPrepShape& s = args.shape;
  const int64_t grid = chunk_prep_backward_uses_scratch(DK) ? args.scratch_slots : 0;
  if (s.qk_input == ChunkPrepInput::kFloat) {
    return launch<kBackwardThreads>(chunk_prep_backward_kernel<float, float, DK, TC>, args, floats,
                                    stream, grid);
  }
  if (s.v_input == ChunkPrepInput::kFloat) {
    return launch<kBackwardThreads>(chunk_prep_backward_kernel<Bf16, float, DK, TC>, args, floats,
                                    stream, grid);
  }
  return launch<kBackwardThreads>(chunk_prep_backward_kernel<Bf16, Bf16, DK, TC>, args, floats,
                                  stream, grid);
}

}  // namespace chunk_prep_detail

int launch_chunk_prep_forward(const ChunkPrepForwardArgs& args, CUstream_st* stream) {
  using namespace chunk_prep_detail;
  const ChunkPrepShape& s = args.shape;
  if (!valid_shape(s)) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t floats = chunk_prep_forward_smem_floats(s.dk, s.dv);
  // FP32 SIMT in every variant (Note [Chunk prep on tensor cores]).
  if (chunk_prep_forward_threads(s.dk, s.dv) == kChunkPrepWideForwardThreads) {
    return record(launch_forward<kChunkPrepWideForwardThreads>(args, floats, stream), false);
  }
  return record(launch_forward<kForwardThreads>(args, floats, stream), false);
}

int launch_chunk_prep_backward(const ChunkPrepBackwardArgs& args, CUstream_st* stream) {
  using namespace chunk_prep_detail;
  const ChunkPrepShape& s = args.shape;
  if (!valid_shape(s)) return static_cast<int>(cudaErrorInvalidValue);
  if (chunk_prep_backward_uses_scratch(s.dk) &&
      (args.scratch == nullptr || args.scratch_slots < 1 || args.scratch_slots > 0x7fffffffLL ||
       reinterpret_cast<uintptr_t>(args.scratch) % 16 != 0)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t floats = chunk_prep_backward_smem_floats(s.dk, s.dv);
  const bool tc = chunk_prep_uses_tensor_cores(s.dk, s.dv, s.allow_tensor_cores);
  switch (s.dk) {
    case 64:
      return record(tc ? launch_backward_dk<64, true>(args, floats, stream)
                       : launch_backward_dk<64, false>(args, floats, stream),
                    tc);
    case 128:
      return record(tc ? launch_backward_dk<128, true>(args, floats, stream)
                       : launch_backward_dk<128, false>(args, floats, stream),
                    tc);
    case 256:  // SIMT only (chunk_prep_uses_tensor_cores)
      return record(launch_backward_dk<256, false>(args, floats, stream), false);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

bool chunk_prep_last_used_tensor_cores() {
  return chunk_prep_detail::g_last_used_tensor_cores.load(std::memory_order_relaxed);
}

}  // namespace gdr::kernels
