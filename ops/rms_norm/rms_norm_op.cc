// The RMSNorm ops: schema, argument checks, the compositions (references), the CPU
// implementation and autograd (the fused/composite choice is the execution policy's
// kernels.rms_norm). The CUDA implementation
// registers itself from rms_norm_cuda.cc (linked only into CUDA binaries).
#include "ops/rms_norm/rms_norm_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

#include "kernels/rms_norm/rms_norm.h"
#include "ops/policy/autograd_policy.h"
#include "ops/rms_norm/rms_norm_internal.h"

namespace gdr {
namespace rms_norm_internal {
namespace {

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

void check_tensor(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x,
                  const char* x_name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": expected ", name,
              " of dtype Float, Half, BFloat16 or Double, but got ", t.scalar_type());
  TORCH_CHECK(!t.is_cuda() || t.scalar_type() != at::kDouble, op, ": ", name,
              " is Double on CUDA; expected Float, Half or BFloat16 (FP64 takes the composite)");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but ", x_name,
              " is on ", x.device(), "; expected all tensors on one device");
}

}  // namespace

void check_forward_inputs(const char* op, const at::Tensor& x, const char* x_name,
                          const at::Tensor* z, const at::Tensor& weight) {
  TORCH_CHECK(x.defined(), op, ": ", x_name, " is undefined");
  TORCH_CHECK(x.dim() >= 1, op, ": expected ", x_name,
              " of shape [..., D] with at least one dimension, but got a 0-dim tensor");
  check_tensor(op, x, x_name, x, x_name);
  const int64_t D = x.size(-1);
  TORCH_CHECK(D >= 1, op, ": expected a last dim (D) of ", x_name, " of at least 1, but got shape ",
              x.sizes());
  TORCH_CHECK(!x.is_cuda() || kernels::rms_norm_supports_cols(D), op,
              ": expected the last dim (D) of ", x_name, " in [1, ", kernels::kRmsNormMaxCols,
              "] on CUDA, but got ", D);
  check_tensor(op, weight, "weight", x, x_name);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, op, ": expected weight of shape [", D,
              "] (D = ", x_name, ".size(-1)), but got ", weight.sizes());
  if (z != nullptr) {
    check_tensor(op, *z, "z", x, x_name);
    TORCH_CHECK(z->sizes() == x.sizes(), op, ": expected z of shape ", x.sizes(), " (same as ",
                x_name, "), but got ", z->sizes());
  }
}

void check_backward_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                           const char* x_name, const at::Tensor* z, const at::Tensor& weight,
                           const at::Tensor& rstd) {
  check_forward_inputs(op, x, x_name, z, weight);
  check_tensor(op, grad_y, "grad_y", x, x_name);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), op, ": expected grad_y of shape ", x.sizes(),
              " (same as ", x_name, "), but got ", grad_y.sizes());
  TORCH_CHECK(rstd.defined(), op, ": rstd is undefined");
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  TORCH_CHECK(rstd.sizes() == rows_shape, op, ": expected rstd of shape ", rows_shape, " (", x_name,
              "'s shape without the last dim), but got ", rstd.sizes());
  const bool fp64_ok = !x.is_cuda();
  TORCH_CHECK(rstd.scalar_type() == at::kFloat || (fp64_ok && rstd.scalar_type() == at::kDouble),
              op, ": expected rstd of dtype Float (from the forward), but got ",
              rstd.scalar_type());
  TORCH_CHECK(rstd.device() == x.device(), op, ": rstd is on ", rstd.device(), " but ", x_name,
              " is on ", x.device(), "; expected all tensors on one device");
}

void check_same_as_x(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x,
                     const char* x_name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": expected ", name, " of shape ", x.sizes(),
              " (same as ", x_name, "), but got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": expected ", name, " of dtype ",
              x.scalar_type(), " (same as ", x_name, "), but got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but ", x_name,
              " is on ", x.device(), "; expected all tensors on one device");
}

bool check_add_backward_inputs(const char* op, const at::Tensor& grad_y,
                               const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
                               const at::Tensor& weight, const at::Tensor& rstd) {
  check_backward_inputs(op, grad_y, sum, "sum", nullptr, weight, rstd);
  const bool has_grad_sum = grad_sum.has_value() && grad_sum->defined();
  if (has_grad_sum) check_same_as_x(op, *grad_sum, "grad_sum", sum, "sum");
  return has_grad_sum;
}

}  // namespace rms_norm_internal

