// fused_adamw_step_: the optimizer tail of a training step on lists of same-indexed
// tensors, in place:
//   if grad_coef != 1: grads[i] *= grad_coef          (gradient clipping, FP32 multiply)
//   AdamW (decoupled weight decay) on masters[i], exp_avgs[i], exp_avg_sqs[i] with the
//   clipped gradient, taking step `step` (1 on the first update)
//   if bf16_params is not empty: bf16_params[i] = BF16(masters[i])  (round to nearest even)
// with the bits of ATen's sequence _foreach_mul_(grads, grad_coef) (when grad_coef != 1),
// _fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, {}, steps, lr, beta1, beta2,
// weight_decay, eps, amsgrad = false, maximize = false) with every steps[i] holding
// float(step), and _foreach_copy_(bf16_params, masters).
//
// CPU: that sequence (the reference). CUDA: one launch of kernels/fused_adamw/fused_adamw.h on the
// current stream when every tensor is contiguous (Note [Fused AdamW bits] there), else the
// sequence. Elementwise, hence deterministic either way. Errors name the list and index.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gdr {

// masters, grads, exp_avgs, exp_avg_sqs: Float, one list each, equally long, the i-th of
// each of masters[i]'s shape and device (all masters on one device); bf16_params: empty or
// as long, BFloat16. step >= 1.
void fused_adamw_step_(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& bf16_params, double lr, double beta1,
                       double beta2, double weight_decay, double eps, int64_t step,
                       double grad_coef);

namespace fused_adamw_internal {
// Argument checks shared by both devices (TORCH_CHECK with the op's name).
void check_inputs(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList bf16_params, int64_t step);
// The ATen sequence (the CPU implementation and the CUDA fallback).
void fused_adamw_reference(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList bf16_params, double lr,
                           double beta1, double beta2, double weight_decay, double eps,
                           int64_t step, double grad_coef);
}  // namespace fused_adamw_internal

}  // namespace gdr
