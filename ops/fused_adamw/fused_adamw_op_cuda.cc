// CUDA implementation of the fused optimizer tail (ops/fused_adamw/fused_adamw_op.h): one launch of
// kernels/fused_adamw/fused_adamw.h on the current stream when every tensor is contiguous, else the
// reference ATen sequence (the same bits). Registered for the CUDA dispatch key; linked
// into CUDA binaries only (via :cuda_ops).
//
// The per-tensor table (pointers, numel, chunk offsets) is built every call in pinned host
// memory and copied to the device with a non-blocking copy on the current stream: the
// caching host allocator keeps the pinned block until that copy has run, and the device
// copy is freed to the caching allocator on the stream the kernel runs on, so nothing is
// cached across calls that could go stale.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstring>

#include "kernels/fused_adamw/fused_adamw.h"
#include "ops/fused_adamw/fused_adamw_op.h"

namespace gdr {
namespace {

void fused_adamw_cuda(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList bf16_params, double lr,
                      double beta1, double beta2, double weight_decay, double eps, int64_t step,
                      double grad_coef) {
  fused_adamw_internal::check_inputs(masters, grads, exp_avgs, exp_avg_sqs, bf16_params, step);
  const size_t n = masters.size();
  if (n == 0) return;
  bool contiguous = true;
  for (size_t i = 0; contiguous && i < n; ++i) {
    contiguous = masters[i].is_contiguous() && grads[i].is_contiguous() &&
                 exp_avgs[i].is_contiguous() && exp_avg_sqs[i].is_contiguous() &&
                 (bf16_params.empty() || bf16_params[i].is_contiguous());
  }
  if (!contiguous || n > 0x7fffffff) {
    fused_adamw_internal::fused_adamw_reference(masters, grads, exp_avgs, exp_avg_sqs, bf16_params,
                                                lr, beta1, beta2, weight_decay, eps, step,
                                                grad_coef);
    return;
  }
  const c10::cuda::CUDAGuard device_guard(masters[0].device());

  // Table layout: n FusedAdamWTensor entries, then n + 1 int64 chunk offsets.
  constexpr size_t kEntryWords = sizeof(kernels::FusedAdamWTensor) / sizeof(int64_t);
  const int64_t words = static_cast<int64_t>(n * kEntryWords + n + 1);
  const at::Tensor host =
      at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* const base = host.data_ptr<int64_t>();
  int64_t* const chunk_begin = base + n * kEntryWords;
  chunk_begin[0] = 0;
  for (size_t i = 0; i < n; ++i) {
    kernels::FusedAdamWTensor e;
    e.master = masters[i].data_ptr<float>();
    e.grad = grads[i].data_ptr<float>();
    e.exp_avg = exp_avgs[i].data_ptr<float>();
    e.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    e.bf16_param = bf16_params.empty() ? nullptr : bf16_params[i].data_ptr();
    e.numel = masters[i].numel();
    std::memcpy(base + i * kEntryWords, &e, sizeof(e));
    chunk_begin[i + 1] = chunk_begin[i] + kernels::fused_adamw_chunks(e.numel);
  }
  const at::Tensor device = host.to(masters[0].device(), at::kLong, /*non_blocking=*/true);
  const int64_t* const device_base = device.data_ptr<int64_t>();

  kernels::FusedAdamWArgs args;
  args.tensors = reinterpret_cast<const kernels::FusedAdamWTensor*>(device_base);
  args.chunk_begin = device_base + n * kEntryWords;
  args.tensor_count = static_cast<int>(n);
  args.total_chunks = chunk_begin[n];
  // As FusedAdamMathFunctor and _foreach_mul_'s functor cast them (double -> float).
  args.lr = static_cast<float>(lr);
  args.beta1 = static_cast<float>(beta1);
  args.beta2 = static_cast<float>(beta2);
  args.weight_decay = static_cast<float>(weight_decay);
  args.eps = static_cast<float>(eps);
  args.step = static_cast<float>(step);
  args.coef = static_cast<float>(grad_coef);
  args.scale_grad = grad_coef != 1.0;
  const int error = kernels::launch_fused_adamw(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == cudaSuccess, "fused_adamw_step_: kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)));
  // What the ATen in-place ops of the reference do to the tensors they write.
  for (size_t i = 0; i < n; ++i) {
    masters[i].unsafeGetTensorImpl()->bump_version();
    exp_avgs[i].unsafeGetTensorImpl()->bump_version();
    exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
    if (args.scale_grad) grads[i].unsafeGetTensorImpl()->bump_version();
    if (!bf16_params.empty()) bf16_params[i].unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) { m.impl("fused_adamw_step_", &fused_adamw_cuda); }

}  // namespace gdr
