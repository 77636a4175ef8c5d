// The fused optimizer tail (kernels/fused_adamw/fused_adamw.h): clip, AdamW, BF16 store, one pass.
// One block of 256 threads per 8192-element chunk of one tensor; the block finds its
// tensor by binary search over the chunk offsets. 16-byte loads and stores (8-byte BF16
// stores) when the tensor's pointers are aligned, the chunk's last numel % 4 elements and
// misaligned tensors element by element. Roofline: HBM bandwidth over 16 B read (master,
// grad, exp_avg, exp_avg_sq) + 12 B written (+ 2 B BF16 param, + 4 B grad when clipping)
// per element.
//
// Determinism: elementwise, no atomics, nothing across threads; each element is one
// thread's fixed sequence of FP32 operations.
//
// Note [Fused AdamW bits]: the result equals ATen's
//   _foreach_mul_(grads, coef); _foreach_add_(steps, 1); _fused_adamw_(...);
//   _foreach_copy_(bf16_params, masters)
// bit for bit because every value is computed by the same FP32 expression:
//   - clip: ATen's BinaryOpScalarFunctor casts the double scalar to the float opmath and
//     multiplies in float: g = grad * (float)coef (the host casts coef the same way;
//     __fmul_rn, since ATen's product is rounded when stored);
//   - adamw_element is adam_math<ADAM_MODE::ADAMW> (ATen/native/cuda/fused_adam_utils.cuh)
//     with the AMP scale, maximize and amsgrad branches removed (ATen takes none of them
//     here: no grad_scale, maximize = amsgrad = false), written with the same operators in
//     the same order, std::fma where ATen has std::fma;
//   - the bias corrections are computed on the device, as in FusedAdamMathFunctor, by
//     `1 - ::pow(float beta, float step)` (at::native::pow_ on float/float is ::pow, which
//     CUDA's math_functions.hpp maps to powf) and std::sqrt (sqrtf); step is the float
//     ATen's state_steps tensor would hold after its += 1 (exact below 2^24 steps);
//   - the BF16 store is StorageElement<__nv_bfloat16>::from_float
//   (kernels/common/storage_element.cuh),
//     __float2bfloat16_rn (round to nearest even, the same cvt.rn as __float2bfloat16), which
//     is what c10::BFloat16(float) calls on sm_80+ in _foreach_copy_'s cast.
// What this relies on: ATen and kernels/BUILD both compile with nvcc's defaults for
// floating point (--fmad=true, --prec-div=true, --prec-sqrt=true, --ftz=false; no
// --use_fast_math; third_party/cuda/defs.bzl CUDA_COPTS adds none of those flags), so '/'
// and sqrt are IEEE-rounded and powf is the same libdevice routine, and nvcc contracts the
// same source expressions into the same FMAs (the one contractible spot is
// `param -= lr * weight_decay * param`, i.e. param - (lr * wd) * param; the rest are
// explicit fma, a division or a sqrt). A different nvcc version than ATen's could in
// principle contract differently; //tests/ops:fused_adamw_gpu_test compares the bits
// against the ATen sequence on the GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/common/storage_element.cuh"
#include "kernels/fused_adamw/fused_adamw.h"

namespace gdr::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
static_assert(kFusedAdamWChunk % (kThreads * kVec) == 0, "whole float4 rounds per chunk");

struct Hyper {
  float lr, beta1, beta2, weight_decay, eps, bias_correction1, bias_correction2_sqrt, coef;
  bool scale_grad;
};

// One element: ATen's adam_math (ADAMW), after the clip multiply. `grad` is updated with
// the clipped gradient when h.scale_grad (the caller stores it then).
__device__ __forceinline__ void adamw_element(float& param, float& grad_io, float& exp_avg,
                                              float& exp_avg_sq, const Hyper& h) {
  const float lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, weight_decay = h.weight_decay,
              eps = h.eps;
  // __fmul_rn: the rounded product ATen stores, never contracted into a later add.
  if (h.scale_grad) grad_io = __fmul_rn(grad_io, h.coef);
  const float grad = grad_io;
  if (weight_decay != 0) {
    param -= lr * weight_decay * param;
  }
  exp_avg = std::fma(beta1, exp_avg, std::fma(-beta1, grad, grad));
  exp_avg_sq = std::fma(beta2, exp_avg_sq, std::fma(-beta2, grad * grad, grad * grad));
  const float step_size = lr / h.bias_correction1;
  const float denom = (std::sqrt(exp_avg_sq) / h.bias_correction2_sqrt) + eps;
  param -= step_size * exp_avg / denom;
}

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

