// CUDA kernel of the tied embedding's weight-gradient rows (kernels/embedding_rows.h):
// dW[id] = round(float(dW[id]) + sum of the id's token rows in token order), in place.
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
// ops/tied_embedding.cc. The scans cost O(N^2) id compares in all (4 M for N = 2048,
// read from L2), small next to the rows' HBM traffic at the sizes the model runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/embedding_rows.h"
#include "kernels/storage_element.cuh"

namespace gdr::kernels {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;
constexpr int kInFlight = 4;  // rows loaded before they are added (in order)

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) add_token_rows_kernel(const EmbeddingRowsArgs args) {
  __shared__ int later[kMaxThreads];  // this chunk's tokens with the id, offsets from base
  __shared__ int warp_counts[kMaxThreads / kWarp];
  const int64_t tokens = args.tokens;
  const int64_t hidden = args.hidden;
  const int64_t t = blockIdx.x;
  const int64_t id = args.ids[t];
  if (id < 0 || id >= args.vocab) return;  // uniform over the block

  // 1. An earlier token with the same id owns the row.
  for (int64_t base = 0; base < t; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const bool same = j < t && args.ids[j] == id;
    if (__syncthreads_or(same)) return;
  }

  // 2. This block owns dW[id]'s columns of its tile: sums in token order.
  const T* rows = static_cast<const T*>(args.rows);
  const int64_t vectors = hidden / VEC;
  const int64_t v = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const bool active = v < vectors;
  const int64_t column = v * VEC;
  float acc[VEC];
  if (active) load_floats<T, VEC>(rows + t * hidden + column, acc);

  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  for (int64_t base = t + 1; base < tokens; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const bool same = j < tokens && args.ids[j] == id;
    const unsigned mask = __ballot_sync(0xffffffffu, same);
    if (lane == 0) warp_counts[warp] = __popc(mask);
    __syncthreads();
    int offset = 0, total = 0;
    for (int w = 0; w < warps; ++w) {
      const int count = warp_counts[w];
      offset += w < warp ? count : 0;
      total += count;
    }
    if (same) later[offset + __popc(mask & ((1u << lane) - 1u))] = static_cast<int>(threadIdx.x);
    __syncthreads();
    if (active) {
      int k = 0;
      for (; k + kInFlight <= total; k += kInFlight) {
        Pack<T, VEC> packs[kInFlight];
#pragma unroll
        for (int r = 0; r < kInFlight; ++r) {
          packs[r] = load_pack<T, VEC>(rows + (base + later[k + r]) * hidden + column);
        }
#pragma unroll
        for (int r = 0; r < kInFlight; ++r) {
          float x[VEC];
          unpack<T, VEC>(packs[r], x);
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += x[e];
        }
      }
      for (; k < total; ++k) {
        float x[VEC];
        load_floats<T, VEC>(rows + (base + later[k]) * hidden + column, x);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += x[e];
      }
    }
    __syncthreads();  // the next chunk overwrites later / warp_counts
  }

  // 3. One rounding.
  if (!active) return;
  T* dst = static_cast<T*>(args.dw) + id * hidden + column;
  float current[VEC];
  load_floats<T, VEC>(dst, current);
#pragma unroll
  for (int e = 0; e < VEC; ++e) current[e] += acc[e];
  store_floats<T, VEC>(dst, current);
}

// ---------------------------------------------------------------------------
// kernel launcher

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
int launch_typed(const EmbeddingRowsArgs& args, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  // 16-byte vectors when every row starts 16-byte aligned, else elements.
  const bool vectorised = args.hidden % kVec == 0 && aligned16(args.rows) && aligned16(args.dw);
  const int64_t vectors = vectorised ? args.hidden / kVec : args.hidden;
  // A warp multiple (the ballots), at most kMaxThreads; wide rows take several tiles.
  const int64_t threads = std::min<int64_t>(
      kMaxThreads, std::max<int64_t>(kWarp, (vectors + kWarp - 1) / kWarp * kWarp));
  const int64_t tiles = (vectors + threads - 1) / threads;
  if (tiles > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned>(args.tokens), static_cast<unsigned>(tiles));
  if (vectorised) {
    add_token_rows_kernel<T, kVec><<<grid, static_cast<unsigned>(threads), 0, stream>>>(args);
  } else {
    add_token_rows_kernel<T, 1><<<grid, static_cast<unsigned>(threads), 0, stream>>>(args);
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