using rms_norm_internal::check_add_backward_inputs;
using rms_norm_internal::check_backward_inputs;
using rms_norm_internal::check_forward_inputs;
using rms_norm_internal::check_same_as_x;

// ---------------------------------------------------------------------------
// The compositions (moved from models/qwen/layers.cc): FP32 math, FP64 for Double inputs.

namespace {
// FP64 inputs stay FP64 (end-to-end FP64 runs, finite-difference tests); otherwise FP32.
at::ScalarType compute_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}
}  // namespace

at::Tensor zero_centered_rms_norm_composite(const at::Tensor& x, const at::Tensor& weight,
                                            double eps) {
  const at::ScalarType ct = compute_type(x);
  const at::Tensor xf = x.to(ct);
  const at::Tensor normed = xf * (xf.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  return (normed * (weight.to(ct) + 1.0)).to(x.scalar_type());
}

at::Tensor gated_rms_norm_composite(const at::Tensor& o, const at::Tensor& z,
                                    const at::Tensor& weight, double eps,
                                    at::ScalarType out_dtype) {
  TORCH_CHECK(o.sizes() == z.sizes(), "gated_rms_norm: expected z of shape ", o.sizes(),
              " (same as o) but got ", z.sizes());
  const at::ScalarType ct = compute_type(o);
  const at::Tensor of = o.to(ct);
  const at::Tensor normed = of * (of.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  return (normed * weight.to(ct) * at::silu(z.to(ct))).to(out_dtype);
}

// ---------------------------------------------------------------------------
// CPU implementation: the forward is the composition above op for op (same bits), the
// backward its analytic gradient in the same compute type.

namespace {

// Sum over every row of a [..., D] tensor: [D].
at::Tensor sum_rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}).sum(0); }

