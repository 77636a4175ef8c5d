// CUDA kernels of the fused causal depthwise conv1d + SiLU (forward, backward, ordered
// weight-gradient reduction): thin __global__ wrappers around the bodies in
// kernels/causal_conv1d/causal_conv1d_kernel.cuh, then the launchers. Contract in
// kernels/causal_conv1d/causal_conv1d.h.
//
// Why a second kernel for the weight gradient: dw sums over every token. Atomics would
// make that one pass, but the order of the float additions would then follow block
// scheduling and the bits would change from run to run. Instead every program writes one
// FP32 partial row and a second kernel on the same stream sums the rows in a fixed order
// (Note [Causal conv determinism] in the .cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/causal_conv1d/causal_conv1d.h"

#include "kernels/causal_conv1d/causal_conv1d_kernel.cuh"

namespace gdr::kernels {
namespace {

using causal_conv_detail::backward_tile;
using causal_conv_detail::combine_floats;
using causal_conv_detail::forward_tile;
using causal_conv_detail::reduce_partials_block;

constexpr int kTileThreads = kCausalConvChannelThreads * kCausalConvTileRows;
constexpr int kTileBlocksPerSm = 2;

// Channels per thread. Forward: see ForwardConfig below. Backward: 2 in every dtype,
// because a thread keeps 4 * VEC * K floats live (weights, input and dpre windows, tap
// sums) besides its loads in flight, and more channels would cost the occupancy or the
// loads in flight that keep HBM busy; the backward is built for 2 blocks per SM (<= 128
// registers, no spills at K = 4 per ptxas -v), and every other channel, token and block
// count swept was slower (bench/causal_conv1d_bench; docs/benchmarks.md, Decisions).
// Forward configuration per storage type: channels per thread, tokens whose loads are
// issued together, and the blocks per SM __launch_bounds__ promises. y is a per-element
// function, so these change speed only. 16-bit types: 4 channels (8-byte loads), 8 tokens
// in flight, 3 blocks (80 registers), the fastest of the configurations swept on the 0.8B
// layer's 1 x 2048 x 6144 BF16 forward, ahead of 8 channels (16-byte loads), 4 tokens,
// 2 blocks (125 registers, 16 warps per SM) and of 8 x 8 x 2, 4 x 4 x 4 and 4 x 8 x 4
// (measured: docs/benchmarks.md, Causal conv1d + SiLU and Decisions). FP32: 4 channels
// (16 bytes), 4 tokens, 2 blocks.
template <typename T>
struct ForwardConfig {
  static constexpr int kVec = 4;
  static constexpr int kInFlight = sizeof(T) == 2 ? 8 : causal_conv_detail::kForwardTokensInFlight;
  static constexpr int kBlocksPerSm = sizeof(T) == 2 ? 3 : 2;
};
constexpr int kBackwardVec = 2;

// ----------------------------------------------------------------------------
// CUDA kernels

template <typename T, int VEC, int K>
__global__ void __launch_bounds__(kTileThreads, ForwardConfig<T>::kBlocksPerSm)
    causal_conv1d_silu_forward_kernel(const CausalConvForwardArgs args) {
  forward_tile<T, VEC, K, ForwardConfig<T>::kInFlight>(args);
}

template <typename T, int VEC, int K>
__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSm)
    causal_conv1d_silu_backward_kernel(const CausalConvBackwardArgs args, int64_t tile_tokens,
                                       int64_t tiles_per_seq) {
  __shared__ float tile_row_sums[combine_floats<VEC, K>()];
  backward_tile<T, VEC, K>(args, tile_tokens, tiles_per_seq, tile_row_sums);
}

template <typename TW>
__global__ void __launch_bounds__(kCausalConvReduceCols* kCausalConvReduceSlices)
    causal_conv1d_reduce_partials_kernel(const float* partials, int64_t programs,
                                         int64_t row_floats, TW* dw) {
  __shared__ float slice_sums[kCausalConvReduceSlices * kCausalConvReduceCols];
  reduce_partials_block<TW>(partials, programs, row_floats, dw, slice_sums);
}

// ----------------------------------------------------------------------------
// kernel launcher

// VEC-wide loads and stores need every (b, t) row start aligned to VEC elements: the base
// pointer, the strides of dims with more than one entry, and C (the contiguous outputs'
// row length). Strides of size-1 dims are never used, so they do not count.
bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool operand_aligned(const CausalConvShape& shape, const TokenOperand& op, int64_t bytes,
                     int64_t element_bytes) {
  if (!aligned(op.data, bytes)) return false;
  if (shape.batch > 1 && (op.batch_stride * element_bytes) % bytes != 0) return false;
  if (shape.seq > 1 && (op.token_stride * element_bytes) % bytes != 0) return false;
  return true;
}

template <typename T>
bool can_vectorize(const CausalConvShape& shape, int vec, const TokenOperand* a,
                   const TokenOperand* b, const void* out) {
  const int64_t bytes = vec * static_cast<int64_t>(sizeof(T));
  if (shape.channels % vec != 0 || !aligned(out, bytes)) return false;
  if (!operand_aligned(shape, *a, bytes, sizeof(T))) return false;
  return b == nullptr || operand_aligned(shape, *b, bytes, sizeof(T));
}

// grid.x: token tiles (kCausalConvTileRows per block); grid.y: channel groups.
bool make_grid(const CausalConvShape& shape, int vec, int64_t tiles_per_seq, dim3& grid) {
  const int64_t blocks_x =
      (shape.batch * tiles_per_seq + kCausalConvTileRows - 1) / kCausalConvTileRows;
  const int64_t groups = (shape.channels + vec - 1) / vec;
  const int64_t blocks_y = (groups + kCausalConvChannelThreads - 1) / kCausalConvChannelThreads;
  if (blocks_x > 0x7fffffffLL || blocks_y > 65535) return false;
  grid = dim3(static_cast<unsigned int>(blocks_x), static_cast<unsigned int>(blocks_y));
  return true;
}

template <typename T, int VEC>
int forward_vec(const CausalConvForwardArgs& args, cudaStream_t stream) {
  const int64_t tiles_per_seq =
      (args.shape.seq + kCausalConvForwardTileTokens - 1) / kCausalConvForwardTileTokens;
  dim3 grid;
  if (!make_grid(args.shape, VEC, tiles_per_seq, grid)) {
    return static_cast<int>(cudaErrorInvalidConfiguration);
  }
  const dim3 block(kCausalConvChannelThreads, kCausalConvTileRows);
  switch (args.shape.taps) {
    case 2: causal_conv1d_silu_forward_kernel<T, VEC, 2><<<grid, block, 0, stream>>>(args); break;
    case 3: causal_conv1d_silu_forward_kernel<T, VEC, 3><<<grid, block, 0, stream>>>(args); break;
    case 4: causal_conv1d_silu_forward_kernel<T, VEC, 4><<<grid, block, 0, stream>>>(args); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_forward(const CausalConvForwardArgs& args, cudaStream_t stream) {
  constexpr int kVec = ForwardConfig<T>::kVec;
  if (can_vectorize<T>(args.shape, kVec, &args.x, nullptr, args.y)) {
    return forward_vec<T, kVec>(args, stream);
  }
  return forward_vec<T, 1>(args, stream);
}

template <typename T, int VEC>
int backward_vec(const CausalConvBackwardArgs& args, const CausalConvBackwardLaunch& launch,
                 cudaStream_t stream) {
  dim3 grid;
  if (!make_grid(args.shape, VEC, launch.tiles_per_seq, grid) ||
      static_cast<int64_t>(grid.x) != launch.programs) {
    return static_cast<int>(cudaErrorInvalidConfiguration);
  }
  const dim3 block(kCausalConvChannelThreads, kCausalConvTileRows);
  const int64_t tile = launch.tile_tokens, tiles = launch.tiles_per_seq;
  switch (args.shape.taps) {
    case 2:
      causal_conv1d_silu_backward_kernel<T, VEC, 2><<<grid, block, 0, stream>>>(args, tile, tiles);
      break;
    case 3:
      causal_conv1d_silu_backward_kernel<T, VEC, 3><<<grid, block, 0, stream>>>(args, tile, tiles);
      break;
    case 4:
      causal_conv1d_silu_backward_kernel<T, VEC, 4><<<grid, block, 0, stream>>>(args, tile, tiles);
      break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const CausalConvBackwardArgs& args, cudaStream_t stream) {
  const CausalConvBackwardLaunch launch = derive_causal_conv_backward_launch(args.shape);
  if (can_vectorize<T>(args.shape, kBackwardVec, &args.x, &args.grad_y, args.dx)) {
    return backward_vec<T, kBackwardVec>(args, launch, stream);
  }
  return backward_vec<T, 1>(args, launch, stream);
}

bool empty(const CausalConvShape& shape) { return shape.batch == 0 || shape.seq == 0; }

}  // namespace

int launch_causal_conv1d_silu_forward(const CausalConvForwardArgs& args, CUstream_st* stream) {
  if (!causal_conv_supports(args.shape)) return static_cast<int>(cudaErrorInvalidValue);
  if (empty(args.shape)) return static_cast<int>(cudaSuccess);
  switch (args.dtype) {
    case ConvDtype::kFloat32: return launch_forward<float>(args, stream);
    case ConvDtype::kFloat16: return launch_forward<__half>(args, stream);
    case ConvDtype::kBFloat16: return launch_forward<__nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_causal_conv1d_silu_backward(const CausalConvBackwardArgs& args, CUstream_st* stream) {
  if (!causal_conv_supports(args.shape)) return static_cast<int>(cudaErrorInvalidValue);
  if (empty(args.shape)) return static_cast<int>(cudaSuccess);
  switch (args.dtype) {
    case ConvDtype::kFloat32: return launch_backward<float>(args, stream);
    case ConvDtype::kFloat16: return launch_backward<__half>(args, stream);
    case ConvDtype::kBFloat16: return launch_backward<__nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_causal_conv1d_reduce_partials(const float* partials, int64_t programs,
                                         int64_t row_floats, ConvDtype weight_dtype, void* dw,
                                         CUstream_st* stream) {
  if (row_floats < 1 || programs < 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t blocks = (row_floats + kCausalConvReduceCols - 1) / kCausalConvReduceCols;
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned int>(blocks));
  constexpr int kThreads = kCausalConvReduceCols * kCausalConvReduceSlices;
  switch (weight_dtype) {
    case ConvDtype::kFloat32:
      causal_conv1d_reduce_partials_kernel<float>
          <<<grid, kThreads, 0, stream>>>(partials, programs, row_floats, static_cast<float*>(dw));
      break;
    case ConvDtype::kFloat16:
      causal_conv1d_reduce_partials_kernel<__half>
          <<<grid, kThreads, 0, stream>>>(partials, programs, row_floats, static_cast<__half*>(dw));
      break;
    case ConvDtype::kBFloat16:
      causal_conv1d_reduce_partials_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          partials, programs, row_floats, static_cast<__nv_bfloat16*>(dw));
      break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
