// Shared by the CPU and CUDA implementations of the pre-GDR gate op; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

namespace gdr::gate_internal {

// Argument checks at the op boundary; messages name the argument and say what was
// expected and what was given.
void check_forward_inputs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                          const at::Tensor& dt_bias);
void check_backward_inputs(const at::Tensor& grad_g, const at::Tensor& grad_beta,
                           const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& dt_bias);

kernels::GateShape gate_shape(const at::Tensor& a);
kernels::StridedOperand strided_operand(const at::Tensor& t);
kernels::ScalarKind scalar_kind(const at::Tensor& t);

void record_backward(const PreGdrGateBackwardRecord& record);

}  // namespace gdr::gate_internal
