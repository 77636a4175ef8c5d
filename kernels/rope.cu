// CUDA kernels of the fused partial rotary embedding (kernels/rope.h): a block per row,
// a thread per element, FP32 math with explicitly rounded products and sums (Note
// [Rope rounding]). Memory-bound (one read and one write of the tensor each way); the
// roofline is HBM bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/rope.h"
#include "kernels/storage_element.cuh"

namespace gdr::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 16384;  // rows per launch before grid-striding

template <typename T>
__device__ __forceinline__ float load_as_float(const T* p) {
  return StorageElement<T>::to_float(*p);
}

// One block per row (token of one head) at a time, grid-striding over rows; the threads
// stride over the head dim (one element each at head_dim 256, the model's).
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeArgs args) {
  const int64_t rows = args.batch * args.heads * args.tokens;
  const int half = args.rotary / 2;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = row % args.tokens;
    const int64_t bh = row / args.tokens;
    const int64_t h = bh % args.heads, b = bh / args.heads;
    const T* in = static_cast<const T*>(args.in.data) + b * args.in.stride_b +
                  h * args.in.stride_h + t * args.in.stride_t;
    T* out = static_cast<T*>(args.out.data) + b * args.out.stride_b + h * args.out.stride_h +
             t * args.out.stride_t;
    const float* cos_row = args.cos + t * args.rotary;
    const float* sin_row = args.sin + t * args.rotary;
    for (int e = threadIdx.x; e < args.head_dim; e += kThreads) {
      if (e >= args.rotary) {
        out[e] = in[e];
        continue;
      }
      float value;
      if constexpr (!kBackward) {
        // x cos + rh sin, rh[e] = -x[e + h] (e < h) or x[e - h].
        const float rotated =
            e < half ? -load_as_float(in + e + half) : load_as_float(in + e - half);
        value =
            __fadd_rn(__fmul_rn(load_as_float(in + e), cos_row[e]), __fmul_rn(rotated, sin_row[e]));
      } else {
        // g cos plus the rotated half's gradient: g[e + h] sin[e + h] (e < h) or
        // -(g[e - h] sin[e - h]).
        const float other = e < half ? __fmul_rn(load_as_float(in + e + half), sin_row[e + half])
                                     : -__fmul_rn(load_as_float(in + e - half), sin_row[e - half]);
        value = __fadd_rn(__fmul_rn(load_as_float(in + e), cos_row[e]), other);
      }
      out[e] = StorageElement<T>::from_float(value);
    }
  }
}

template <bool kBackward>
int launch(const RopeArgs& args, CUstream_st* stream) {
  const int64_t total = args.batch * args.heads * args.tokens * args.head_dim;
  if (total < 0 || args.rotary < 2 || args.rotary % 2 != 0 || args.rotary > args.head_dim ||
      (total > 0 && (args.in.data == nullptr || args.out.data == nullptr || args.cos == nullptr ||
                     args.sin == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (total == 0) return static_cast<int>(cudaSuccess);
  const unsigned int blocks = static_cast<unsigned int>(
      std::min<int64_t>(args.batch * args.heads * args.tokens, kMaxBlocks));
  switch (args.dtype) {
    case RopeDtype::kFloat32:
      rope_kernel<float, kBackward><<<blocks, kThreads, 0, stream>>>(args);
      break;
    case RopeDtype::kFloat16:
      rope_kernel<__half, kBackward><<<blocks, kThreads, 0, stream>>>(args);
      break;
    case RopeDtype::kBFloat16:
      rope_kernel<__nv_bfloat16, kBackward><<<blocks, kThreads, 0, stream>>>(args);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

int launch_rope_forward(const RopeArgs& args, CUstream_st* stream) {
  return launch<false>(args, stream);
}

int launch_rope_backward(const RopeArgs& args, CUstream_st* stream) {
  return launch<true>(args, stream);
}

}  // namespace gdr::kernels
