// The body of the tied embedding's rows kernel (kernels/tied_embedding/embedding_rows.h, Note
// [Embedding rows without atomics] in kernels/tied_embedding/embedding_rows.cu), shared by the CUDA
// kernel and its CPU emulation test (tests/ops/embedding_rows_kernel_emulation_test.cc). NOTE:
// plain C++ apart from the CUDA built-ins __syncthreads, __syncthreads_or,
// __ballot_sync, __popc, threadIdx / blockIdx / blockDim and the __device__ /
// __forceinline__ qualifiers; the emulation test defines host stand-ins for exactly these,
// so keep the two in sync when the body starts using another.
#pragma once

#include <cstdint>

#include "kernels/common/storage_element.cuh"
#include "kernels/tied_embedding/embedding_rows.h"

namespace gdr::kernels::embedding_rows_detail {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;
constexpr int kInFlight = 4;  // rows loaded before they are added (in order)

// The launch (host side, shared with the emulation test): 16-byte vectors of VEC elements
// when every row starts 16-byte aligned (hidden % VEC == 0, aligned bases), else single
// elements; threads a warp multiple (the ballots) covering the row's vectors, at most
// kMaxThreads; wider rows take several column tiles (grid.y).
struct LaunchShape {
  bool vectorised = false;
  int64_t threads = 0, tiles = 0;
};

inline LaunchShape launch_shape(const EmbeddingRowsArgs& args, int vec) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  LaunchShape shape;
  shape.vectorised = args.hidden % vec == 0 && aligned16(args.rows) && aligned16(args.dw);
  const int64_t vectors = shape.vectorised ? args.hidden / vec : args.hidden;
  const int64_t warps = (vectors + kWarp - 1) / kWarp;  // >= 1: the launcher skips hidden 0
  shape.threads = warps * kWarp < kMaxThreads ? warps * kWarp : kMaxThreads;
  shape.tiles = (vectors + shape.threads - 1) / shape.threads;
  return shape;
}

// One block's work: block (blockIdx.x = token t, blockIdx.y = column tile), blockDim.x a
// multiple of 32 and at most kMaxThreads. `later` (kMaxThreads ints) and `warp_counts`
// (kMaxThreads / 32 ints) are the block's shared memory.
template <typename T, int VEC>
__device__ __forceinline__ void add_token_rows_block(const EmbeddingRowsArgs& args, int* later,
                                                     int* warp_counts) {
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

}  // namespace gdr::kernels::embedding_rows_detail
