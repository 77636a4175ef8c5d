// Shared by the CPU and CUDA implementations of the causal attention op; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

namespace gdr::attention_internal {

// Argument checks at the op boundary; messages name the op and the argument and say what
// was expected and what was given.
void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double scale);
void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                           const at::Tensor& logsumexp, double scale);

}  // namespace gdr::attention_internal
