// The causal attention op: schema, argument checks, the reference (the CPU
// implementation), autograd, and the choice between cuDNN and ATen's SDPA (Note [Attention
// backends] in attention.h). The CUDA implementation registers itself from
// attention_cuda.cc (linked only into CUDA binaries).
#include "ops/attention/attention_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/triu.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <limits>
#include <optional>

#include "ops/attention/attention_internal.h"
#include "ops/packed/packed_documents.h"

namespace gdr {
namespace attention_internal {

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double scale) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  const char* names[] = {"q", "k", "v"};
  const at::Tensor* tensors[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& t = *tensors[i];
    TORCH_CHECK(t.dim() == 4, op, ": expected ", names[i],
                " of rank 4 ([B, heads, T, D]), but got shape ", t.sizes());
    const at::ScalarType s = t.scalar_type();
    TORCH_CHECK(s == at::kBFloat16 || s == at::kHalf || s == at::kFloat || s == at::kDouble, op,
                ": expected ", names[i], " of dtype BFloat16, Half, Float or Double, but got ", s);
    TORCH_CHECK(s == q.scalar_type(), op, ": expected ", names[i], " of dtype ", q.scalar_type(),
                " (q's), but got ", s);
    TORCH_CHECK(t.device() == q.device(), op, ": ", names[i], " is on ", t.device(),
                " but q is on ", q.device(), "; expected all tensors on one device");
  }
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": expected v of shape ", k.sizes(), " (k's), but got ",
              v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0), op, ": expected k with batch ", q.size(0), " (q's), but got ",
              k.size(0));
  TORCH_CHECK(k.size(2) == q.size(2), op, ": expected k with sequence length ", q.size(2),
              " (q's; causal self-attention), but got ", k.size(2));
  TORCH_CHECK(k.size(3) == q.size(3), op, ": expected k with head_dim ", q.size(3),
              " (q's), but got ", k.size(3));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
              ": expected q's head count to be a multiple of k's (grouped-query attention), but "
              "got ",
              q.size(1), " query heads and ", k.size(1), " key heads");
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), op,
              ": expected a positive finite scale, but got ", scale);
}

void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                           const at::Tensor& logsumexp, double scale) {
  check_inputs(op, q, k, v, scale);
  TORCH_CHECK(out.defined() && out.sizes() == q.sizes(), op, ": expected out of shape ", q.sizes(),
              " (q's), but got ", out.defined() ? out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), op, ": expected out of dtype ", q.scalar_type(),
              ", but got ", out.scalar_type());
  TORCH_CHECK(grad_out.defined() && grad_out.sizes() == q.sizes(), op,
              ": expected grad_out of shape ", q.sizes(), " (q's), but got ",
              grad_out.defined() ? grad_out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_out.scalar_type() == q.scalar_type(), op, ": expected grad_out of dtype ",
              q.scalar_type(), ", but got ", grad_out.scalar_type());
  const at::IntArrayRef rows = q.sizes().slice(0, 3);
  TORCH_CHECK(logsumexp.defined() && logsumexp.sizes() == rows, op,
              ": expected logsumexp of shape ", rows, " ([B, Hq, T]), but got ",
              logsumexp.defined() ? logsumexp.sizes() : at::IntArrayRef{});
  const at::ScalarType stats_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(logsumexp.scalar_type() == stats_type, op, ": expected logsumexp of dtype ",
              stats_type, ", but got ", logsumexp.scalar_type());
  for (const at::Tensor* t : {&grad_out, &out, &logsumexp}) {
    TORCH_CHECK(t->device() == q.device(), op, ": all tensors must be on q's device ", q.device(),
                ", but one is on ", t->device());
  }
}

}  // namespace attention_internal

namespace {

using attention_internal::check_backward_inputs;
using attention_internal::check_inputs;

at::ScalarType math_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Keys and values repeated over each key head's query group: [B, Hq, T, D].
at::Tensor expand_groups(const at::Tensor& t, int64_t q_heads) {
  const int64_t group = q_heads / t.size(1);
  if (group == 1) return t;
  return t.unsqueeze(2)
      .expand({t.size(0), t.size(1), group, t.size(2), t.size(3)})
      .reshape({t.size(0), q_heads, t.size(2), t.size(3)});
}

// Sums a [B, Hq, T, D] gradient over each key head's query group: [B, Hkv, T, D].
at::Tensor sum_groups(const at::Tensor& t, int64_t kv_heads) {
  const int64_t group = t.size(1) / kv_heads;
  if (group == 1) return t;
  return t.reshape({t.size(0), kv_heads, group, t.size(2), t.size(3)}).sum(2);
}

// scale * q k^T with the future masked to -inf, in the math type: [B, Hq, T, T].
at::Tensor masked_scores(const at::Tensor& qf, const at::Tensor& kf, double scale) {
  const int64_t T = qf.size(2);
  const at::Tensor future =
      at::triu(at::ones({T, T}, qf.options().dtype(at::kBool)), /*diagonal=*/1);
  return at::matmul(qf, kf.transpose(-2, -1))
      .mul_(scale)
      .masked_fill_(future, -std::numeric_limits<double>::infinity());
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, double scale) {
  return causal_attention_reference_forward(q, k, v, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double scale) {
  return causal_attention_reference_backward(grad_out, q, k, v, out, logsumexp, scale);
}

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, double);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double);
using ReasonSignature = std::string(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    double);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::causal_attention_forward", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::causal_attention_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<ReasonSignature>& unsupported_reason_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::causal_attention_unsupported_reason", "")
                             .typed<ReasonSignature>();
  return op;
}

