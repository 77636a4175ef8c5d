// The fused optimizer tail op (ops/fused_adamw/fused_adamw_op.h): schema, checks, the reference
// ATen sequence (CPU implementation). The CUDA implementation registers itself from
// ops/fused_adamw/fused_adamw_op_cuda.cc.
#include "ops/fused_adamw/fused_adamw_op.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <string>

namespace gdr {
namespace fused_adamw_internal {
namespace {

// list[i] is a defined tensor of `dtype`, masters[i]'s shape and device.
void check_like_master(at::TensorList list, const char* name, size_t i, at::ScalarType dtype,
                       const at::Tensor& master) {
  const at::Tensor& t = list[i];
  TORCH_CHECK(t.defined(), "fused_adamw_step_: expected ", name, "[", i,
              "] to be a defined tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "fused_adamw_step_: expected ", name, "[", i, "] of dtype ",
              dtype, " but got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == master.sizes(), "fused_adamw_step_: expected ", name, "[", i,
              "] of masters[", i, "]'s shape ", master.sizes(), " but got ", t.sizes());
  TORCH_CHECK(t.device() == master.device(), "fused_adamw_step_: expected ", name, "[", i,
              "] on masters[", i, "]'s device ", master.device(), " but got ", t.device());
}

}  // namespace

void check_inputs(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList bf16_params, int64_t step) {
  const size_t n = masters.size();
  TORCH_CHECK(grads.size() == n, "fused_adamw_step_: expected ", n,
              " grads (one per master) but got ", grads.size());
  TORCH_CHECK(exp_avgs.size() == n, "fused_adamw_step_: expected ", n,
              " exp_avgs (one per master) but got ", exp_avgs.size());
  TORCH_CHECK(exp_avg_sqs.size() == n, "fused_adamw_step_: expected ", n,
              " exp_avg_sqs (one per master) but got ", exp_avg_sqs.size());
  TORCH_CHECK(bf16_params.empty() || bf16_params.size() == n,
              "fused_adamw_step_: expected bf16_params empty or ", n,
              " tensors (one per master) but got ", bf16_params.size());
  TORCH_CHECK(step >= 1, "fused_adamw_step_: expected step >= 1 but got ", step);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& m = masters[i];
    TORCH_CHECK(m.defined(), "fused_adamw_step_: expected masters[", i, "] to be a defined tensor");
    TORCH_CHECK(m.scalar_type() == at::kFloat, "fused_adamw_step_: expected masters[", i,
                "] of dtype Float but got ", m.scalar_type());
    TORCH_CHECK(m.device() == masters[0].device(), "fused_adamw_step_: expected masters[", i,
                "] on masters[0]'s device ", masters[0].device(), " but got ", m.device());
    check_like_master(grads, "grads", i, at::kFloat, m);
    check_like_master(exp_avgs, "exp_avgs", i, at::kFloat, m);
    check_like_master(exp_avg_sqs, "exp_avg_sqs", i, at::kFloat, m);
    if (!bf16_params.empty()) check_like_master(bf16_params, "bf16_params", i, at::kBFloat16, m);
  }
}

void fused_adamw_reference(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList bf16_params, double lr,
                           double beta1, double beta2, double weight_decay, double eps,
                           int64_t step, double grad_coef) {
  if (masters.empty()) return;
  const at::NoGradGuard no_grad;  // masters are leaves that require grad in training
  if (grad_coef != 1.0) at::_foreach_mul_(grads, grad_coef);
  // What _foreach_add_(steps, 1) leaves in the trainer's former FP32 step counters.
  std::vector<at::Tensor> steps;
  steps.reserve(masters.size());
  for (const at::Tensor& m : masters) {
    steps.push_back(at::full({}, static_cast<double>(step), m.options().dtype(at::kFloat)));
  }
  at::_fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1,
                    beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
  if (!bf16_params.empty()) at::_foreach_copy_(bf16_params, masters);
}

}  // namespace fused_adamw_internal

namespace {

void fused_adamw_cpu(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList bf16_params, double lr,
                     double beta1, double beta2, double weight_decay, double eps, int64_t step,
                     double grad_coef) {
  fused_adamw_internal::check_inputs(masters, grads, exp_avgs, exp_avg_sqs, bf16_params, step);
  fused_adamw_internal::fused_adamw_reference(masters, grads, exp_avgs, exp_avg_sqs, bf16_params,
                                              lr, beta1, beta2, weight_decay, eps, step, grad_coef);
}

using FusedAdamWFn = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                          at::TensorList, double, double, double, double, double, int64_t, double);

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "fused_adamw_step_(Tensor(a!)[] masters, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] bf16_params, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, int step, float grad_coef) -> ()");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) { m.impl("fused_adamw_step_", &fused_adamw_cpu); }

void fused_adamw_step_(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& bf16_params, double lr, double beta1,
                       double beta2, double weight_decay, double eps, int64_t step,
                       double grad_coef) {
  // The dispatcher needs a tensor to pick the device: with no masters, check on the host
  // (the lists must then be empty too) and do nothing.
  if (masters.empty()) {
    fused_adamw_internal::check_inputs(masters, grads, exp_avgs, exp_avg_sqs, bf16_params, step);
    return;
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::fused_adamw_step_", "")
                             .typed<FusedAdamWFn>();
  op.call(masters, grads, exp_avgs, exp_avg_sqs, bf16_params, lr, beta1, beta2, weight_decay, eps,
          step, grad_coef);
}

}  // namespace gdr
