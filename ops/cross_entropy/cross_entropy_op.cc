// The causal-LM cross-entropy ops: schema, argument checks, the composite (reference),
// the CPU implementation, autograd and what the execution policy's cross_entropy switch
// asks of the op (cross_entropy_fused_supports). The CUDA implementation registers itself
// from cross_entropy_cuda.cc (linked only into CUDA binaries).
#include "ops/cross_entropy/cross_entropy_op.h"

#include <ATen/core/Reduction.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/nll_loss_backward.h>
#include <ATen/ops/nll_loss_forward.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/cross_entropy/cross_entropy_internal.h"

namespace gdr {
namespace cross_entropy_internal {
namespace {

bool is_logits_dtype(const at::Tensor& t) {
  const at::ScalarType s = t.scalar_type();
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16 ||
         (s == at::kDouble && !t.is_cuda());
}

}  // namespace

at::ScalarType compute_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_inputs(const char* op, const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.defined(), op, ": logits is undefined");
  TORCH_CHECK(labels.defined(), op, ": labels is undefined");
  TORCH_CHECK(logits.dim() == 3, op,
              ": expected logits of shape [B, T, V] (3 dims), but got shape ", logits.sizes());
  TORCH_CHECK(is_logits_dtype(logits), op,
              ": expected logits of dtype Float, Half or BFloat16 (or Double on the CPU), but got ",
              logits.scalar_type(), " on ", logits.device());
  TORCH_CHECK(labels.dim() == 2, op, ": expected labels of shape [B, T] (2 dims), but got shape ",
              labels.sizes());
  TORCH_CHECK(labels.sizes() == logits.sizes().slice(0, 2), op, ": expected labels of shape ",
              logits.sizes().slice(0, 2), " (B, T of logits), but got ", labels.sizes());
  TORCH_CHECK(c10::isIntegralType(labels.scalar_type(), /*includeBool=*/false), op,
              ": expected labels of an integral dtype (Long or Int), but got ",
              labels.scalar_type());
  TORCH_CHECK(labels.device() == logits.device(), op, ": labels is on ", labels.device(),
              " but logits is on ", logits.device(), "; expected both on one device");
  TORCH_CHECK(logits.size(1) >= 2, op,
              ": expected T >= 2 tokens (logits.size(1)) to score a next token, but got T = ",
              logits.size(1));
  TORCH_CHECK(logits.size(2) >= 1, op,
              ": expected V >= 1 classes (logits.size(2)), but got V = ", logits.size(2));
}

void check_backward_inputs(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                           const at::Tensor& labels, const at::Tensor& lse,
                           const at::Tensor& count) {
  check_inputs(op, logits, labels);
  TORCH_CHECK(grad_loss.defined(), op, ": grad_loss is undefined");
  TORCH_CHECK(grad_loss.numel() == 1, op,
              ": expected grad_loss with one element (the gradient of the scalar loss), but got "
              "shape ",
              grad_loss.sizes());
  TORCH_CHECK(grad_loss.device() == logits.device(), op, ": grad_loss is on ", grad_loss.device(),
              " but logits is on ", logits.device(), "; expected both on one device");
  const int64_t B = logits.size(0), T = logits.size(1);
  TORCH_CHECK(lse.defined(), op, ": lse is undefined");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == B && lse.size(1) == T - 1, op,
              ": expected lse of shape [", B, ", ", T - 1, "] (B, T - 1 of logits), but got ",
              lse.sizes());
  const at::ScalarType stats = compute_type(logits);
  TORCH_CHECK(lse.scalar_type() == stats, op, ": expected lse of dtype ", stats,
              " (from the forward), but got ", lse.scalar_type());
  TORCH_CHECK(count.defined(), op, ": count is undefined");
  TORCH_CHECK(count.numel() == 1 && count.scalar_type() == stats, op, ": expected count as one ",
              stats, " element (from the forward), but got ", count.scalar_type(), " of shape ",
              count.sizes());
  TORCH_CHECK(lse.device() == logits.device() && count.device() == logits.device(), op,
              ": lse is on ", lse.device(), " and count on ", count.device(), " but logits is on ",
              logits.device(), "; expected all tensors on one device");
}

void check_targets(const char* op, const at::Tensor& targets, int64_t vocab, int64_t ignore_index) {
  const at::Tensor t = targets.contiguous();
  const int64_t B = t.size(0), scored = t.size(1);
  const int64_t* y = t.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < scored; ++i) {
      const int64_t v = y[b * scored + i];
      TORCH_CHECK(v == ignore_index || (v >= 0 && v < vocab), op, ": target ", v, " at labels[", b,
                  ", ", i + 1, "] is out of range for V = ", vocab,
                  "; expected a class index in [0, ", vocab, ") or ignore_index (", ignore_index,
                  ")");
    }
  }
}

}  // namespace cross_entropy_internal

using cross_entropy_internal::check_backward_inputs;
using cross_entropy_internal::check_inputs;
using cross_entropy_internal::check_targets;
using cross_entropy_internal::compute_type;

