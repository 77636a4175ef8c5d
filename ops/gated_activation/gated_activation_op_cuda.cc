// CUDA implementation of the gated activation ops (ops/gated_activation/gated_activation_op.h):
// argument checks, each operand's segment layout (read in place where the kernels can), the outputs
// from the caching allocator, and one launch of kernels/gated_activation/gated_activation.cu each
// way on the current stream. Registered for the CUDA dispatch key; linked into CUDA binaries only
// (via :cuda_ops).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "kernels/gated_activation/gated_activation.h"
#include "ops/gated_activation/gated_activation_internal.h"
#include "ops/gated_activation/gated_activation_op.h"

namespace gdr {
namespace {

using gated_activation_internal::check_backward_inputs;
using gated_activation_internal::check_forward_inputs;

kernels::GatedDtype gated_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::GatedDtype::kFloat32;
    case at::kHalf: return kernels::GatedDtype::kFloat16;
    case at::kBFloat16: return kernels::GatedDtype::kBFloat16;
    default: TORCH_CHECK(false, "gated_activation: unsupported dtype ", t, " on CUDA");
  }
}

kernels::GatedActivation gated_kind(GatedActivationKind kind) {
  return kind == GatedActivationKind::kSilu ? kernels::GatedActivation::kSilu
                                            : kernels::GatedActivation::kSigmoid;
}

// Segments of a tensor whose last dim is contiguous and whose leading dims step uniformly
// (each stride = the next one's stride x size): element e at (e / L) * pitch + e % L with
// L = size(-1), pitch = stride(-2). A contiguous tensor is one segment.
bool segmented(const at::Tensor& t, int64_t& segment, int64_t& pitch) {
  if (t.is_contiguous()) {
    segment = pitch = t.numel();
    return true;
  }
  const int64_t d = t.dim();
  if (d < 2 || t.stride(d - 1) != 1) return false;
  for (int64_t k = 0; k + 2 < d; ++k) {
    if (t.size(k) != 1 && t.stride(k) != t.stride(k + 1) * t.size(k + 1)) return false;
  }
  segment = t.size(d - 1);
  pitch = t.stride(d - 2);
  return pitch >= segment;
}

// The operand as the kernels read it; `holder` keeps a contiguous copy alive when needed.
kernels::GatedOperand operand_of(const at::Tensor& t, at::Tensor& holder) {
  int64_t segment = 0, pitch = 0;
  if (segmented(t, segment, pitch)) return {t.data_ptr(), segment, pitch};
  holder = t.contiguous();
  return {holder.data_ptr(), holder.numel(), holder.numel()};
}

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "gated_activation: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

at::Tensor forward_cuda(const at::Tensor& gate, const at::Tensor& x, int64_t activation) {
  const GatedActivationKind kind = check_forward_inputs("gated_activation", gate, x, activation);
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor gate_holder, x_holder;
  kernels::GatedForwardArgs args;
  args.activation = gated_kind(kind);
  args.dtype = gated_dtype(x.scalar_type());
  args.numel = x.numel();
  if (args.numel > 0) {
    args.gate = operand_of(gate, gate_holder);
    args.x = operand_of(x, x_holder);
    args.y = y.data_ptr();
  }
  check_launch(
      kernels::launch_gated_activation_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
      "forward");
  return y;
}

std::tuple<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& grad_y, const at::Tensor& gate,
                                                 const at::Tensor& x, int64_t activation) {
  const GatedActivationKind kind =
      check_backward_inputs("gated_activation_backward", grad_y, gate, x, activation);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const at::Tensor dy = grad_y.contiguous();
  at::Tensor grad_gate =
      at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor grad_x = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor gate_holder, x_holder;
  kernels::GatedBackwardArgs args;
  args.activation = gated_kind(kind);
  args.dtype = gated_dtype(x.scalar_type());
  args.numel = x.numel();
  if (args.numel > 0) {
    args.grad_y = dy.data_ptr();
    args.gate = operand_of(gate, gate_holder);
    args.x = operand_of(x, x_holder);
    args.grad_gate = grad_gate.data_ptr();
    args.grad_x = grad_x.data_ptr();
  }
  check_launch(
      kernels::launch_gated_activation_backward(args, c10::cuda::getCurrentCUDAStream().stream()),
      "backward");
  return {grad_gate, grad_x};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("gated_activation_forward", &forward_cuda);
  m.impl("gated_activation_backward", &backward_cuda);
}

}  // namespace gdr
