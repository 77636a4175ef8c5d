// CUDA kernels of the fused causal-LM cross-entropy (row forward, ordered mean, row
// backward): thin __global__ wrappers around the bodies in
// kernels/cross_entropy/cross_entropy_kernel.cuh, then the launchers. Contract in
// kernels/cross_entropy/cross_entropy.h.
//
// Why a second kernel for the mean: the loss sums over every row. One atomicAdd per row
// would make it one pass, but the order of the float additions would then follow block
// scheduling and the bits would change from run to run. Instead every row block writes
// its FP32 loss and a one-block kernel on the same stream sums them in a fixed order
// (Note [Cross-entropy determinism]). Its cost (a few microseconds over a few thousand
// rows) is noise next to a pass over B * T * V logits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include <cstdint>

#include "kernels/cross_entropy/cross_entropy.h"

#include "kernels/cross_entropy/cross_entropy_kernel.cuh"

namespace gdr::kernels {
namespace {

using cross_entropy_detail::backward_row;
using cross_entropy_detail::forward_row;
using cross_entropy_detail::reduce_rows;

// ----------------------------------------------------------------------------
// CUDA kernels

template <typename T, int VEC>
__global__ void __launch_bounds__(kCrossEntropyMaxThreads)
    cross_entropy_forward_kernel(const CrossEntropyForwardArgs args) {
  __shared__ float warp_pairs[2 * kCrossEntropyMaxThreads / 32];
  forward_row<T, VEC>(args, warp_pairs);
}

__global__ void __launch_bounds__(kCrossEntropyReduceThreads)
    cross_entropy_reduce_kernel(const CrossEntropyProblem problem, const float* row_loss,
                                float* loss, float* count) {
  __shared__ float sums[kCrossEntropyReduceThreads];
  __shared__ int64_t counts[kCrossEntropyReduceThreads];
  reduce_rows(problem, row_loss, loss, count, sums, counts);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kCrossEntropyMaxThreads)
    cross_entropy_backward_kernel(const CrossEntropyBackwardArgs args) {
  backward_row<T, VEC>(args);
}

// ----------------------------------------------------------------------------
// kernel launcher

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte loads need every row start 16-byte aligned. Strides of size-1 dims are never
// used, so they do not count.
bool logits_rows_aligned(const CrossEntropyProblem& p, int64_t element_bytes) {
  if (!aligned16(p.logits)) return false;
  if (p.batch > 1 && (p.logits_batch_stride * element_bytes) % 16 != 0) return false;
  return (p.logits_token_stride * element_bytes) % 16 == 0;
}

template <typename T>
int launch_forward(const CrossEntropyForwardArgs& args, cudaStream_t stream) {
  const CrossEntropyProblem& p = args.problem;
  const dim3 grid(static_cast<unsigned int>(cross_entropy_scored_rows(p)));
  const int threads = cross_entropy_block_threads(p.vocab);
  constexpr int kVec = 16 / sizeof(T);
  // The vectorised body loads whole packs and folds the tail [V / VEC * VEC, V) scalar,
  // so V need not be a multiple of the pack.
  if (logits_rows_aligned(p, sizeof(T))) {
    cross_entropy_forward_kernel<T, kVec><<<grid, threads, 0, stream>>>(args);
  } else {
    cross_entropy_forward_kernel<T, 1><<<grid, threads, 0, stream>>>(args);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const CrossEntropyBackwardArgs& args, cudaStream_t stream) {
  const CrossEntropyProblem& p = args.problem;
  const dim3 grid(static_cast<unsigned int>(p.batch * p.tokens));
  const int threads = cross_entropy_block_threads(p.vocab);
  constexpr int kVec = 16 / sizeof(T);
  // The output rows [B, T, V] are aligned only when V is a multiple of the pack.
  if (logits_rows_aligned(p, sizeof(T)) && aligned16(args.grad_logits) && p.vocab % kVec == 0) {
    cross_entropy_backward_kernel<T, kVec><<<grid, threads, 0, stream>>>(args);
  } else {
    cross_entropy_backward_kernel<T, 1><<<grid, threads, 0, stream>>>(args);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_cross_entropy_forward(const CrossEntropyForwardArgs& args, CUstream_st* stream) {
  if (!cross_entropy_supports(args.problem)) return static_cast<int>(cudaErrorInvalidValue);
  if (cross_entropy_scored_rows(args.problem) == 0) return static_cast<int>(cudaSuccess);
  switch (args.problem.dtype) {
    case LogitsDtype::kFloat32: return launch_forward<float>(args, stream);
    case LogitsDtype::kFloat16: return launch_forward<__half>(args, stream);
    case LogitsDtype::kBFloat16: return launch_forward<__nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_cross_entropy_reduce(const CrossEntropyProblem& problem, const float* row_loss,
                                float* loss, float* count, CUstream_st* stream) {
  if (!cross_entropy_supports(problem)) return static_cast<int>(cudaErrorInvalidValue);
  cross_entropy_reduce_kernel<<<1, kCrossEntropyReduceThreads, 0, stream>>>(problem, row_loss, loss,
                                                                            count);
  return static_cast<int>(cudaGetLastError());
}

int launch_cross_entropy_backward(const CrossEntropyBackwardArgs& args, CUstream_st* stream) {
  if (!cross_entropy_supports(args.problem)) return static_cast<int>(cudaErrorInvalidValue);
  if (args.problem.batch == 0) return static_cast<int>(cudaSuccess);
  switch (args.problem.dtype) {
    case LogitsDtype::kFloat32: return launch_backward<float>(args, stream);
    case LogitsDtype::kFloat16: return launch_backward<__half>(args, stream);
    case LogitsDtype::kBFloat16: return launch_backward<__nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace gdr::kernels
