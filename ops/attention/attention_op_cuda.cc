// CUDA implementation of the causal attention op (ops/attention/attention_op.h): the cuDNN problem
// for the tensors' shapes and strides, outputs and workspace from the caching allocator, and one
// cuDNN graph execution each way on the current stream (kernels/attention/cudnn_attention.h).
// Registered for the CUDA dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <exception>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/attention/cudnn_attention.h"
#include "ops/attention/attention_internal.h"
#include "ops/attention/attention_op.h"
#include "ops/policy/determinism.h"

namespace gdr {
namespace {

using attention_internal::check_backward_inputs;
using attention_internal::check_inputs;

kernels::AttentionStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The layout the forward gives its output and the backward its gradient of it:
// [B, T, H, D] memory seen as [B, H, T, D].
kernels::AttentionStrides bthd_strides(const at::Tensor& like) {
  const int64_t H = like.size(1), T = like.size(2), D = like.size(3);
  return {T * H * D, D, H * D, 1};
}

// A gradient's layout: its input's strides when those are dense (q / k / v are transposed
// views of projections), else [B, T, H, D].
kernels::AttentionStrides gradient_strides(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? strides_of(t) : bthd_strides(t);
}

at::Tensor empty_with_strides(const at::Tensor& like, const kernels::AttentionStrides& strides) {
  return at::empty_strided(like.sizes(), strides, like.options());
}

// Why cuDNN's kernels cannot read `t` in place, or empty: head_dim contiguous, the other
// strides and the base 16-byte aligned.
std::string layout_problem(const char* name, const at::Tensor& t) {
  if (t.stride(3) != 1) return std::string(name) + "'s head_dim is not contiguous";
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) {
      return std::string(name) + "'s stride " + std::to_string(t.stride(d)) + " in dim " +
             std::to_string(d) + " is not a multiple of 8 elements";
    }
  }
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return std::string(name) + " is not 16-byte aligned";
  }
  return {};
}

kernels::AttentionProblem forward_problem(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, double scale) {
  kernels::AttentionProblem p;
  p.dtype = q.scalar_type() == at::kBFloat16 ? kernels::AttentionDtype::kBFloat16
                                             : kernels::AttentionDtype::kHalf;
  p.batch = q.size(0);
  p.q_heads = q.size(1);
  p.kv_heads = k.size(1);
  p.seq_len = q.size(2);
  p.head_dim = q.size(3);
  p.scale = static_cast<float>(scale);
  p.q = strides_of(q);
  p.k = strides_of(k);
  p.v = strides_of(v);
  p.o = bthd_strides(q);
  p.device = q.get_device();
  return p;
}

// The backward's layouts as the forward will hand them over: grad_out like out, the
// gradients like their inputs.
void add_backward_layouts(kernels::AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v) {
  p.grad_o = p.o;
  p.grad_q = gradient_strides(q);
  p.grad_k = gradient_strides(k);
  p.grad_v = gradient_strides(v);
}

// What the CUDA implementation needs beyond the common checks.
void check_cuda_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
              ": the CUDA implementation takes BFloat16 or Half, but got ", q.scalar_type(),
              " (causal_attention() sends other dtypes to ATen's SDPA)");
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    const std::string problem = layout_problem(name, *t);
    TORCH_CHECK(problem.empty(), op, ": cuDNN cannot read ", name, " in place: ", problem,
                " (causal_attention() sends such inputs to ATen's SDPA)");
  }
}

