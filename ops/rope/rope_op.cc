// The partial RoPE ops: the composite (the model's reference numerics), the tables,
// schema, argument checks, the CPU implementation, autograd and the execution policy's
// rope switch. The CUDA implementation registers itself from rope_cuda.cc (linked only
// into CUDA binaries).
#include "ops/rope/rope_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>

#include "ops/packed/packed_documents.h"
#include "ops/rope/rope_internal.h"

namespace gdr {
namespace rope_internal {

void check_inputs(const char* op, const at::Tensor& x, const char* x_name, const at::Tensor& cos,
                  const at::Tensor& sin) {
  TORCH_CHECK(x.defined() && x.dim() == 4, op, ": expected ", x_name,
              " of shape [B, H, T, hd] but got ", x.defined() ? x.sizes() : at::IntArrayRef());
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble, op,
              ": expected ", x_name, " of dtype Float, Half, BFloat16 or Double, but got ", t);
  TORCH_CHECK(!x.is_cuda() || t != at::kDouble, op, ": ", x_name,
              " is Double on CUDA; expected Float, Half or BFloat16 (FP64 takes the composite)");
  for (const auto& [table, name] : {std::make_pair(&cos, "cos"), std::make_pair(&sin, "sin")}) {
    TORCH_CHECK(table->defined() && table->dim() == 2 && table->size(0) == x.size(2) &&
                    table->size(1) % 2 == 0 && table->size(1) >= 2 && table->size(1) <= x.size(3),
                op, ": expected ", name, " of shape [T, rotary_dim] with T = ", x.size(2),
                " and an even rotary_dim in [2, ", x.size(3), "], but got ",
                table->defined() ? table->sizes() : at::IntArrayRef());
    const at::ScalarType table_type = t == at::kDouble ? at::kDouble : at::kFloat;
    TORCH_CHECK(table->scalar_type() == table_type && table->device() == x.device(), op,
                ": expected ", name, " of dtype ", table_type, " on ", x.device(), " but got ",
                table->scalar_type(), " on ", table->device());
  }
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": expected sin of cos's shape ", cos.sizes(),
              " but got ", sin.sizes());
}

}  // namespace rope_internal

using rope_internal::check_inputs;

std::tuple<at::Tensor, at::Tensor> rope_tables(int64_t tokens, int64_t rotary_dim, double theta,
                                               const at::TensorOptions& options) {
  const bool fp64 = options.has_dtype() && options.dtype() == at::kDouble;
  const auto type = options.dtype(fp64 ? at::kDouble : at::kFloat);
  const at::Tensor inv_freq = at::arange(0, rotary_dim, 2, type)
                                  .div(static_cast<double>(rotary_dim))
                                  .mul(-std::log(theta))
                                  .exp();
  const at::Tensor freqs = at::arange(tokens, type).outer(inv_freq);  // [T, rotary_dim / 2]
  const at::Tensor angles = at::cat({freqs, freqs}, -1);              // [T, rotary_dim]
  return {angles.cos(), angles.sin()};
}

namespace {

void check_rope_args(const char* op, const at::Tensor& x, int64_t rotary_dim) {
  TORCH_CHECK(x.dim() == 4, op, ": expected x of shape [B, H, T, hd] but got ", x.sizes());
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= x.size(-1), op,
              ": expected an even rotary_dim in (0, ", x.size(-1), "] but got ", rotary_dim);
}

// The composite's formula on x with the tables given (autograd through ATen ops).
at::Tensor rope_with_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rotary_dim = cos.size(1), half = rotary_dim / 2;
  const at::Tensor rot = x.narrow(-1, 0, rotary_dim).to(cos.scalar_type());
  const at::Tensor pass = x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim);
  const at::Tensor rotated_half =
      at::cat({-rot.narrow(-1, half, half), rot.narrow(-1, 0, half)}, -1);
  const at::Tensor rope = (rot * cos + rotated_half * sin).to(x.scalar_type());
  return at::cat({rope, pass}, -1);
}

}  // namespace

