// The gated activation ops: schema, argument checks, the composite (reference), the CPU
// implementation, autograd and the execution policy's gated_activation switch. The CUDA
// implementation registers itself from gated_activation_cuda.cc (linked only into CUDA
// binaries).
#include "ops/gated_activation/gated_activation_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sigmoid_backward.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/gated_activation/gated_activation_internal.h"

namespace gdr {
namespace gated_activation_internal {
namespace {

void check_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  const at::ScalarType s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble, op,
              ": expected ", name, " of dtype Float, Half, BFloat16 or Double, but got ", s);
  TORCH_CHECK(!t.is_cuda() || s != at::kDouble, op, ": ", name,
              " is Double on CUDA; expected Float, Half or BFloat16 (FP64 takes the composite)");
  TORCH_CHECK(s == x.scalar_type(), op, ": expected ", name, " of dtype ", x.scalar_type(),
              " (x's), but got ", s);
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; expected all tensors on one device");
}

}  // namespace

GatedActivationKind check_forward_inputs(const char* op, const at::Tensor& gate,
                                         const at::Tensor& x, int64_t activation) {
  TORCH_CHECK(activation == static_cast<int64_t>(GatedActivationKind::kSilu) ||
                  activation == static_cast<int64_t>(GatedActivationKind::kSigmoid),
              op, ": expected activation 0 (silu) or 1 (sigmoid), but got ", activation);
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  check_tensor(op, "x", x, x);
  check_tensor(op, "gate", gate, x);
  TORCH_CHECK(gate.numel() == x.numel(), op, ": expected gate with as many elements as x (",
              x.numel(), ", shape ", x.sizes(), "), but got ", gate.numel(), " (shape ",
              gate.sizes(), ")");
  return static_cast<GatedActivationKind>(activation);
}

GatedActivationKind check_backward_inputs(const char* op, const at::Tensor& grad_y,
                                          const at::Tensor& gate, const at::Tensor& x,
                                          int64_t activation) {
  const GatedActivationKind kind = check_forward_inputs(op, gate, x, activation);
  check_tensor(op, "grad_y", grad_y, x);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), op, ": expected grad_y of shape ", x.sizes(),
              " (same as x), but got ", grad_y.sizes());
  return kind;
}

}  // namespace gated_activation_internal

using gated_activation_internal::check_backward_inputs;
using gated_activation_internal::check_forward_inputs;

at::Tensor gated_activation_composite(const at::Tensor& gate, const at::Tensor& x,
                                      GatedActivationKind kind) {
  const at::Tensor g = gate.reshape(x.sizes());
  return kind == GatedActivationKind::kSilu ? at::silu(g) * x : x * g.sigmoid();
}

namespace {

// ---------------------------------------------------------------------------
// CPU implementation: the composite's ATen ops, and in the backward the ones autograd
// runs for it (mul's two products, silu_backward / sigmoid_backward), so the same bits.

at::Tensor forward_cpu(const at::Tensor& gate, const at::Tensor& x, int64_t activation) {
  const GatedActivationKind kind = check_forward_inputs("gated_activation", gate, x, activation);
  return gated_activation_composite(gate, x, kind);
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad_y, const at::Tensor& gate,
                                                const at::Tensor& x, int64_t activation) {
  const GatedActivationKind kind =
      check_backward_inputs("gated_activation_backward", grad_y, gate, x, activation);
  const at::Tensor g = gate.reshape(x.sizes());
  const at::Tensor a = kind == GatedActivationKind::kSilu ? at::silu(g) : at::sigmoid(g);
  const at::Tensor grad_x = grad_y * a;
  const at::Tensor da = grad_y * x;
  const at::Tensor grad_gate =
      kind == GatedActivationKind::kSilu ? at::silu_backward(da, g) : at::sigmoid_backward(da, a);
  return {grad_gate.reshape(gate.sizes()), grad_x};
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, int64_t);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::gated_activation_forward", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::gated_activation_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

class GatedActivationFunction : public torch::autograd::Function<GatedActivationFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& gate, const at::Tensor& x,
                                                int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = forward_op().call(gate, x, activation);
    ctx->save_for_backward({gate, x});
    ctx->saved_data["activation"] = activation;
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_gate, grad_x] =
        backward_op().call(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toInt());
    return {grad_gate, grad_x, at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def("gated_activation_forward(Tensor gate, Tensor x, int activation) -> Tensor y");
  m.def(
      "gated_activation_backward(Tensor grad_y, Tensor gate, Tensor x, int activation) -> "
      "(Tensor grad_gate, Tensor grad_x)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("gated_activation_forward", &forward_cpu);
  m.impl("gated_activation_backward", &backward_cpu);
}

at::Tensor gated_activation_fused(const at::Tensor& gate, const at::Tensor& x,
                                  GatedActivationKind kind) {
  return GatedActivationFunction::apply(gate, x, static_cast<int64_t>(kind))[0];
}

at::Tensor gated_activation_forward(const at::Tensor& gate, const at::Tensor& x,
                                    GatedActivationKind kind) {
  return forward_op().call(gate, x, static_cast<int64_t>(kind));
}

std::tuple<at::Tensor, at::Tensor> gated_activation_backward(const at::Tensor& grad_y,
                                                             const at::Tensor& gate,
                                                             const at::Tensor& x,
                                                             GatedActivationKind kind) {
  return backward_op().call(grad_y, gate, x, static_cast<int64_t>(kind));
}

at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& x, GatedActivationKind kind) {
  const at::ScalarType t = x.scalar_type();
  const bool fusable = x.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) &&
                       gate.scalar_type() == t && gate.device() == x.device();
  if (fusable && current_execution_policy().gated_activation == GatedActivationImpl::kFused) {
    return gated_activation_fused(gate, x, kind);
  }
  return gated_activation_composite(gate, x, kind);
}

}  // namespace gdr