__global__ void __launch_bounds__(kThreads)
    fused_adamw_kernel(const FusedAdamWTensor* __restrict__ tensors,
                       const int64_t* __restrict__ chunk_begin, int tensor_count, float lr,
                       float beta1, float beta2, float weight_decay, float eps, float step,
                       float coef, bool scale_grad) {
  const int64_t block = blockIdx.x;
  const int t = fused_adamw_tensor_of(chunk_begin, tensor_count, block);
  const FusedAdamWTensor x = tensors[t];
  const int64_t start = (block - chunk_begin[t]) * kFusedAdamWChunk;
  const int64_t left = x.numel - start;
  const int n = static_cast<int>(left < kFusedAdamWChunk ? left : kFusedAdamWChunk);

  // FusedAdamMathFunctor's bias corrections, per thread from the float step.
  const float bias_correction1 = 1 - ::pow(beta1, step);
  const float bias_correction2 = 1 - ::pow(beta2, step);
  const float bias_correction2_sqrt = std::sqrt(bias_correction2);
  const Hyper h{lr,   beta1,     beta2, weight_decay, eps, bias_correction1, bias_correction2_sqrt,
                coef, scale_grad};

  float* const master = x.master + start;
  float* const grad = x.grad + start;
  float* const exp_avg = x.exp_avg + start;
  float* const exp_avg_sq = x.exp_avg_sq + start;
  __nv_bfloat16* const bf16 =
      x.bf16_param == nullptr ? nullptr : static_cast<__nv_bfloat16*>(x.bf16_param) + start;

  // start is a multiple of kFusedAdamWChunk, so the bases' alignment is the chunk's.
  const bool vectorised = aligned(x.master, 16) && aligned(x.grad, 16) && aligned(x.exp_avg, 16) &&
                          aligned(x.exp_avg_sq, 16) &&
                          (x.bf16_param == nullptr || aligned(x.bf16_param, 8));
  const int vector_end = vectorised ? n / kVec * kVec : 0;
  for (int i = threadIdx.x * kVec; i < vector_end; i += kThreads * kVec) {
    float4 p = *reinterpret_cast<const float4*>(master + i);
    float4 g = *reinterpret_cast<const float4*>(grad + i);
    float4 m = *reinterpret_cast<const float4*>(exp_avg + i);
    float4 v = *reinterpret_cast<const float4*>(exp_avg_sq + i);
    adamw_element(p.x, g.x, m.x, v.x, h);
    adamw_element(p.y, g.y, m.y, v.y, h);
    adamw_element(p.z, g.z, m.z, v.z, h);
    adamw_element(p.w, g.w, m.w, v.w, h);
    *reinterpret_cast<float4*>(master + i) = p;
    if (scale_grad) *reinterpret_cast<float4*>(grad + i) = g;
    *reinterpret_cast<float4*>(exp_avg + i) = m;
    *reinterpret_cast<float4*>(exp_avg_sq + i) = v;
    if (bf16 != nullptr) {
      const float updated[kVec] = {p.x, p.y, p.z, p.w};
      store_floats<__nv_bfloat16, kVec>(bf16 + i, updated);  // one 8-byte store
    }
  }
  for (int i = vector_end + threadIdx.x; i < n; i += kThreads) {
    float p = master[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(p, g, m, v, h);
    master[i] = p;
    if (scale_grad) grad[i] = g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (bf16 != nullptr) store_float(bf16 + i, p);
  }
}

}  // namespace

int launch_fused_adamw(const FusedAdamWArgs& args, cudaStream_t stream) {
  if (args.total_chunks == 0) return cudaSuccess;
  if (args.total_chunks > 0x7fffffffLL) return cudaErrorInvalidValue;
  fused_adamw_kernel<<<static_cast<unsigned>(args.total_chunks), kThreads, 0, stream>>>(
      args.tensors, args.chunk_begin, args.tensor_count, args.lr, args.beta1, args.beta2,
      args.weight_decay, args.eps, args.step, args.coef, args.scale_grad);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
