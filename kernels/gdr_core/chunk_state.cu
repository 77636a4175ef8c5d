// The chunk state scan of the chunked gated delta rule (forward state pass and backward
// state-gradient pass): the launcher. The kernels are in kernels/gdr_core/chunk_state_kernel.cuh
// (FP32 SIMT; Note [Chunk state scan determinism]) and kernels/gdr_core/chunk_state_tc_kernel.cuh
// (tensor cores, 3xTF32; Note [Chunk state scan on tensor cores (3xTF32)]); the contract
// and the choice between them in kernels/gdr_core/chunk_state.h.
#include <cuda_runtime.h>

#include <atomic>

#include "kernels/gdr_core/chunk_state.h"
#include "kernels/gdr_core/chunk_state_kernel.cuh"
#include "kernels/gdr_core/chunk_state_tc_kernel.cuh"

namespace gdr::kernels {
namespace {

std::atomic<bool> g_last_used_tensor_cores{false};

// Grants the tensor-core kernel for DK its dynamic shared memory on the current device,
// once per device (cudaFuncSetAttribute is per device and not a stream operation, so it is
// also safe while a stream is being captured). False when the device refuses.
template <int DK>
bool prepare_tc_kernel() {
  constexpr int kMaxDevices = 64;
  // 0: not tried, 1: granted, 2: refused.
  static std::atomic<int> state[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return false;
  }
  int s = state[device].load(std::memory_order_acquire);
  if (s == 0) {
    const cudaError_t error = cudaFuncSetAttribute(
        chunk_state_tc_detail::chunk_state_scan_tc_kernel<DK>,
        cudaFuncAttributeMaxDynamicSharedMemorySize, chunk_state_tc_detail::TcLayout<DK>::kBytes);
    if (error != cudaSuccess) cudaGetLastError();  // clear it: the SIMT kernel runs instead
    s = error == cudaSuccess ? 1 : 2;
    state[device].store(s, std::memory_order_release);
  }
  return s == 1;
}

template <int DK>
void launch(const ChunkStateScanArgs& args, const dim3 grid, bool tensor_cores,
            CUstream_st* stream) {
  if (tensor_cores) {
    chunk_state_tc_detail::chunk_state_scan_tc_kernel<DK>
        <<<grid, kChunkStateThreads, chunk_state_tc_detail::TcLayout<DK>::kBytes, stream>>>(args);
  } else {
    chunk_state_detail::chunk_state_scan_kernel<DK><<<grid, kChunkStateThreads, 0, stream>>>(args);
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launcher

int launch_chunk_state_scan(const ChunkStateScanArgs& args, CUstream_st* stream) {
  if (!chunk_state_scan_supports(args.dk, args.dv) || args.batch_heads <= 0 || args.chunks < 0 ||
      args.g_last == nullptr || (args.dot_with == nullptr) != (args.dot_out == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  // One block per (batch*head, dv tile) for both kernels: B=1, H=16, dv=128 gives 128
  // blocks, about one per SM of a 132-SM GPU; the chunk walk inside a block is the
  // sequential part.
  const int64_t blocks = args.batch_heads * (args.dv / kChunkStateTileDv);
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned int>(blocks));
  bool tensor_cores = chunk_state_scan_uses_tensor_cores(args.dk, args.dv, args.allow_tensor_cores);
  switch (args.dk) {
    case 64:
      tensor_cores = tensor_cores && prepare_tc_kernel<64>();
      launch<64>(args, grid, tensor_cores, stream);
      break;
    case 128:
      tensor_cores = tensor_cores && prepare_tc_kernel<128>();
      launch<128>(args, grid, tensor_cores, stream);
      break;
    case 256:
      tensor_cores = tensor_cores && prepare_tc_kernel<256>();
      launch<256>(args, grid, tensor_cores, stream);
      break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) g_last_used_tensor_cores.store(tensor_cores, std::memory_order_relaxed);
  return static_cast<int>(error);
}

bool chunk_state_scan_last_used_tensor_cores() {
  return g_last_used_tensor_cores.load(std::memory_order_relaxed);
}

}  // namespace gdr::kernels
