// The full pre-GDR fusion op: schema, argument checks, the CPU refusal, autograd and the
// unfused composite. The CUDA implementation registers itself from
// pre_gdr_full_fusion_cuda.cc (linked into CUDA binaries through //ops:cuda_ops).
#include "ops/pre_gdr_gate/pre_gdr_full_fusion_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "kernels/pre_gdr_gate/pre_gdr_full_fusion.h"
#include "kernels/pre_gdr_gate/pre_gdr_full_fusion_math.h"
#include "ops/policy/determinism.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_internal.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

namespace gdr {
namespace {

constexpr int64_t kConvTaps = kernels::kFullFusionConvTaps;

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

kernels::FullFusionShape full_fusion_shape(const at::Tensor& qkv, const GdnHeads& heads) {
  kernels::FullFusionShape s;
  s.batch = qkv.size(0);
  s.seq = qkv.size(1);
  s.num_k_heads = heads.num_k_heads;
  s.num_v_heads = heads.num_v_heads;
  s.head_k_dim = heads.head_k_dim;
  s.head_v_dim = heads.head_v_dim;
  return s;
}

}  // namespace

void check_pre_gdr_full_fusion_inputs(const at::Tensor& qkv, const at::Tensor& conv_weight,
                                      const at::Tensor& a, const at::Tensor& b,
                                      const at::Tensor& A_log, const at::Tensor& dt_bias,
                                      const GdnHeads& heads) {
  const int64_t Hk = heads.num_k_heads, Hv = heads.num_v_heads;
  TORCH_CHECK(Hk > 0 && Hv > 0 && heads.head_k_dim > 0 && heads.head_v_dim > 0,
              "pre_gdr_full_fusion: expected positive head counts and dims but got Hk = ", Hk,
              ", Hv = ", Hv, ", dk = ", heads.head_k_dim, ", dv = ", heads.head_v_dim);
  TORCH_CHECK(Hv % Hk == 0,
              "pre_gdr_full_fusion: expected num_v_heads a multiple of num_k_heads (Hv % Hk == 0) "
              "but got Hv = ",
              Hv, ", Hk = ", Hk);
  TORCH_CHECK(qkv.defined(), "pre_gdr_full_fusion: qkv is undefined");
  TORCH_CHECK(qkv.dim() == 3, "pre_gdr_full_fusion: expected qkv of shape [B, T, C] but got ",
              qkv.dim(), " dimensions ", qkv.sizes());
  const int64_t C = heads.conv_dim();
  TORCH_CHECK(qkv.size(2) == C,
              "pre_gdr_full_fusion: expected qkv's last dimension C = ", "2*Hk*dk + Hv*dv = ", C,
              " but got ", qkv.size(2), " (qkv.shape = ", qkv.sizes(), ")");
  TORCH_CHECK(qkv.size(0) > 0 && qkv.size(1) > 0,
              "pre_gdr_full_fusion: expected qkv with at least one token but got shape ",
              qkv.sizes());
  TORCH_CHECK(is_supported_dtype(qkv.scalar_type()),
              "pre_gdr_full_fusion: expected qkv of dtype Float, Half or BFloat16 but got ",
              qkv.scalar_type());
  TORCH_CHECK(conv_weight.defined(), "pre_gdr_full_fusion: conv_weight is undefined");
  TORCH_CHECK(conv_weight.dim() == 3 && conv_weight.size(0) == C && conv_weight.size(1) == 1,
              "pre_gdr_full_fusion: expected conv_weight of shape [C, 1, K] = [", C,
              ", 1, 4] (depthwise) but got ", conv_weight.sizes());
  TORCH_CHECK(conv_weight.size(2) == kConvTaps,
              "pre_gdr_full_fusion: expected conv kernel size 4 (conv_weight.size(2)) but got ",
              conv_weight.size(2));
  TORCH_CHECK(conv_weight.scalar_type() == qkv.scalar_type(),
              "pre_gdr_full_fusion: expected conv_weight of dtype ", qkv.scalar_type(),
              " (same as qkv) but got ", conv_weight.scalar_type());
  TORCH_CHECK(conv_weight.device() == qkv.device(), "pre_gdr_full_fusion: conv_weight is on ",
              conv_weight.device(), " but qkv is on ", qkv.device(),
              "; expected all tensors on one device");
  const std::string problem = kernels::validate_full_fusion_shape(full_fusion_shape(qkv, heads));
  TORCH_CHECK(problem.empty(), "pre_gdr_full_fusion: ", problem);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{a, "a"},
                                std::pair<const at::Tensor&, const char*>{b, "b"}}) {
    TORCH_CHECK(t.defined(), "pre_gdr_full_fusion: ", name, " is undefined");
    TORCH_CHECK(
        t.dim() == 3 && t.size(0) == qkv.size(0) && t.size(1) == qkv.size(1) && t.size(2) == Hv,
        "pre_gdr_full_fusion: expected ", name, " of shape [B, T, Hv] = [", qkv.size(0), ", ",
        qkv.size(1), ", ", Hv, "] but got ", t.sizes());
    TORCH_CHECK(t.device() == qkv.device(), "pre_gdr_full_fusion: ", name, " is on ", t.device(),
                " but qkv is on ", qkv.device(), "; expected all tensors on one device");
  }
  // The gate alone takes Double on the CPU (Note [Gate FP64 on the CPU]); this op does not.
  TORCH_CHECK(!A_log.defined() || A_log.scalar_type() != at::kDouble,
              "pre_gdr_full_fusion: expected A_log of dtype Float, Half or BFloat16 (the fused "
              "op has no FP64 path) but got Double");
  gate_internal::check_forward_inputs(a, b, A_log, dt_bias);
}

