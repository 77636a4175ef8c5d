// One forward and backward of the gated activation (fused op or ATen composite) through
// autograd, for the CPU and GPU tests that compare the two.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/gated_activation/gated_activation_op.h"

namespace gdr::test_support {

struct GatedActivationResult {
  at::Tensor y, grad_gate, grad_x;
};

inline GatedActivationResult run_gated_activation(bool fused, const at::Tensor& gate_in,
                                                  const at::Tensor& x_in, const at::Tensor& dy,
                                                  GatedActivationKind kind) {
  at::Tensor gate = gate_in.detach().requires_grad_(true);
  at::Tensor x = x_in.detach().requires_grad_(true);
  const at::Tensor y =
      fused ? gated_activation_fused(gate, x, kind) : gated_activation_composite(gate, x, kind);
  auto grads = torch::autograd::grad({y}, {gate, x}, {dy});
  return {y.detach(), grads[0], grads[1]};
}

}  // namespace gdr::test_support
