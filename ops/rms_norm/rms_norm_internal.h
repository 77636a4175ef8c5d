// Shared by the CPU and CUDA implementations of the RMSNorm ops; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace gdr::rms_norm_internal {

// Argument checks at the op boundary; messages name the op and the argument and say what
// was expected and what was given. `x_name` is "x" (zero-centred) or "o" (gated).
void check_forward_inputs(const char* op, const at::Tensor& x, const char* x_name,
                          const at::Tensor* z, const at::Tensor& weight);
void check_backward_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                           const char* x_name, const at::Tensor* z, const at::Tensor& weight,
                           const at::Tensor& rstd);
// The residual add's operand: defined, with `x`'s shape, dtype and device.
void check_same_as_x(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x,
                     const char* x_name);
// The residual-add backward's checks (sum in the role of x); true when grad_sum is given.
bool check_add_backward_inputs(const char* op, const at::Tensor& grad_y,
                               const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
                               const at::Tensor& weight, const at::Tensor& rstd);

}  // namespace gdr::rms_norm_internal