class CausalAttentionFunction : public torch::autograd::Function<CausalAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, double scale) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, logsumexp] = forward_op().call(q, k, v, scale);
    ctx->save_for_backward({q, k, v, out, logsumexp});
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({logsumexp});
    return {out, logsumexp};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_q, grad_k, grad_v] =
        backward_op().call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                           ctx->saved_data["scale"].toDouble());
    return {grad_q, grad_k, grad_v, at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_attention_reference_forward(const at::Tensor& q,
                                                                      const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      double scale) {
  check_inputs("causal_attention_forward", q, k, v, scale);
  const at::ScalarType math = math_type(q);
  const int64_t q_heads = q.size(1);
  const at::Tensor qf = q.to(math);
  const at::Tensor kf = expand_groups(k.to(math), q_heads);
  const at::Tensor vf = expand_groups(v.to(math), q_heads);
  const at::Tensor scores = masked_scores(qf, kf, scale);
  at::Tensor logsumexp = at::logsumexp(scores, -1);  // [B, Hq, T]; the diagonal is never masked
  const at::Tensor probs = at::exp(scores - logsumexp.unsqueeze(-1));
  return {at::matmul(probs, vf).to(q.scalar_type()), logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_reference_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double scale) {
  check_backward_inputs("causal_attention_backward", grad_out, q, k, v, out, logsumexp, scale);
  const at::ScalarType math = math_type(q);
  const int64_t q_heads = q.size(1), kv_heads = k.size(1);
  const at::Tensor qf = q.to(math);
  const at::Tensor kf = expand_groups(k.to(math), q_heads);
  const at::Tensor vf = expand_groups(v.to(math), q_heads);
  const at::Tensor dout = grad_out.to(math);
  const at::Tensor probs = at::exp(masked_scores(qf, kf, scale) - logsumexp.unsqueeze(-1));
  // dS = P * (dP - rowsum(dO * O)), with dP = dO V^T: the softmax backward in the form the
  // flash kernels use (the row sum from the forward's output, not from P dP).
  const at::Tensor row_dot = (dout * out.to(math)).sum(-1, /*keepdim=*/true);
  const at::Tensor grad_scores = probs * (at::matmul(dout, vf.transpose(-2, -1)) - row_dot);
  const at::Tensor grad_q = at::matmul(grad_scores, kf).mul_(scale);
  const at::Tensor grad_k = at::matmul(grad_scores.transpose(-2, -1), qf).mul_(scale);
  const at::Tensor grad_v = at::matmul(probs.transpose(-2, -1), dout);
  return {grad_q.to(q.scalar_type()), sum_groups(grad_k, kv_heads).to(k.scalar_type()),
          sum_groups(grad_v, kv_heads).to(v.scalar_type())};
}

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "causal_attention_forward(Tensor q, Tensor k, Tensor v, float scale) -> "
      "(Tensor out, Tensor logsumexp)");
  m.def(
      "causal_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor logsumexp, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Empty when the CUDA implementation can run these inputs; otherwise why not.
  m.def("causal_attention_unsupported_reason(Tensor q, Tensor k, Tensor v, float scale) -> str");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("causal_attention_forward", &forward_cpu);
  m.impl("causal_attention_backward", &backward_cpu);
}

AttentionBackend attention_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, std::string* why_not_cudnn) {
  auto aten = [why_not_cudnn](std::string why) {
    if (why_not_cudnn != nullptr) *why_not_cudnn = std::move(why);
    return AttentionBackend::kAten;
  };
  if (current_execution_policy().attention == AttentionBackend::kAten)
    return aten("the attention implementation is aten");
  if (!q.is_cuda()) return aten("the tensors are not on a CUDA device");
  const at::ScalarType t = q.scalar_type();
  if (t != at::kBFloat16 && t != at::kHalf) return aten("cuDNN attention needs BFloat16 or Half");
  check_inputs("causal_attention", q, k, v, scale);
  std::string reason = unsupported_reason_op().call(q, k, v, scale);
  if (!reason.empty()) return aten(std::move(reason));
  return AttentionBackend::kCudnn;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  std::string why;
  if (attention_backend(q, k, v, scale, &why) == AttentionBackend::kCudnn) {
    return CausalAttentionFunction::apply(q, k, v, scale)[0];
  }
  if (q.is_cuda() && current_execution_policy().attention != AttentionBackend::kAten) {
    TORCH_WARN_ONCE("causal_attention: using ATen's scaled_dot_product_attention, not cuDNN: ",
                    why);
  }
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, scale, /*enable_gqa=*/true);
}

at::Tensor causal_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, const std::vector<int64_t>& cu_seqlens) {
  const char* op = "causal_attention_varlen";
  const char* names[] = {"q", "k", "v"};
  const at::Tensor* tensors[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& t = *tensors[i];
    TORCH_CHECK(t.defined() && t.dim() == 4 && t.size(0) == 1 && t.size(2) == q.size(2), op,
                ": expected packed ", names[i],
                " of shape [1, heads, T, D] with T = ", q.dim() == 4 ? q.size(2) : -1,
                " (q's) but got ", t.defined() ? t.sizes() : at::IntArrayRef{});
  }
  const std::vector<at::Tensor> qs = split_documents(op, q, 2, cu_seqlens),
                                ks = split_documents(op, k, 2, cu_seqlens),
                                vs = split_documents(op, v, 2, cu_seqlens);
  std::vector<at::Tensor> outputs;  // [1, length, Hq, D] each
  for (size_t i = 0; i < qs.size(); ++i) {
    if (qs[i].size(2) == 0) continue;
    outputs.push_back(causal_attention(qs[i], ks[i], vs[i], scale).transpose(1, 2));
  }
  TORCH_CHECK(!outputs.empty(), op, ": expected at least one token but got T = 0");
  return at::cat(outputs, /*dim=*/1).transpose(1, 2);
}

}  // namespace gdr