void check_pre_gdr_full_fusion_not_deterministic(const char* when) {
  TORCH_CHECK(!use_deterministic_mode(), "pre_gdr_full_fusion: ", when,
              " with deterministic mode on (use_deterministic_mode()), but the fully fused "
              "path sums the conv-weight gradient with atomicAdd and has no ordered variant; "
              "use pre_gdr_fusion: gate or none (deterministic_mode rejects pre_gdr_fusion: "
              "full)");
}

namespace {

void check_grad(const at::Tensor& grad, const char* name, at::IntArrayRef expected,
                const at::Tensor& qkv) {
  TORCH_CHECK(grad.defined(), "pre_gdr_full_fusion_backward: ", name, " is undefined");
  TORCH_CHECK(grad.scalar_type() == at::kFloat, "pre_gdr_full_fusion_backward: expected ", name,
              " of dtype Float (the outputs are FP32) but got ", grad.scalar_type());
  TORCH_CHECK(grad.sizes() == expected, "pre_gdr_full_fusion_backward: expected ", name,
              " of shape ", expected, " but got ", grad.sizes());
  TORCH_CHECK(grad.device() == qkv.device(), "pre_gdr_full_fusion_backward: ", name, " is on ",
              grad.device(), " but qkv is on ", qkv.device());
}

GdnHeads heads_from(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) { return {Hk, Hv, dk, dv}; }

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void refuse_cpu(const at::Tensor& qkv) {
  TORCH_CHECK(false, "pre_gdr_full_fusion: full pre-GDR fusion is CUDA only, but qkv is on ",
              qkv.device(),
              "; use pre_gdr_fusion: gate or none on CPU (the math's plain C++ reference is "
              "gdr::kernels::pre_gdr_full_fusion_forward_reference)");
}

ForwardResult forward_cpu(const at::Tensor& qkv, const at::Tensor& conv_weight, const at::Tensor& a,
                          const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                          int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) {
  check_pre_gdr_full_fusion_inputs(qkv, conv_weight, a, b, A_log, dt_bias,
                                   heads_from(Hk, Hv, dk, dv));
  refuse_cpu(qkv);
  return {};
}

BackwardResult backward_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor& qkv,
                            const at::Tensor& conv_weight, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& A_log, const at::Tensor& dt_bias, int64_t Hk,
                            int64_t Hv, int64_t dk, int64_t dv) {
  check_pre_gdr_full_fusion_inputs(qkv, conv_weight, a, b, A_log, dt_bias,
                                   heads_from(Hk, Hv, dk, dv));
  refuse_cpu(qkv);
  return {};
}

const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gdr::pre_gdr_full_fusion", "")
          .typed<ForwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               int64_t, int64_t, int64_t)>();
  return op;
}

const auto& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gdr::pre_gdr_full_fusion_backward", "")
          .typed<BackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                                int64_t)>();
  return op;
}