std::string unsupported_reason_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  check_inputs("causal_attention_unsupported_reason", q, k, v, scale);
  if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf) {
    return "cuDNN attention needs BFloat16 or Half";
  }
  const int64_t D = q.size(3);
  if (D % 8 != 0 || D > 256) {
    return "head_dim " + std::to_string(D) + " is not a multiple of 8 in [8, 256]";
  }
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    std::string problem = layout_problem(name, *t);
    if (!problem.empty()) return problem;
  }
  const c10::cuda::CUDAGuard device_guard(q.device());
  kernels::AttentionProblem p = forward_problem(q, k, v, scale);
  add_backward_layouts(p, q, k, v);
  try {
    // Both backward algorithms: deterministic mode may flip between the forward and
    // the backward, and the backward must not find out then that it cannot run.
    p.deterministic = false;
    std::string reason = kernels::cudnn_attention_unsupported_reason(p);
    const std::string cudnn = "cuDNN " + std::to_string(kernels::cudnn_attention_backend_version());
    if (!reason.empty()) return cudnn + ": " + reason;
    p.deterministic = true;
    reason = kernels::cudnn_attention_unsupported_reason(p);
    if (!reason.empty()) return cudnn + " (deterministic backward): " + reason;
    // Note [Deterministic attention workspace]: on Hopper cuDNN's deterministic backward
    // materialises dP, B * Hq * T^2 BF16 values of workspace (64 MiB for the 0.8B model's
    // T = 2048, 16 GiB at T = 32768). Past an eighth of the device's memory ATen's
    // FlashAttention 2 path (deterministic, workspace linear in T) is the better choice.
    if (use_deterministic_mode()) {
      const int64_t bytes = kernels::cudnn_attention_backward_workspace_bytes(p);
      const int64_t limit =
          static_cast<int64_t>(at::cuda::getDeviceProperties(p.device)->totalGlobalMem / 8);
      if (bytes > limit) {
        return cudnn + " (deterministic backward): its workspace of " +
               std::to_string(bytes >> 20) + " MiB is over an eighth of the device's memory (" +
               std::to_string(limit >> 20) + " MiB)";
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

at::Tensor workspace(int64_t bytes, const at::Tensor& like) {
  return at::empty({bytes}, like.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, double scale) {
  const char* op = "causal_attention_forward";
  check_inputs(op, q, k, v, scale);
  check_cuda_inputs(op, q, k, v);
  const c10::cuda::CUDAGuard device_guard(q.device());
  const kernels::AttentionProblem p = forward_problem(q, k, v, scale);
  at::Tensor out = empty_with_strides(q, p.o);
  at::Tensor logsumexp = at::empty({p.batch, p.q_heads, p.seq_len}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, logsumexp};
  try {
    const at::Tensor space = workspace(kernels::cudnn_attention_forward_workspace_bytes(p), q);
    kernels::cudnn_attention_forward(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                     logsumexp.data_ptr<float>(), space.data_ptr(),
                                     c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
  return {out, logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double scale) {
  const char* op = "causal_attention_backward";
  check_backward_inputs(op, grad_out, q, k, v, out, logsumexp, scale);
  check_cuda_inputs(op, q, k, v);
  const c10::cuda::CUDAGuard device_guard(q.device());
  kernels::AttentionProblem p = forward_problem(q, k, v, scale);
  add_backward_layouts(p, q, k, v);
  p.deterministic = use_deterministic_mode();
  // The graph reads out and grad_out in the forward's [B, T, H, D] layout (the layout
  // autograd hands back through the model's transpose + reshape); anything else is copied
  // into it, so the backward runs the graph unsupported_reason() checked.
  auto in_o_layout = [&](const at::Tensor& t) {
    if (strides_of(t) == p.o) return t;
    at::Tensor copy = empty_with_strides(q, p.o);
    copy.copy_(t);
    return copy;
  };
  const at::Tensor o = in_o_layout(out);
  const at::Tensor grad_o = in_o_layout(grad_out);
  const at::Tensor stats = logsumexp.contiguous();
  at::Tensor grad_q = empty_with_strides(q, p.grad_q);
  at::Tensor grad_k = empty_with_strides(k, p.grad_k);
  at::Tensor grad_v = empty_with_strides(v, p.grad_v);
  if (q.numel() == 0) return {grad_q, grad_k.zero_(), grad_v.zero_()};
  try {
    const at::Tensor space = workspace(kernels::cudnn_attention_backward_workspace_bytes(p), q);
    kernels::cudnn_attention_backward(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                      grad_o.data_ptr(), stats.data_ptr<float>(), grad_q.data_ptr(),
                                      grad_k.data_ptr(), grad_v.data_ptr(), space.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("causal_attention_forward", &forward_cuda);
  m.impl("causal_attention_backward", &backward_cuda);
  m.impl("causal_attention_unsupported_reason", &unsupported_reason_cuda);
}

}  // namespace gdr
