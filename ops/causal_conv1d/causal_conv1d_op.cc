// The causal conv1d + SiLU op: schema, argument checks, the composition (the reference),
// the CPU implementation, autograd and the execution policy's causal_conv switch. The CUDA
// implementation registers itself from causal_conv1d_cuda.cc (linked only into CUDA
// binaries).
#include "ops/causal_conv1d/causal_conv1d_op.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "ops/causal_conv1d/causal_conv1d_internal.h"
#include "ops/packed/packed_documents.h"

namespace gdr {
namespace causal_conv1d_internal {
namespace {

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

void check_tensor(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": expected ", name,
              " of dtype Float, Half, BFloat16 or Double, but got ", t.scalar_type());
  TORCH_CHECK(!t.is_cuda() || t.scalar_type() != at::kDouble, op, ": ", name,
              " is Double on CUDA; expected Float, Half or BFloat16 (FP64 takes the composite)");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; expected all tensors on one device");
}

}  // namespace

void check_forward_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(x.dim() == 3, op, ": expected x of shape [B, T, C], but got ", x.dim(),
              " dimensions ", x.sizes());
  check_tensor(op, x, "x", x);
  const int64_t C = x.size(2);
  TORCH_CHECK(C >= 1, op,
              ": expected at least one channel (C = x.size(2) >= 1), but got x of shape ",
              x.sizes());
  check_tensor(op, weight, "weight", x);
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == C && weight.size(1) == 1, op,
              ": expected weight of shape [C, 1, K] with C = x.size(2) = ", C, ", but got ",
              weight.sizes());
  const int64_t K = weight.size(2);
  TORCH_CHECK(K >= kernels::kCausalConvMinTaps && K <= kernels::kCausalConvMaxTaps, op,
              ": expected a kernel size K = weight.size(2) in [", kernels::kCausalConvMinTaps, ", ",
              kernels::kCausalConvMaxTaps, "], but got ", K);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": expected weight of dtype ",
              x.scalar_type(), " (x's dtype), but got ", weight.scalar_type());
}

void check_backward_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                           const at::Tensor& weight) {
  check_forward_inputs(op, x, weight);
  check_tensor(op, grad_y, "grad_y", x);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), op, ": expected grad_y of shape ", x.sizes(),
              " (same as x), but got ", grad_y.sizes());
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), op, ": expected grad_y of dtype ",
              x.scalar_type(), " (x's dtype), but got ", grad_y.scalar_type());
}

}  // namespace causal_conv1d_internal

using causal_conv1d_internal::check_backward_inputs;
using causal_conv1d_internal::check_forward_inputs;

// ---------------------------------------------------------------------------
// The composition (the reference: the model's numerics on the CPU and under the execution
// policy's causal_conv = aten).

at::Tensor causal_conv1d_silu_composite(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3,
              "causal_conv1d_silu_composite: expected x [B, T, C] and weight [C, 1, K], but got ",
              x.sizes(), " and ", weight.sizes());
  const int64_t taps = weight.size(2);
  // Causal depthwise conv over time: left pad K-1 so token t sees t-K+1..t only.
  const at::Tensor channels_first = x.transpose(1, 2);  // [B, C, T]
  const at::Tensor pre = at::conv1d(at::constant_pad_nd(channels_first, {taps - 1, 0}, 0.0), weight,
                                    /*bias=*/std::nullopt, /*stride=*/at::IntArrayRef{1},
                                    /*padding=*/at::IntArrayRef{0}, /*dilation=*/at::IntArrayRef{1},
                                    /*groups=*/channels_first.size(1));
  return at::silu(pre).transpose(1, 2);  // [B, T, C]
}

// ---------------------------------------------------------------------------
// CPU implementation: the composition above, forward op for op (same bits) and backward
// as ATen's autograd runs it (SiluBackward0, then ConvolutionBackward0 on the padded input,
// then the pad's and the transpose's backward: a narrow and a transpose).

