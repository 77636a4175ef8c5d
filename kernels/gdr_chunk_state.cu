// The chunk state scan of the chunked gated delta rule (forward state pass and backward
// state-gradient pass): the launcher. The kernel is in kernels/gdr_chunk_state_kernel.cuh
// (see Note [Chunk state scan determinism] there); the contract in kernels/gdr_chunk_state.h.
#include <cuda_runtime.h>

#include "kernels/gdr_chunk_state.h"
#include "kernels/gdr_chunk_state_kernel.cuh"

namespace gdr::kernels {

// ----------------------------------------------------------------------------
// kernel launcher

int launch_chunk_state_scan(const ChunkStateScanArgs& args, CUstream_st* stream) {
  if (!chunk_state_scan_supports(args.dk, args.dv) || args.batch_heads <= 0 || args.chunks < 0 ||
      args.g_last == nullptr || (args.dot_with == nullptr) != (args.dot_out == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  // One block per (batch*head, dv tile): B=1, H=16, dv=128 gives 128 blocks, about one
  // per SM of an H200; the chunk walk inside a block is the sequential part.
  const int64_t blocks = args.batch_heads * (args.dv / kChunkStateTileDv);
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned int>(blocks));
  switch (args.dk) {
    case 64:
      chunk_state_detail::chunk_state_scan_kernel<64>
          <<<grid, kChunkStateThreads, 0, stream>>>(args);
      break;
    case 128:
      chunk_state_detail::chunk_state_scan_kernel<128>
          <<<grid, kChunkStateThreads, 0, stream>>>(args);
      break;
    case 256:
      chunk_state_detail::chunk_state_scan_kernel<256>
          <<<grid, kChunkStateThreads, 0, stream>>>(args);
      break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
