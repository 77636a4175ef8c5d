// CUDA implementation of the causal conv1d + SiLU op (ops/causal_conv1d/causal_conv1d_op.h):
// argument checks, the operand layouts, scratch from the caching allocator and the launches of
// kernels/causal_conv1d/causal_conv1d.cu on the current stream (forward: 1 launch; backward: the
// tile kernel and the ordered weight-gradient reduction, Note [Causal conv determinism]).
// Registered for the CUDA dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "ops/causal_conv1d/causal_conv1d_internal.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"

namespace gdr {
namespace {

using causal_conv1d_internal::check_backward_inputs;
using causal_conv1d_internal::check_forward_inputs;

void check_launch(int error, const char* op, const char* what) {
  TORCH_CHECK(error == cudaSuccess, op, ": ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

kernels::ConvDtype conv_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::ConvDtype::kFloat32;
    case at::kHalf: return kernels::ConvDtype::kFloat16;
    case at::kBFloat16: return kernels::ConvDtype::kBFloat16;
    default: TORCH_CHECK(false, "causal_conv1d_silu: unsupported dtype ", t, " on CUDA");
  }
}

// The kernels read [B, T, C] operands in place when the channel stride is 1 (any batch and
// token strides, e.g. a narrow() of a wider projection); otherwise one contiguous copy.
at::Tensor with_unit_channel_stride(const at::Tensor& t) {
  if (t.size(2) > 1 && t.stride(2) != 1) return t.contiguous();
  return t;
}

kernels::CausalConvShape shape_of(const at::Tensor& x, const at::Tensor& weight) {
  kernels::CausalConvShape shape;
  shape.batch = x.size(0);
  shape.seq = x.size(1);
  shape.channels = x.size(2);
  shape.taps = static_cast<int>(weight.size(2));
  return shape;
}

kernels::TokenOperand operand_of(const at::Tensor& t) {
  kernels::TokenOperand op;
  op.data = t.data_ptr();
  op.batch_stride = t.stride(0);
  op.token_stride = t.stride(1);
  return op;
}

at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& weight) {
  constexpr const char* kOp = "causal_conv1d_silu";
  check_forward_inputs(kOp, x, weight);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const at::Tensor x_in = with_unit_channel_stride(x);
  const at::Tensor w = weight.contiguous();  // [C, 1, K] == [C, K]
  at::Tensor y = at::empty(x.sizes(), x.options());
  kernels::CausalConvForwardArgs args;
  args.dtype = conv_dtype(x.scalar_type());
  args.shape = shape_of(x, weight);
  args.x = operand_of(x_in);
  args.weight = w.data_ptr();
  args.y = y.data_ptr();
  check_launch(
      kernels::launch_causal_conv1d_silu_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
      kOp, "forward");
  return y;
}

std::tuple<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                 const at::Tensor& weight) {
  constexpr const char* kOp = "causal_conv1d_silu_backward";
  check_backward_inputs(kOp, grad_y, x, weight);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor x_in = with_unit_channel_stride(x);
  const at::Tensor grad_in = with_unit_channel_stride(grad_y);
  const at::Tensor w = weight.contiguous();
  const kernels::CausalConvShape shape = shape_of(x, weight);
  const kernels::CausalConvBackwardLaunch launch =
      kernels::derive_causal_conv_backward_launch(shape);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = at::empty(weight.sizes(), weight.options());  // contiguous [C, 1, K]
  // Every slot is written by the backward kernel (Note [Causal conv determinism]): no fill.
  at::Tensor partials =
      at::empty({std::max<int64_t>(launch.scratch_floats, 1)}, x.options().dtype(at::kFloat));
  kernels::CausalConvBackwardArgs args;
  args.dtype = conv_dtype(x.scalar_type());
  args.shape = shape;
  args.grad_y = operand_of(grad_in);
  args.x = operand_of(x_in);
  args.weight = w.data_ptr();
  args.dx = dx.data_ptr();
  args.partials = partials.data_ptr<float>();
  check_launch(kernels::launch_causal_conv1d_silu_backward(args, stream), kOp, "backward");
  check_launch(kernels::launch_causal_conv1d_reduce_partials(
                   args.partials, launch.programs, shape.channels * shape.taps,
                   conv_dtype(weight.scalar_type()), dw.data_ptr(), stream),
               kOp, "weight-gradient reduction");
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("causal_conv1d_silu_forward", &forward_cuda);
  m.impl("causal_conv1d_silu_backward", &backward_cuda);
}

}  // namespace gdr