std::tuple<at::Tensor, at::Tensor> zero_centered_forward_cpu(const at::Tensor& x,
                                                             const at::Tensor& weight, double eps) {
  check_forward_inputs("zero_centered_rms_norm", x, "x", nullptr, weight);
  const at::ScalarType ct = compute_type(x);
  const at::Tensor xf = x.to(ct);
  const at::Tensor rstd = (xf.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  const at::Tensor y = (xf * rstd * (weight.to(ct) + 1.0)).to(x.scalar_type());
  return {y, rstd.squeeze(-1)};
}

std::tuple<at::Tensor, at::Tensor> zero_centered_backward_cpu(const at::Tensor& grad_y,
                                                              const at::Tensor& x,
                                                              const at::Tensor& weight,
                                                              const at::Tensor& rstd) {
  check_backward_inputs("zero_centered_rms_norm_backward", grad_y, x, "x", nullptr, weight, rstd);
  const at::ScalarType ct = compute_type(x);
  const at::Tensor r = rstd.to(ct).unsqueeze(-1);
  const at::Tensor n = x.to(ct) * r;
  const at::Tensor g = grad_y.to(ct);
  const at::Tensor dn = g * (weight.to(ct) + 1.0);
  const at::Tensor dx = r * (dn - n * (dn * n).mean(-1, /*keepdim=*/true));
  return {dx.to(x.scalar_type()), sum_rows(g * n).to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> gated_forward_cpu(const at::Tensor& o, const at::Tensor& z,
                                                     const at::Tensor& weight, double eps,
                                                     at::ScalarType out_dtype) {
  check_forward_inputs("gated_rms_norm", o, "o", &z, weight);
  const at::ScalarType ct = compute_type(o);
  const at::Tensor of = o.to(ct);
  const at::Tensor rstd = (of.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  const at::Tensor y = (of * rstd * weight.to(ct) * at::silu(z.to(ct))).to(out_dtype);
  return {y, rstd.squeeze(-1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_backward_cpu(const at::Tensor& grad_y,
                                                                  const at::Tensor& o,
                                                                  const at::Tensor& z,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& rstd) {
  check_backward_inputs("gated_rms_norm_backward", grad_y, o, "o", &z, weight, rstd);
  const at::ScalarType ct = compute_type(o);
  const at::Tensor r = rstd.to(ct).unsqueeze(-1);
  const at::Tensor n = o.to(ct) * r;
  const at::Tensor zf = z.to(ct);
  const at::Tensor g = grad_y.to(ct);
  const at::Tensor w = weight.to(ct);
  const at::Tensor silu = at::silu(zf);
  const at::Tensor sig = at::sigmoid(zf);
  const at::Tensor dn = g * w * silu;
  const at::Tensor d_o = r * (dn - n * (dn * n).mean(-1, /*keepdim=*/true));
  const at::Tensor dz = g * n * w * (sig * (1.0 + zf * (1.0 - sig)));
  return {d_o.to(o.scalar_type()), dz.to(z.scalar_type()),
          sum_rows(g * n * silu).to(weight.scalar_type())};
}

// The residual add on the CPU: ATen's add, then the norm above; the backward adds the
// norm's dx (in the input dtype) and grad_sum as autograd's accumulation would.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_zero_centered_forward_cpu(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  constexpr const char* kOp = "add_zero_centered_rms_norm";
  check_forward_inputs(kOp, x, "x", nullptr, weight);
  check_same_as_x(kOp, residual, "residual", x, "x");
  const at::Tensor sum = x + residual;
  auto [y, rstd] = zero_centered_forward_cpu(sum, weight, eps);
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> add_zero_centered_backward_cpu(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd) {
  const bool has_grad_sum = check_add_backward_inputs("add_zero_centered_rms_norm_backward", grad_y,
                                                      grad_sum, sum, weight, rstd);
  auto [dx, dw] = zero_centered_backward_cpu(grad_y, sum, weight, rstd);
  if (has_grad_sum) dx = dx + *grad_sum;
  return {dx, dw};
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardZc = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
using BackwardZc = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&);
using ForwardGated = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double, at::ScalarType);
using BackwardGated = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

using ForwardAddZc = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                    const at::Tensor&,
                                                                    const at::Tensor&, double);
using BackwardAddZc = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                         const std::optional<at::Tensor>&,
                                                         const at::Tensor&, const at::Tensor&,
                                                         const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::TypedOperatorHandle<ForwardZc>& zc_forward_op() {
  static const auto op = find_op<ForwardZc>("gdr::zero_centered_rms_norm_forward");
  return op;
}
const c10::TypedOperatorHandle<BackwardZc>& zc_backward_op() {
  static const auto op = find_op<BackwardZc>("gdr::zero_centered_rms_norm_backward");
  return op;
}
const c10::TypedOperatorHandle<ForwardGated>& gated_forward_op() {
  static const auto op = find_op<ForwardGated>("gdr::gated_rms_norm_forward");
  return op;
}
const c10::TypedOperatorHandle<BackwardGated>& gated_backward_op() {
  static const auto op = find_op<BackwardGated>("gdr::gated_rms_norm_backward");
  return op;
}

const c10::TypedOperatorHandle<ForwardAddZc>& add_zc_forward_op() {
  static const auto op = find_op<ForwardAddZc>("gdr::add_zero_centered_rms_norm_forward");
  return op;
}
const c10::TypedOperatorHandle<BackwardAddZc>& add_zc_backward_op() {
  static const auto op = find_op<BackwardAddZc>("gdr::add_zero_centered_rms_norm_backward");
  return op;
}

// Outputs (y, sum); x and residual get the same gradient, the sum's.
class AddZeroCenteredRmsNormFunction
    : public torch::autograd::Function<AddZeroCenteredRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [y, sum, rstd] = add_zc_forward_op().call(x, residual, weight, eps);
    ctx->save_for_backward({sum, weight, rstd});
    return {y, sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad_y = grads[0];
    const at::Tensor& grad_sum = grads[1];
    if (!grad_y.defined()) return {grad_sum, grad_sum, at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    std::optional<at::Tensor> stream_grad;
    if (grad_sum.defined()) stream_grad = grad_sum;
    auto [dx, dw] = add_zc_backward_op().call(grad_y, stream_grad, saved[0], saved[1], saved[2]);
    return {dx, dx, dw, at::Tensor()};
  }
};

class ZeroCenteredRmsNormFunction : public torch::autograd::Function<ZeroCenteredRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& weight,
                                                double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [y, rstd] = zc_forward_op().call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    auto [dx, dw] = zc_backward_op().call(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

class GatedRmsNormFunction : public torch::autograd::Function<GatedRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& o, const at::Tensor& z,
                                                const at::Tensor& weight, double eps,
                                                at::ScalarType out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [y, rstd] = gated_forward_op().call(o, z, weight, eps, out_dtype);
    ctx->save_for_backward({o, z, weight, rstd});
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    auto [d_o, dz, dw] = gated_backward_op().call(grads[0], saved[0], saved[1], saved[2], saved[3]);
    return {d_o, dz, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "zero_centered_rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor "
      "rstd)");
  m.def(
      "zero_centered_rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> "
      "(Tensor dx, Tensor dw)");
  m.def(
      "add_zero_centered_rms_norm_forward(Tensor x, Tensor residual, Tensor weight, float eps) -> "
      "(Tensor y, Tensor sum, Tensor rstd)");
  m.def(
      "add_zero_centered_rms_norm_backward(Tensor grad_y, Tensor? grad_sum, Tensor sum, Tensor "
      "weight, Tensor rstd) -> (Tensor dx, Tensor dw)");
  m.def(
      "gated_rms_norm_forward(Tensor o, Tensor z, Tensor weight, float eps, ScalarType out_dtype) "
      "-> (Tensor y, Tensor rstd)");
  m.def(
      "gated_rms_norm_backward(Tensor grad_y, Tensor o, Tensor z, Tensor weight, Tensor rstd) -> "
      "(Tensor d_o, Tensor dz, Tensor dw)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("zero_centered_rms_norm_forward", &zero_centered_forward_cpu);
  m.impl("zero_centered_rms_norm_backward", &zero_centered_backward_cpu);
  m.impl("add_zero_centered_rms_norm_forward", &add_zero_centered_forward_cpu);
  m.impl("add_zero_centered_rms_norm_backward", &add_zero_centered_backward_cpu);
  m.impl("gated_rms_norm_forward", &gated_forward_cpu);
  m.impl("gated_rms_norm_backward", &gated_backward_cpu);
}

at::Tensor zero_centered_rms_norm_fused(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ZeroCenteredRmsNormFunction::apply(x, weight, eps)[0];
}

at::Tensor gated_rms_norm_fused(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight,
                                double eps, at::ScalarType out_dtype) {
  return GatedRmsNormFunction::apply(o, z, weight, eps, out_dtype)[0];
}

std::tuple<at::Tensor, at::Tensor> add_zero_centered_rms_norm_fused(const at::Tensor& x,
                                                                    const at::Tensor& residual,
                                                                    const at::Tensor& weight,
                                                                    double eps) {
  const auto outputs = AddZeroCenteredRmsNormFunction::apply(x, residual, weight, eps);
  return {outputs[0], outputs[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_zero_centered_rms_norm_forward(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  return add_zc_forward_op().call(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_zero_centered_rms_norm_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd) {
  return add_zc_backward_op().call(grad_y, grad_sum, sum, weight, rstd);
}

std::tuple<at::Tensor, at::Tensor> zero_centered_rms_norm_forward(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  double eps) {
  return zc_forward_op().call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> zero_centered_rms_norm_backward(const at::Tensor& grad_y,
                                                                   const at::Tensor& x,
                                                                   const at::Tensor& weight,
                                                                   const at::Tensor& rstd) {
  return zc_backward_op().call(grad_y, x, weight, rstd);
}

std::tuple<at::Tensor, at::Tensor> gated_rms_norm_forward(const at::Tensor& o, const at::Tensor& z,
                                                          const at::Tensor& weight, double eps,
                                                          at::ScalarType out_dtype) {
  return gated_forward_op().call(o, z, weight, eps, out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rms_norm_backward(const at::Tensor& grad_y,
                                                                       const at::Tensor& o,
                                                                       const at::Tensor& z,
                                                                       const at::Tensor& weight,
                                                                       const at::Tensor& rstd) {
  return gated_backward_op().call(grad_y, o, z, weight, rstd);
}

bool rms_norm_fused_supports(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return x.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && x.dim() >= 1 &&
         kernels::rms_norm_supports_cols(x.size(-1));
}

}  // namespace gdr