class PreGdrFullFusionFunction : public torch::autograd::Function<PreGdrFullFusionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& qkv,
                                                const at::Tensor& conv_weight, const at::Tensor& a,
                                                const at::Tensor& b, const at::Tensor& A_log,
                                                const at::Tensor& dt_bias, int64_t Hk, int64_t Hv,
                                                int64_t dk, int64_t dv) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q, k, v, g, beta] =
        forward_op().call(qkv, conv_weight, a, b, A_log, dt_bias, Hk, Hv, dk, dv);
    // Inputs only: the backward recomputes the conv, SiLU and norms from qkv (cheaper than
    // keeping the FP32 intermediates), and g / beta from a, b.
    ctx->save_for_backward({qkv, conv_weight, a, b, A_log, dt_bias});
    ctx->saved_data["Hk"] = Hk;
    ctx->saved_data["Hv"] = Hv;
    ctx->saved_data["dk"] = dk;
    ctx->saved_data["dv"] = dv;
    return {q, k, v, g, beta};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& qkv = saved[0];
    const int64_t Hk = ctx->saved_data["Hk"].toInt(), Hv = ctx->saved_data["Hv"].toInt();
    const int64_t dk = ctx->saved_data["dk"].toInt(), dv = ctx->saved_data["dv"].toInt();
    const int64_t B = qkv.size(0), T = qkv.size(1);
    const auto f32 = qkv.options().dtype(at::kFloat);
    auto or_zeros = [&](const at::Tensor& grad, at::IntArrayRef shape) {
      return grad.defined() ? grad : at::zeros(shape, f32);
    };
    const at::Tensor grad_q = or_zeros(grads[0], {B, T, Hv, dk});
    const at::Tensor grad_k = or_zeros(grads[1], {B, T, Hv, dk});
    const at::Tensor grad_v = or_zeros(grads[2], {B, T, Hv, dv});
    const at::Tensor grad_g = or_zeros(grads[3], {B, T, Hv});
    const at::Tensor grad_beta = or_zeros(grads[4], {B, T, Hv});
    auto [dqkv, dw, da, db, dA_log, ddt_bias] =
        backward_op().call(grad_q, grad_k, grad_v, grad_g, grad_beta, saved[0], saved[1], saved[2],
                           saved[3], saved[4], saved[5], Hk, Hv, dk, dv);
    return {dqkv,     dw,           da,           db,           dA_log,
            ddt_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

ForwardResult forward_autograd(const at::Tensor& qkv, const at::Tensor& conv_weight,
                               const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                               const at::Tensor& dt_bias, int64_t Hk, int64_t Hv, int64_t dk,
                               int64_t dv) {
  check_pre_gdr_full_fusion_inputs(qkv, conv_weight, a, b, A_log, dt_bias,
                                   heads_from(Hk, Hv, dk, dv));
  // Fail before the forward when a backward will follow: training would otherwise run a
  // whole forward before finding out.
  bool needs_grad = false;
  for (const at::Tensor* t : {&qkv, &conv_weight, &a, &b, &A_log, &dt_bias})
    needs_grad |= t->requires_grad();
  if (at::GradMode::is_enabled() && needs_grad) {
    check_pre_gdr_full_fusion_not_deterministic("a forward that needs gradients was called");
  }
  auto outputs =
      PreGdrFullFusionFunction::apply(qkv, conv_weight, a, b, A_log, dt_bias, Hk, Hv, dk, dv);
  return {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "pre_gdr_full_fusion(Tensor qkv, Tensor conv_weight, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim) -> "
      "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta)");
  m.def(
      "pre_gdr_full_fusion_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_g, "
      "Tensor grad_beta, Tensor qkv, Tensor conv_weight, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim) -> "
      "(Tensor grad_qkv, Tensor grad_conv_weight, Tensor grad_a, Tensor grad_b, "
      "Tensor grad_A_log, Tensor grad_dt_bias)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("pre_gdr_full_fusion", &forward_cpu);
  m.impl("pre_gdr_full_fusion_backward", &backward_cpu);
}

TORCH_LIBRARY_IMPL(gdr, Autograd, m) { m.impl("pre_gdr_full_fusion", &forward_autograd); }

GdrInputs pre_gdr_full_fusion(const at::Tensor& qkv, const at::Tensor& conv_weight,
                              const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, const GdnHeads& heads) {
  auto [q, k, v, g, beta] =
      forward_op().call(qkv, conv_weight, a, b, A_log, dt_bias, heads.num_k_heads,
                        heads.num_v_heads, heads.head_k_dim, heads.head_v_dim);
  return {q, k, v, g, beta};
}

PreGdrFullFusionGrads pre_gdr_full_fusion_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v,
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& qkv,
    const at::Tensor& conv_weight, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias, const GdnHeads& heads) {
  auto [dqkv, dw, da, db, dA_log, ddt_bias] = backward_op().call(
      grad_q, grad_k, grad_v, grad_g, grad_beta, qkv, conv_weight, a, b, A_log, dt_bias,
      heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim);
  return {dqkv, dw, da, db, dA_log, ddt_bias};
}

void check_pre_gdr_full_fusion_backward_grads(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                              const at::Tensor& grad_v, const at::Tensor& grad_g,
                                              const at::Tensor& grad_beta, const at::Tensor& qkv,
                                              const GdnHeads& heads) {
  const int64_t B = qkv.size(0), T = qkv.size(1), Hv = heads.num_v_heads;
  check_grad(grad_q, "grad_q", {B, T, Hv, heads.head_k_dim}, qkv);
  check_grad(grad_k, "grad_k", {B, T, Hv, heads.head_k_dim}, qkv);
  check_grad(grad_v, "grad_v", {B, T, Hv, heads.head_v_dim}, qkv);
  check_grad(grad_g, "grad_g", {B, T, Hv}, qkv);
  check_grad(grad_beta, "grad_beta", {B, T, Hv}, qkv);
}

GdrInputs pre_gdr_full_fusion_composite(const at::Tensor& qkv_in, const at::Tensor& conv_weight,
                                        const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& A_log, const at::Tensor& dt_bias,
                                        const GdnHeads& heads, bool fused_gate) {
  TORCH_CHECK(qkv_in.dim() == 3,
              "pre_gdr_full_fusion_composite: expected qkv of shape [B, T, C] but got ",
              qkv_in.sizes());
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1);
  const int64_t Hk = heads.num_k_heads, Hv = heads.num_v_heads;
  const int64_t dk = heads.head_k_dim, dv = heads.head_v_dim;
  const int64_t key_dim = Hk * dk, value_dim = Hv * dv;
  const int64_t taps = conv_weight.size(-1);
  // From here on, op for op models/qwen/layers.cc GatedDeltaNetImpl::forward with the
  // execution policy's causal_conv = aten (ops/causal_conv1d/causal_conv1d_op.cc:
  // causal_conv1d_silu_composite), then the L2 norm and head repeat of the core's
  // chunk_prep_qk (ops/gdr_core/chunk_prep_op.h).
  at::Tensor qkv = qkv_in.transpose(1, 2);  // [B, conv_dim, T]
  qkv = at::conv1d(at::constant_pad_nd(qkv, {taps - 1, 0}, 0.0), conv_weight,
                   /*bias=*/std::nullopt, /*stride=*/at::IntArrayRef{1},
                   /*padding=*/at::IntArrayRef{0}, /*dilation=*/at::IntArrayRef{1},
                   /*groups=*/qkv.size(1));
  qkv = at::silu(qkv).transpose(1, 2);  // [B, T, conv_dim]
  at::Tensor q = qkv.narrow(-1, 0, key_dim).reshape({B, T, Hk, dk});
  at::Tensor k = qkv.narrow(-1, key_dim, key_dim).reshape({B, T, Hk, dk});
  const at::ScalarType ct = qkv_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor v = qkv.narrow(-1, 2 * key_dim, value_dim).reshape({B, T, Hv, dv}).to(ct);
  auto l2_normalize = [&](const at::Tensor& x) {  // gdr::chunk_prep_qk's L2 norm, eps 1e-6
    const at::Tensor xf = x.to(ct);
    return xf * (xf.pow(2).sum(-1, /*keepdim=*/true) + 1e-6).rsqrt();
  };
  q = l2_normalize(q).to(ct);
  k = l2_normalize(k).to(ct);
  if (Hv > Hk) {
    q = q.repeat_interleave(Hv / Hk, /*dim=*/2);
    k = k.repeat_interleave(Hv / Hk, /*dim=*/2);
  }
  auto [g, beta] = fused_gate ? pre_gdr_gate(a, b, A_log, dt_bias)
                              : pre_gdr_gate_composite(a, b, A_log, dt_bias);
  return {q, k, v, g, beta};
}

}  // namespace gdr