// ---------------------------------------------------------------------------
// The composite (moved from models/qwen/model.cc): FP32 math, FP64 for Double logits.

at::Tensor causal_lm_cross_entropy_composite(const at::Tensor& logits, const at::Tensor& labels,
                                             int64_t ignore_index) {
  const int64_t T = logits.size(1), V = logits.size(2);
  const at::Tensor scored = logits.narrow(1, 0, T - 1).to(compute_type(logits)).reshape({-1, V});
  const at::Tensor targets = labels.narrow(1, 1, T - 1).to(at::kLong).reshape({-1});
  return at::cross_entropy_loss(scored, targets, /*weight=*/{}, at::Reduction::Mean, ignore_index);
}

// ---------------------------------------------------------------------------
// CPU implementation: the ops at::cross_entropy_loss runs for class-index targets without
// label smoothing (log_softmax in the input's dtype, then nll_loss_forward), and in the
// backward the ops autograd runs through the composite, one for one (same bits).

namespace {

struct CpuScored {
  at::Tensor scored;       // [B * (T - 1), V] FP32 (FP64 for Double logits)
  at::Tensor targets;      // [B * (T - 1)] int64
  at::Tensor log_softmax;  // [B * (T - 1), V] as scored
};

CpuScored cpu_scored(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t T = logits.size(1), V = logits.size(2);
  const at::ScalarType ct = compute_type(logits);
  CpuScored s;
  s.scored = logits.narrow(1, 0, T - 1).to(ct).reshape({-1, V});
  s.targets = labels.narrow(1, 1, T - 1).to(at::kLong).reshape({-1});
  s.log_softmax = at::log_softmax(s.scored, 1, ct);
  return s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& logits,
                                                           const at::Tensor& labels,
                                                           int64_t ignore_index) {
  constexpr const char* kOp = "causal_lm_cross_entropy";
  check_inputs(kOp, logits, labels);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  check_targets(kOp, labels.narrow(1, 1, T - 1).to(at::kLong), V, ignore_index);
  const CpuScored s = cpu_scored(logits, labels);
  auto [loss, total_weight] = at::nll_loss_forward(s.log_softmax, s.targets, /*weight=*/{},
                                                   at::Reduction::Mean, ignore_index);
  const at::Tensor lse = at::logsumexp(s.scored, {1}).reshape({B, T - 1});
  return {loss, lse, total_weight};
}

at::Tensor backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                        const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& count,
                        int64_t ignore_index) {
  check_backward_inputs("causal_lm_cross_entropy_backward", grad_loss, logits, labels, lse, count);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  const CpuScored s = cpu_scored(logits, labels);
  const at::Tensor grad_nll = at::nll_loss_backward(
      grad_loss.to(s.scored.scalar_type()).reshape({}), s.log_softmax, s.targets, /*weight=*/{},
      at::Reduction::Mean, ignore_index, count.reshape({}));
  const at::Tensor grad_scored =
      at::_log_softmax_backward_data(grad_nll, s.log_softmax, 1, s.scored.scalar_type());
  // The cast's backward, then narrow's (zeros with the slice copied in).
  at::Tensor grad = at::zeros({B, T, V}, logits.options());
  grad.narrow(1, 0, T - 1).copy_(grad_scored.reshape({B, T - 1, V}).to(logits.scalar_type()));
  return grad;
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                  const at::Tensor&, int64_t);
using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, int64_t);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::causal_lm_cross_entropy_forward", "")
                             .typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::causal_lm_cross_entropy_backward", "")
                             .typed<BackwardSig>();
  return op;
}

class CausalLmCrossEntropyFunction
    : public torch::autograd::Function<CausalLmCrossEntropyFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& logits, const at::Tensor& labels,
                                                int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, lse, count] = forward_op().call(logits, labels, ignore_index);
    ctx->save_for_backward({logits, labels, lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return {loss};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor grad =
        backward_op().call(grads[0], saved[0], saved[1], saved[2], saved[3], ignore_index);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "causal_lm_cross_entropy_forward(Tensor logits, Tensor labels, int ignore_index) -> (Tensor "
      "loss, Tensor lse, Tensor count)");
  m.def(
      "causal_lm_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor labels, Tensor "
      "lse, Tensor count, int ignore_index) -> Tensor grad_logits");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("causal_lm_cross_entropy_forward", &forward_cpu);
  m.impl("causal_lm_cross_entropy_backward", &backward_cpu);
}

at::Tensor causal_lm_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                   int64_t ignore_index) {
  return CausalLmCrossEntropyFunction::apply(logits, labels, ignore_index)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_lm_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) {
  return forward_op().call(logits, labels, ignore_index);
}

at::Tensor causal_lm_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                            const at::Tensor& labels, const at::Tensor& lse,
                                            const at::Tensor& count, int64_t ignore_index) {
  return backward_op().call(grad_loss, logits, labels, lse, count, ignore_index);
}

// ---------------------------------------------------------------------------
// The switch

bool cross_entropy_fused_supports(const at::Tensor& logits) {
  const at::ScalarType t = logits.scalar_type();
  return logits.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
}

}  // namespace gdr
