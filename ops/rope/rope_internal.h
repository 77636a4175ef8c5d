// Shared by the CPU and CUDA implementations of the RoPE ops; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

namespace gdr::rope_internal {

// Argument checks at the op boundary: x (or grad_y) [B, H, T, hd] of a supported dtype;
// cos and sin FP32 [T, rotary_dim] on x's device with an even rotary_dim <= hd.
void check_inputs(const char* op, const at::Tensor& x, const char* x_name, const at::Tensor& cos,
                  const at::Tensor& sin);

}  // namespace gdr::rope_internal
