// CUDA kernel of the tied embedding's weight-gradient rows
// (kernels/tied_embedding/embedding_rows.h): dW[id] = round(float(dW[id]) + sum of the id's token
// rows in token order), in place. The block's body and the launch rule live in
// kernels/tied_embedding/embedding_rows_kernel.cuh (also run on the CPU by
// //tests/ops:embedding_rows_kernel_emulation_test); this file holds the
// __global__ wrapper with its shared memory and the launcher.
//
// Note [Embedding rows without atomics]: ATen's embedding backward sorts the ids, sums
// segments into a zero-filled dense [V, H] gradient, and the tied LM head's dW is then
// added to it (a 508 MB fill, a scatter and a [V, H] add for 2048 rows of 1024 per
// microbatch on the 0.8B model). Here the LM head's dW is the destination and only the
// touched rows are read and written. One block per (token t, column tile):
//   1. the block scans ids[0, t) (coalesced, L2-resident: N <= 8192 ids are 64 KiB) and
//      exits if an earlier token has t's id, so exactly one block (the first occurrence's)
//      owns each distinct row: no atomics, no races, nothing depends on scheduling;
//   2. the owner starts its FP32 sums from its own row and walks ids(t, N) in chunks of
//      blockDim.x; each chunk's matches are compacted in token order into shared memory
//      (warp ballots, warps in order) and every thread adds those rows' elements of its
//      column vector in that order;
//   3. one read-modify-write of dW[id]'s columns: one rounding.
// So the bits are a pure function of (ids, rows, dW), the same as the CPU reference in
// ops/tied_embedding/tied_embedding_op.cc. The scans cost O(N^2) id compares in all: for N = 2048,
// 4 M compares and up to 32 MB of L2-resident id reads next to ~12 MB of row traffic (d_hidden and
// the touched dW rows); 16x that for N = 8192. The op's timings: docs/benchmarks.md, Tied
// embedding gradient; if the scans show up there, stage the ids as int32 in shared memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/storage_element.cuh"
#include "kernels/tied_embedding/embedding_rows.h"
#include "kernels/tied_embedding/embedding_rows_kernel.cuh"

namespace gdr::kernels {
namespace {

using embedding_rows_detail::kMaxThreads;
using embedding_rows_detail::kWarp;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) add_token_rows_kernel(const EmbeddingRowsArgs args) {
  __shared__ int later[kMaxThreads];  // this chunk's tokens with the id, offsets from base
  __shared__ int warp_counts[kMaxThreads / kWarp];
  embedding_rows_detail::add_token_rows_block<T, VEC>(args, later, warp_counts);
}

// ---------------------------------------------------------------------------
// kernel launcher

template <typename T>
int launch_typed(const EmbeddingRowsArgs& args, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const embedding_rows_detail::LaunchShape shape = embedding_rows_detail::launch_shape(args, kVec);
  if (shape.tiles > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned>(args.tokens), static_cast<unsigned>(shape.tiles));
  const unsigned threads = static_cast<unsigned>(shape.threads);
  if (shape.vectorised) {
    add_token_rows_kernel<T, kVec><<<grid, threads, 0, stream>>>(args);
  } else {
    add_token_rows_kernel<T, 1><<<grid, threads, 0, stream>>>(args);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_add_token_rows(const EmbeddingRowsArgs& args, CUstream_st* stream) {
  if (args.tokens == 0 || args.hidden == 0) return static_cast<int>(cudaSuccess);
  if (args.tokens > 0x7fffffff) return static_cast<int>(cudaErrorInvalidConfiguration);
  switch (args.dtype) {
    case EmbeddingRowsDtype::kFloat32: return launch_typed<float>(args, stream);
    case EmbeddingRowsDtype::kFloat16: return launch_typed<__half>(args, stream);
    case EmbeddingRowsDtype::kBFloat16: return launch_typed<__nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace gdr::kernels
