// CUDA kernels of kernels/gdr_core/chunk_layout.h: the GDR core's chunk layout <-> token layout.
// One thread per 8 consecutive dv elements; the grid walks the destination in its own
// order so the stores are coalesced, and each warp's loads are whole 32-byte sectors
// (a dv row is at least 8 elements long and rows are contiguous in both layouts).
// Bandwidth roofline: 12 bytes per element for BF16 / FP16 (FP32 one side, 16-bit the
// other), 16 for FP32, against the HBM bandwidth (achieved: docs/benchmarks.md, Other
// kernels in the 0.8B step).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/storage_element.cuh"
#include "kernels/gdr_core/chunk_layout.h"

namespace gdr::kernels {
namespace {

// dv elements per thread: one 16-byte access for the 16-bit types, two for FP32
// (load_floats / store_floats of kernels/common/storage_element.cuh).
constexpr int kVec = 8;
constexpr int kThreads = 256;

// The thread's vector of 8 dv elements in a row-major walk of a [rows, dv] destination:
// the destination row and the first column. Index: int32_t when every element offset
// fits (the 64-bit divisions cost more than the copy at the 0.8B shapes), else int64_t.
template <typename Index>
struct ThreadVector {
  Index heads, tokens, chunk_rows, dv;
  Index row, column;
  bool active;
  __device__ ThreadVector(const ChunkLayoutShape& shape, Index vectors)
      : heads(static_cast<Index>(shape.heads)),
        tokens(static_cast<Index>(shape.tokens)),
        chunk_rows(static_cast<Index>(shape.chunk_rows)),
        dv(static_cast<Index>(shape.dv)) {
    const Index i = static_cast<Index>(blockIdx.x) * kThreads + static_cast<Index>(threadIdx.x);
    const Index per_row = dv / kVec;
    active = i < vectors;
    row = i / per_row;
    column = (i % per_row) * kVec;
  }
};

// Destination order: (b, t, h, vector).
template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    chunks_to_tokens_kernel(const ChunkLayoutShape shape, const float* __restrict__ chunks,
                            T* __restrict__ tokens, Index vectors) {
  const ThreadVector<Index> x(shape, vectors);
  if (!x.active) return;
  const Index h = x.row % x.heads;  // x.row = (b * T + t) * H + h
  const Index bt = x.row / x.heads;
  const Index t = bt % x.tokens;
  const Index b = bt / x.tokens;
  float v[kVec];
  load_floats<float, kVec>(chunks + ((b * x.heads + h) * x.chunk_rows + t) * x.dv + x.column, v);
  store_floats<T, kVec>(tokens + x.row * x.dv + x.column, v);
}

// Destination order: (b, h, r, vector); padding rows get zeros.
template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    tokens_to_chunks_kernel(const ChunkLayoutShape shape, const T* __restrict__ tokens,
                            float* __restrict__ chunks, Index vectors) {
  const ThreadVector<Index> x(shape, vectors);
  if (!x.active) return;
  const Index r = x.row % x.chunk_rows;  // x.row = (b * H + h) * chunk_rows + r
  const Index bh = x.row / x.chunk_rows;
  const Index h = bh % x.heads;
  const Index b = bh / x.heads;
  float v[kVec];
  if (r < x.tokens) {
    load_floats<T, kVec>(tokens + ((b * x.tokens + r) * x.heads + h) * x.dv + x.column, v);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = 0.0f;
  }
  store_floats<float, kVec>(chunks + x.row * x.dv + x.column, v);
}

// Calls fn(T{}, Index{}) for the storage type and the narrowest index that holds every
// element offset of the chunk buffer (the larger of the two).
template <typename Fn>
int dispatch(LayoutDtype dtype, const ChunkLayoutShape& shape, Fn&& fn) {
  const bool narrow = shape.batch * shape.heads * shape.chunk_rows * shape.dv < (int64_t{1} << 31);
  auto with_index = [&](auto zero) {
    if (narrow) {
      fn(zero, int32_t{});
    } else {
      fn(zero, int64_t{});
    }
  };
  switch (dtype) {
    case LayoutDtype::kFloat32: with_index(float{}); return cudaSuccess;
    case LayoutDtype::kFloat16: with_index(__half{}); return cudaSuccess;
    case LayoutDtype::kBFloat16: with_index(__nv_bfloat16{}); return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

unsigned int blocks_for(int64_t vectors) {
  return static_cast<unsigned int>((vectors + kThreads - 1) / kThreads);
}

}  // namespace

bool chunk_layout_supports(const ChunkLayoutShape& s, const void* chunks, const void* tokens) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return s.batch > 0 && s.heads > 0 && s.tokens > 0 && s.dv > 0 && s.dv % kVec == 0 &&
         s.chunk_rows >= s.tokens && chunks != nullptr && tokens != nullptr && aligned(chunks) &&
         aligned(tokens) &&
         s.batch * s.heads * s.chunk_rows * (s.dv / kVec) < (int64_t{1} << 31) * kThreads;
}

int launch_chunks_to_tokens(const ChunkLayoutShape& shape, const float* chunks, void* tokens,
                            LayoutDtype dtype, CUstream_st* stream) {
  if (!chunk_layout_supports(shape, chunks, tokens)) return cudaErrorInvalidValue;
  const int64_t vectors = shape.batch * shape.tokens * shape.heads * (shape.dv / kVec);
  const int status = dispatch(dtype, shape, [&](auto zero, auto index) {
    using T = decltype(zero);
    using Index = decltype(index);
    chunks_to_tokens_kernel<T, Index><<<blocks_for(vectors), kThreads, 0, stream>>>(
        shape, chunks, static_cast<T*>(tokens), static_cast<Index>(vectors));
  });
  return status != cudaSuccess ? status : static_cast<int>(cudaGetLastError());
}

int launch_tokens_to_chunks(const ChunkLayoutShape& shape, const void* tokens, LayoutDtype dtype,
                            float* chunks, CUstream_st* stream) {
  if (!chunk_layout_supports(shape, chunks, tokens)) return cudaErrorInvalidValue;
  const int64_t vectors = shape.batch * shape.heads * shape.chunk_rows * (shape.dv / kVec);
  const int status = dispatch(dtype, shape, [&](auto zero, auto index) {
    using T = decltype(zero);
    using Index = decltype(index);
    tokens_to_chunks_kernel<T, Index><<<blocks_for(vectors), kThreads, 0, stream>>>(
        shape, static_cast<const T*>(tokens), chunks, static_cast<Index>(vectors));
  });
  return status != cudaSuccess ? status : static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
