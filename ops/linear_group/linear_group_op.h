// Several bias-free projections of one input as one autograd op: y_i = x @ W_i^T, whose
// backward sums the input gradient inside the GEMMs (each further product accumulates into
// dX through addmm's beta = 1 epilogue) instead of in one add kernel per extra consumer.
// The model's groups: the GDN's in_proj_qkv / z / b / a, the attention's q / k / v, the
// MLP's gate / up (models/qwen/layers.cc).
//
// x: [..., in], any dtype ATen's matmul takes; W_i: [out_i, in] of x's dtype and device;
// y_i: [..., out_i]. Plain ATen calls on whatever device x is on (CPU and CUDA alike), on
// the current stream.
//  - Forward: y_i carries the bits of at::linear(x, W_i) as the composite computes it
//    (the same ATen call, on the same operand; Note [Linear group bits]).
//  - dW_i: the bits of ATen's own linear backward (the mm that MmBackward0 runs).
//  - dX: the sum of dY_i @ W_i over the defined dY_i, each addition inside a GEMM
//    (dX = first product, then addmm_ with beta = 1), in order of increasing out_i (ties
//    in index order): one rounding per GEMM instead of one per GEMM and one per add. Not
//    the composite's bits; deterministic (the order is a function of the shapes), and no
//    less accurate in the model's groups. See Note [Linear group input gradient] in
//    linear_group.cc.
// Outputs whose gradient is undefined (unused) are skipped; weights that do not require a
// gradient get none.
//
// The model's switch: the execution policy's linear_group = fused|composite
// (kernels.linear_group, environment override GDR_LINEAR_GROUP; default fused) picks this
// op or one at::linear per weight (autograd then adds the input gradients), on every
// device.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <vector>

namespace gdr {

// The autograd-aware op: {x @ W_0^T, x @ W_1^T, ...}. Checks: at least one weight; each
// weight 2-D with size(1) == x.size(-1), of x's dtype and device.
std::vector<at::Tensor> linear_group(const at::Tensor& x, at::TensorList weights);

// The composite (reference; the model's path under the policy's linear_group = composite): one
// at::linear(x, W_i) per weight, autograd through them.
std::vector<at::Tensor> linear_group_composite(const at::Tensor& x, at::TensorList weights);

// The model's entry: the projections of x by `weights` (a Linear's ->weight each), through
// linear_group or the composite as the execution policy's linear_group says.
std::vector<at::Tensor> project(const at::Tensor& x, at::TensorList weights);

}  // namespace gdr
