// CUDA implementation of the causal-LM cross-entropy ops (ops/cross_entropy/cross_entropy_op.h):
// argument checks, the host check of the targets (Note [Cross-entropy target check]), the logits /
// labels layout for the kernels, scratch from the caching allocator and the launches of
// kernels/cross_entropy/cross_entropy.cu on the current stream (forward: the row kernel and the
// ordered mean, Note [Cross-entropy determinism]; backward: one row kernel). Registered for the
// CUDA dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels/cross_entropy/cross_entropy.h"
#include "ops/cross_entropy/cross_entropy_internal.h"
#include "ops/cross_entropy/cross_entropy_op.h"

namespace gdr {
namespace {

using cross_entropy_internal::check_backward_inputs;
using cross_entropy_internal::check_inputs;

void check_launch(int error, const char* op, const char* what) {
  TORCH_CHECK(error == cudaSuccess, op, ": ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

kernels::LogitsDtype logits_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::LogitsDtype::kFloat32;
    case at::kHalf: return kernels::LogitsDtype::kFloat16;
    case at::kBFloat16: return kernels::LogitsDtype::kBFloat16;
    default:
      TORCH_CHECK(false, "causal_lm_cross_entropy: unsupported logits dtype ", t, " on CUDA");
  }
}

// The kernels read rows in place through the batch and token strides; only a strided
// vocab dim (never produced by the model) costs a copy.
at::Tensor logits_rows(const at::Tensor& logits) {
  return logits.size(2) > 1 && logits.stride(2) != 1 ? logits.contiguous() : logits;
}

at::Tensor labels_long(const at::Tensor& labels) {
  return labels.scalar_type() == at::kLong ? labels : labels.to(at::kLong);
}

kernels::CrossEntropyProblem problem_of(const at::Tensor& logits, const at::Tensor& labels,
                                        int64_t ignore_index) {
  kernels::CrossEntropyProblem p;
  p.dtype = logits_dtype(logits.scalar_type());
  p.batch = logits.size(0);
  p.tokens = logits.size(1);
  p.vocab = logits.size(2);
  p.logits = logits.data_ptr();
  p.logits_batch_stride = logits.stride(0);
  p.logits_token_stride = logits.stride(1);
  p.labels = labels.data_ptr<int64_t>();
  p.labels_batch_stride = labels.stride(0);
  p.labels_token_stride = labels.stride(1);
  p.ignore_index = ignore_index;
  TORCH_CHECK(kernels::cross_entropy_supports(p),
              "causal_lm_cross_entropy: expected at most 2^31 - 1 rows B * T on CUDA, but got B = ",
              p.batch, ", T = ", p.tokens);
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(const at::Tensor& logits,
                                                            const at::Tensor& labels,
                                                            int64_t ignore_index) {
  constexpr const char* kOp = "causal_lm_cross_entropy";
  check_inputs(kOp, logits, labels);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const int64_t B = logits.size(0), T = logits.size(1);
  // See Note [Cross-entropy target check]: no host check here (it would sync every call).
  const at::Tensor x = logits_rows(logits);
  const at::Tensor y = labels_long(labels);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor row_loss = at::empty({B, T - 1}, f32);
  at::Tensor lse = at::empty({B, T - 1}, f32);
  at::Tensor loss = at::empty({}, f32);
  at::Tensor count = at::empty({}, f32);
  kernels::CrossEntropyForwardArgs args;
  args.problem = problem_of(x, y, ignore_index);
  args.row_loss = row_loss.data_ptr<float>();
  args.row_lse = lse.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(kernels::launch_cross_entropy_forward(args, stream), kOp, "forward");
  check_launch(
      kernels::launch_cross_entropy_reduce(args.problem, args.row_loss, loss.data_ptr<float>(),
                                           count.data_ptr<float>(), stream),
      kOp, "mean");
  return {loss, lse, count};
}

at::Tensor backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                         const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& count,
                         int64_t ignore_index) {
  constexpr const char* kOp = "causal_lm_cross_entropy_backward";
  check_backward_inputs(kOp, grad_loss, logits, labels, lse, count);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const at::Tensor x = logits_rows(logits);
  const at::Tensor y = labels_long(labels);
  // Read on the device by the kernel: no sync.
  const at::Tensor g = grad_loss.to(at::kFloat).contiguous();
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor count_c = count.contiguous();
  at::Tensor grad = at::empty(logits.sizes(), logits.options());
  kernels::CrossEntropyBackwardArgs args;
  args.problem = problem_of(x, y, ignore_index);
  args.row_lse = lse_c.data_ptr<float>();
  args.grad_loss = g.data_ptr<float>();
  args.count = count_c.data_ptr<float>();
  args.grad_logits = grad.data_ptr();
  check_launch(
      kernels::launch_cross_entropy_backward(args, c10::cuda::getCurrentCUDAStream().stream()), kOp,
      "backward");
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("causal_lm_cross_entropy_forward", &forward_cuda);
  m.impl("causal_lm_cross_entropy_backward", &backward_cuda);
}

}  // namespace gdr
