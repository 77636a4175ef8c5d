// CUDA kernels of the fused partial rotary embedding (kernels/rope/rope.h): a warp per row and
// 16-byte vectors where the shapes and alignment allow (rope_vec_kernel), else a block per
// row and a thread per element, FP32 math with explicitly rounded products and sums (Note
// [Rope rounding]). Memory-bound (one read and one write of the tensor each way); the
// roofline is HBM bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/storage_element.cuh"
#include "kernels/rope/rope.h"

namespace gdr::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 16384;  // rows per launch before grid-striding

// Row r = (b H + h) T + t of the input and output, and position t's table rows.
template <typename T>
struct RowPointers {
  const T* in;
  T* out;
  const float* cos;
  const float* sin;
};

template <typename T>
__device__ __forceinline__ RowPointers<T> row_pointers(const RopeArgs& args, int64_t row) {
  const int64_t t = row % args.tokens;
  const int64_t bh = row / args.tokens;
  const int64_t h = bh % args.heads, b = bh / args.heads;
  return {static_cast<const T*>(args.in.data) + b * args.in.stride_b + h * args.in.stride_h +
              t * args.in.stride_t,
          static_cast<T*>(args.out.data) + b * args.out.stride_b + h * args.out.stride_h +
              t * args.out.stride_t,
          args.cos + t * args.rotary, args.sin + t * args.rotary};
}

// One block per row (token of one head) at a time, grid-striding over rows; the threads
// stride over the head dim (one element each at head_dim 256, the model's).
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeArgs args) {
  const int64_t rows = args.batch * args.heads * args.tokens;
  const int half = args.rotary / 2;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowPointers<T> r = row_pointers<T>(args, row);
    const T* in = r.in;
    T* out = r.out;
    const float* cos_row = r.cos;
    const float* sin_row = r.sin;
    for (int e = threadIdx.x; e < args.head_dim; e += kThreads) {
      if (e >= args.rotary) {
        out[e] = in[e];
        continue;
      }
      float value;
      if constexpr (!kBackward) {
        // x cos + rh sin, rh[e] = -x[e + h] (e < h) or x[e - h].
        const float rotated = e < half ? -load_float(in + e + half) : load_float(in + e - half);
        value =
            __fadd_rn(__fmul_rn(load_float(in + e), cos_row[e]), __fmul_rn(rotated, sin_row[e]));
      } else {
        // g cos plus the rotated half's gradient: g[e + h] sin[e + h] (e < h) or
        // -(g[e - h] sin[e - h]).
        const float other = e < half ? __fmul_rn(load_float(in + e + half), sin_row[e + half])
                                     : -__fmul_rn(load_float(in + e - half), sin_row[e - half]);
        value = __fadd_rn(__fmul_rn(load_float(in + e), cos_row[e]), other);
      }
      store_float(out + e, value);
    }
  }
}

// The vectorised form: a warp per row, V = 16 bytes of elements per lane and step, so a
// 256-wide BF16 row is one 16-byte load and store per lane. Needs head_dim % V == 0 and
// half % V == 0 (a vector never straddles the rotary halves or their end) and 16-byte
// aligned rows and tables; the same per-element expressions as rope_kernel, so the same
// bits.
template <typename T>
constexpr int kRopeVec = 16 / static_cast<int>(sizeof(T));

template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_vec_kernel(const RopeArgs args) {
  constexpr int V = kRopeVec<T>;
  constexpr int kWarps = kThreads / 32;
  const int64_t rows = args.batch * args.heads * args.tokens;
  const int half = args.rotary / 2;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const RowPointers<T> r = row_pointers<T>(args, row);
    const T* in = r.in;
    T* out = r.out;
    const float* cos_row = r.cos;
    const float* sin_row = r.sin;
    for (int e0 = lane * V; e0 < args.head_dim; e0 += 32 * V) {
      if (e0 >= args.rotary) {
        store_pack<T, V>(out + e0, load_pack<T, V>(in + e0));
        continue;
      }
      const bool low = e0 < half;  // the whole vector is in one half
      const int partner = low ? e0 + half : e0 - half;
      float x[V], p[V], c[V], sn[V], value[V];
      load_floats<T, V>(in + e0, x);
      load_floats<T, V>(in + partner, p);
      load_floats<float, V>(cos_row + e0, c);
      // Forward: sin at e; backward: sin at the partner (the rotated half's position).
      load_floats<float, V>(sin_row + (kBackward ? partner : e0), sn);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if constexpr (!kBackward) {
          value[k] = __fadd_rn(__fmul_rn(x[k], c[k]), __fmul_rn(low ? -p[k] : p[k], sn[k]));
        } else {
          const float other = low ? __fmul_rn(p[k], sn[k]) : -__fmul_rn(p[k], sn[k]);
          value[k] = __fadd_rn(__fmul_rn(x[k], c[k]), other);
        }
      }
      store_floats<T, V>(out + e0, value);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
bool vectorisable(const RopeArgs& args) {
  constexpr int V = kRopeVec<T>;
  auto operand_ok = [](const RopeOperand& op) {
    return aligned16(op.data) && op.stride_b % V == 0 && op.stride_h % V == 0 &&
           op.stride_t % V == 0;
  };
  return args.head_dim % V == 0 && (args.rotary / 2) % V == 0 && args.rotary % 4 == 0 &&
         operand_ok(args.in) && operand_ok(args.out) && aligned16(args.cos) && aligned16(args.sin);
}

template <typename T, bool kBackward>
void launch_for(const RopeArgs& args, unsigned int row_blocks, CUstream_st* stream) {
  if (vectorisable<T>(args)) {
    const int64_t rows = args.batch * args.heads * args.tokens;
    const unsigned int blocks = static_cast<unsigned int>(
        std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks));
    rope_vec_kernel<T, kBackward><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    rope_kernel<T, kBackward><<<row_blocks, kThreads, 0, stream>>>(args);
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
    case RopeDtype::kFloat32: launch_for<float, kBackward>(args, blocks, stream); break;
    case RopeDtype::kFloat16: launch_for<__half, kBackward>(args, blocks, stream); break;
    case RopeDtype::kBFloat16: launch_for<__nv_bfloat16, kBackward>(args, blocks, stream); break;
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
