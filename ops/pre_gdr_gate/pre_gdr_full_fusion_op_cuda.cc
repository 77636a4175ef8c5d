// CUDA implementation of the full pre-GDR fusion op: argument checks, the current stream,
// outputs and scratch from the caching allocator, the fused kernels
// (kernels/pre_gdr_gate/pre_gdr_full_fusion.cu) and the existing gate op for g / beta. Registered
// for the CUDA dispatch key; linked into CUDA binaries through //ops:cuda_ops.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "kernels/pre_gdr_gate/pre_gdr_full_fusion.h"
#include "kernels/pre_gdr_gate/pre_gdr_full_fusion_math.h"
#include "ops/pre_gdr_gate/pre_gdr_full_fusion_op.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_internal.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

namespace gdr {
namespace {

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "pre_gdr_full_fusion: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

kernels::FullFusionShape shape_of(const at::Tensor& qkv, const GdnHeads& heads) {
  kernels::FullFusionShape s;
  s.batch = qkv.size(0);
  s.seq = qkv.size(1);
  s.num_k_heads = heads.num_k_heads;
  s.num_v_heads = heads.num_v_heads;
  s.head_k_dim = heads.head_k_dim;
  s.head_v_dim = heads.head_v_dim;
  return s;
}

// The kernels take any batch / token strides but need unit channel stride.
at::Tensor with_unit_channel_stride(const at::Tensor& qkv) {
  return qkv.stride(2) == 1 ? qkv : qkv.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& qkv_in, const at::Tensor& conv_weight, const at::Tensor& a,
    const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias, int64_t Hk, int64_t Hv,
    int64_t dk, int64_t dv) {
  const GdnHeads heads{Hk, Hv, dk, dv};
  check_pre_gdr_full_fusion_inputs(qkv_in, conv_weight, a, b, A_log, dt_bias, heads);
  const c10::cuda::CUDAGuard device_guard(qkv_in.device());
  const at::Tensor qkv = with_unit_channel_stride(qkv_in);
  const at::Tensor weight = conv_weight.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1);
  const auto f32 = qkv.options().dtype(at::kFloat);
  at::Tensor q = at::empty({B, T, Hv, dk}, f32);
  at::Tensor k = at::empty({B, T, Hv, dk}, f32);
  at::Tensor v = at::empty({B, T, Hv, dv}, f32);
  kernels::FullFusionForwardArgs args;
  args.shape = shape_of(qkv, heads);
  args.kind = gate_internal::scalar_kind(qkv);
  args.qkv = qkv.data_ptr();
  args.qkv_stride_b = qkv.stride(0);
  args.qkv_stride_t = qkv.stride(1);
  args.conv_weight = weight.data_ptr();
  args.q = q.data_ptr<float>();
  args.k = k.data_ptr<float>();
  args.v = v.data_ptr<float>();
  check_launch(
      kernels::launch_pre_gdr_full_fusion_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
      "forward");
  // Below autograd here, so this is the gate's CUDA kernel on the same stream.
  auto [g, beta] = pre_gdr_gate(a, b, A_log, dt_bias);
  return {q, k, v, g, beta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v,
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& qkv_in,
    const at::Tensor& conv_weight, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias, int64_t Hk, int64_t Hv, int64_t dk,
    int64_t dv) {
  const GdnHeads heads{Hk, Hv, dk, dv};
  check_pre_gdr_full_fusion_inputs(qkv_in, conv_weight, a, b, A_log, dt_bias, heads);
  check_pre_gdr_full_fusion_backward_grads(grad_q, grad_k, grad_v, grad_g, grad_beta, qkv_in,
                                           heads);
  check_pre_gdr_full_fusion_not_deterministic("the backward was called");
  const c10::cuda::CUDAGuard device_guard(qkv_in.device());
  const at::Tensor qkv = with_unit_channel_stride(qkv_in);
  const at::Tensor weight = conv_weight.contiguous();
  const at::Tensor gq = grad_q.contiguous(), gk = grad_k.contiguous(), gv = grad_v.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), C = heads.conv_dim();
  at::Tensor grad_qkv = at::empty({B, T, C}, qkv.options());
  // FP32 accumulator of the atomic conv-weight sums (zeroed on the current stream).
  at::Tensor grad_weight_sum =
      at::zeros({C, int64_t{kernels::kFullFusionConvTaps}}, qkv.options().dtype(at::kFloat));
  kernels::FullFusionBackwardArgs args;
  args.shape = shape_of(qkv, heads);
  args.kind = gate_internal::scalar_kind(qkv);
  args.qkv = qkv.data_ptr();
  args.qkv_stride_b = qkv.stride(0);
  args.qkv_stride_t = qkv.stride(1);
  args.conv_weight = weight.data_ptr();
  args.grad_q = gq.data_ptr<float>();
  args.grad_k = gk.data_ptr<float>();
  args.grad_v = gv.data_ptr<float>();
  args.grad_qkv = grad_qkv.data_ptr();
  args.grad_conv_weight = grad_weight_sum.data_ptr<float>();
  check_launch(kernels::launch_pre_gdr_full_fusion_backward(
                   args, c10::cuda::getCurrentCUDAStream().stream()),
               "backward");
  at::Tensor grad_weight = grad_weight_sum.view(conv_weight.sizes()).to(conv_weight.scalar_type());
  auto [da, db, dA_log, ddt_bias] = pre_gdr_gate_backward(grad_g, grad_beta, a, b, A_log, dt_bias);
  return {grad_qkv, grad_weight, da, db, dA_log, ddt_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("pre_gdr_full_fusion", &forward_cuda);
  m.impl("pre_gdr_full_fusion_backward", &backward_cuda);
}

}  // namespace gdr
