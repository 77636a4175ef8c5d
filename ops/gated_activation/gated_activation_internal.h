// Shared by the CPU and CUDA implementations of the gated activation ops; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "ops/gated_activation/gated_activation_op.h"

namespace gdr::gated_activation_internal {

// Argument checks at the op boundary; messages name the op and the argument and say what
// was expected and what was given. Returns the kind.
GatedActivationKind check_forward_inputs(const char* op, const at::Tensor& gate,
                                         const at::Tensor& x, int64_t activation);
GatedActivationKind check_backward_inputs(const char* op, const at::Tensor& grad_y,
                                          const at::Tensor& gate, const at::Tensor& x,
                                          int64_t activation);

}  // namespace gdr::gated_activation_internal