namespace {

bool no_tokens(const at::Tensor& x) { return x.size(0) == 0 || x.size(1) == 0; }

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& weight) {
  check_forward_inputs("causal_conv1d_silu", x, weight);
  if (no_tokens(x)) return at::empty(x.sizes(), x.options());
  return causal_conv1d_silu_composite(x, weight).contiguous();
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                const at::Tensor& weight) {
  check_backward_inputs("causal_conv1d_silu_backward", grad_y, x, weight);
  if (no_tokens(x)) return {at::empty(x.sizes(), x.options()), at::zeros_like(weight)};
  const int64_t T = x.size(1), C = x.size(2), taps = weight.size(2);
  const at::Tensor padded = at::constant_pad_nd(x.transpose(1, 2), {taps - 1, 0}, 0.0);
  const at::Tensor pre = at::conv1d(padded, weight, /*bias=*/std::nullopt,
                                    /*stride=*/at::IntArrayRef{1}, /*padding=*/at::IntArrayRef{0},
                                    /*dilation=*/at::IntArrayRef{1}, /*groups=*/C);
  const at::Tensor grad_pre = at::silu_backward(grad_y.transpose(1, 2), pre);
  auto [grad_padded, grad_weight, grad_bias] = at::convolution_backward(
      grad_pre, padded, weight, /*bias_sizes=*/std::nullopt, /*stride=*/{1}, /*padding=*/{0},
      /*dilation=*/{1}, /*transposed=*/false, /*output_padding=*/{0}, /*groups=*/C,
      /*output_mask=*/{true, true, false});
  return {grad_padded.narrow(2, taps - 1, T).transpose(1, 2).contiguous(), grad_weight};
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = find_op<ForwardSignature>("gdr::causal_conv1d_silu_forward");
  return op;
}
const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = find_op<BackwardSignature>("gdr::causal_conv1d_silu_backward");
  return op;
}

class CausalConv1dSiluFunction : public torch::autograd::Function<CausalConv1dSiluFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& weight) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = forward_op().call(x, weight);
    ctx->save_for_backward({x, weight});
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dx, dw] = backward_op().call(grads[0], saved[0], saved[1]);
    return {dx, dw};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def("causal_conv1d_silu_forward(Tensor x, Tensor weight) -> Tensor y");
  m.def(
      "causal_conv1d_silu_backward(Tensor grad_y, Tensor x, Tensor weight) -> (Tensor dx, Tensor "
      "dweight)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("causal_conv1d_silu_forward", &forward_cpu);
  m.impl("causal_conv1d_silu_backward", &backward_cpu);
}

at::Tensor causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight) {
  return CausalConv1dSiluFunction::apply(x, weight)[0];
}

at::Tensor causal_conv1d_silu_forward(const at::Tensor& x, const at::Tensor& weight) {
  return forward_op().call(x, weight);
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_silu_backward(const at::Tensor& grad_y,
                                                               const at::Tensor& x,
                                                               const at::Tensor& weight) {
  return backward_op().call(grad_y, x, weight);
}

at::Tensor causal_conv1d_silu_varlen(const at::Tensor& x, const at::Tensor& weight,
                                     const std::vector<int64_t>& cu_seqlens, CausalConvImpl impl) {
  const char* op = "causal_conv1d_silu_varlen";
  TORCH_CHECK(x.defined() && x.dim() == 3 && x.size(0) == 1, op,
              ": expected packed x of shape [1, T, C] but got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  std::vector<at::Tensor> outputs;
  for (const at::Tensor& document : split_documents(op, x, 1, cu_seqlens)) {
    if (document.size(1) == 0) continue;
    outputs.push_back(impl == CausalConvImpl::kKernel
                          ? causal_conv1d_silu(document, weight)
                          : causal_conv1d_silu_composite(document, weight));
  }
  if (outputs.empty()) return causal_conv1d_silu_composite(x, weight).contiguous();  // T = 0
  return at::cat(outputs, /*dim=*/1);
}

// ---------------------------------------------------------------------------
// The switch

bool causal_conv1d_kernel_supports(const at::Tensor& x, const at::Tensor& weight) {
  if (!x.defined() || !weight.defined() || !x.is_cuda()) return false;
  const at::ScalarType t = x.scalar_type();
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return false;
  if (x.dim() != 3 || weight.dim() != 3 || weight.scalar_type() != t) return false;
  if (weight.device() != x.device()) return false;
  const int64_t taps = weight.size(2);
  return x.size(2) >= 1 && weight.size(0) == x.size(2) && weight.size(1) == 1 &&
         taps >= kernels::kCausalConvMinTaps && taps <= kernels::kCausalConvMaxTaps;
}

}  // namespace gdr
