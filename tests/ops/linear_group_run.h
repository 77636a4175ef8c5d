// One forward and backward of a linear group (the fused op or the composite) through
// autograd, for the CPU and GPU tests that compare the two.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <vector>

#include "ops/linear_group/linear_group_op.h"

namespace gdr::test_support {

struct LinearGroupResult {
  std::vector<at::Tensor> ys;
  at::Tensor grad_x;                     // undefined when x needs no gradient
  std::vector<at::Tensor> grad_weights;  // undefined where a weight needs none or is unused
};

// dys[i] undefined: y_i is not used (it gets no upstream gradient). weight_needs_grad empty:
// every weight requires a gradient.
inline LinearGroupResult run_linear_group(bool fused, const at::Tensor& x_in,
                                          const std::vector<at::Tensor>& weights_in,
                                          const std::vector<at::Tensor>& dys,
                                          std::vector<bool> weight_needs_grad = {},
                                          bool x_needs_grad = true) {
  if (weight_needs_grad.empty()) weight_needs_grad.assign(weights_in.size(), true);
  const at::Tensor x = x_in.detach().requires_grad_(x_needs_grad);
  std::vector<at::Tensor> weights;
  for (size_t i = 0; i < weights_in.size(); ++i) {
    weights.push_back(weights_in[i].detach().requires_grad_(weight_needs_grad[i]));
  }
  const std::vector<at::Tensor> ys =
      fused ? linear_group(x, weights) : linear_group_composite(x, weights);
  std::vector<at::Tensor> used, grad_outputs, inputs;
  for (size_t i = 0; i < ys.size(); ++i) {
    if (dys[i].defined()) used.push_back(ys[i]), grad_outputs.push_back(dys[i]);
  }
  if (x_needs_grad) inputs.push_back(x);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weight_needs_grad[i]) inputs.push_back(weights[i]);
  }
  const std::vector<at::Tensor> grads =
      torch::autograd::grad(used, inputs, grad_outputs, /*retain_graph=*/false,
                            /*create_graph=*/false, /*allow_unused=*/true);
  LinearGroupResult r;
  for (const at::Tensor& y : ys) r.ys.push_back(y.detach());
  size_t next = 0;
  if (x_needs_grad) r.grad_x = grads[next++];
  for (size_t i = 0; i < weights.size(); ++i) {
    r.grad_weights.push_back(weight_needs_grad[i] ? grads[next++] : at::Tensor());
  }
  return r;
}

}  // namespace gdr::test_support
