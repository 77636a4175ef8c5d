// Shared by the CPU and CUDA implementations of the causal conv1d + SiLU op; not a public
// API.
#pragma once

#include <ATen/core/Tensor.h>

namespace gdr::causal_conv1d_internal {

// Argument checks at the op boundary; messages name the op and the argument and say what
// was expected and what was given.
void check_forward_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight);
void check_backward_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                           const at::Tensor& weight);

}  // namespace gdr::causal_conv1d_internal