at::Tensor partial_rope_composite(const at::Tensor& x, int64_t rotary_dim, double theta) {
  check_rope_args("partial_rope", x, rotary_dim);
  const auto [cos, sin] = rope_tables(x.size(2), rotary_dim, theta, x.options());
  return rope_with_tables(x, cos, sin);
}

namespace {

// ---------------------------------------------------------------------------
// CPU implementation: the composite's ATen ops, and for the backward the two terms
// autograd sums for them (g cos, and g sin moved back through the rotation).

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_inputs("rope", x, "x", cos, sin);
  return rope_with_tables(x, cos, sin);
}

at::Tensor backward_cpu(const at::Tensor& grad_y, const at::Tensor& cos, const at::Tensor& sin) {
  check_inputs("rope_backward", grad_y, "grad_y", cos, sin);
  const int64_t rotary_dim = cos.size(1), half = rotary_dim / 2;
  const at::Tensor g = grad_y.narrow(-1, 0, rotary_dim).to(cos.scalar_type());
  const at::Tensor g_sin = g * sin;
  const at::Tensor moved = at::cat({g_sin.narrow(-1, half, half), -g_sin.narrow(-1, 0, half)}, -1);
  const at::Tensor d_rot = (g * cos + moved).to(grad_y.scalar_type());
  return at::cat({d_rot, grad_y.narrow(-1, rotary_dim, grad_y.size(-1) - rotary_dim)}, -1);
}

// ---------------------------------------------------------------------------
// Autograd

using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<Signature>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gdr::rope", "").typed<Signature>();
  return op;
}

const c10::TypedOperatorHandle<Signature>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gdr::rope_backward", "").typed<Signature>();
  return op;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& cos,
                                                const at::Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = forward_op().call(x, cos, sin);
    ctx->save_for_backward({cos, sin});
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return {backward_op().call(grads[0], saved[0], saved[1]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor y");
  m.def("rope_backward(Tensor grad_y, Tensor cos, Tensor sin) -> Tensor grad_x");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("rope", &forward_cpu);
  m.impl("rope_backward", &backward_cpu);
}

at::Tensor partial_rope_fused(const at::Tensor& x, int64_t rotary_dim, double theta) {
  check_rope_args("partial_rope", x, rotary_dim);
  const auto [cos, sin] = rope_tables(x.size(2), rotary_dim, theta, x.options());
  return RopeFunction::apply(x, cos, sin)[0];
}

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return forward_op().call(x, cos, sin);
}

at::Tensor rope_backward(const at::Tensor& grad_y, const at::Tensor& cos, const at::Tensor& sin) {
  return backward_op().call(grad_y, cos, sin);
}

at::Tensor partial_rope(const at::Tensor& x, int64_t rotary_dim, double theta) {
  const at::ScalarType t = x.scalar_type();
  const bool fusable = x.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
  if (fusable && current_execution_policy().rope == RopeImpl::kFused)
    return partial_rope_fused(x, rotary_dim, theta);
  return partial_rope_composite(x, rotary_dim, theta);
}

at::Tensor partial_rope_varlen(const at::Tensor& x, int64_t rotary_dim, double theta,
                               const std::vector<int64_t>& cu_seqlens) {
  const char* op = "partial_rope_varlen";
  TORCH_CHECK(x.defined() && x.dim() == 4 && x.size(0) == 1, op,
              ": expected packed x of shape [1, H, T, hd] but got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  std::vector<at::Tensor> outputs;  // [1, length, H, hd] each
  for (const at::Tensor& document : split_documents(op, x, 2, cu_seqlens)) {
    if (document.size(2) == 0) continue;
    outputs.push_back(partial_rope(document, rotary_dim, theta).transpose(1, 2));
  }
  if (outputs.empty()) return partial_rope(x, rotary_dim, theta);  // T = 0
  return at::cat(outputs, /*dim=*/1).transpose(1, 2);
}

}  // namespace gdr
